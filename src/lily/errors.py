"""lily's exception types. Every message names what is wrong and what was expected."""


class LilyError(Exception):
    """Base class of lily's errors."""


class CheckpointError(LilyError, ValueError):
    """A checkpoint (config, index, tensor, file) is missing, malformed or not this architecture."""


class BackendUnavailableError(LilyError, RuntimeError):
    """The requested backend is not built into this install or has no device."""


class ContextLengthError(LilyError, ValueError):
    """A prompt (plus the tokens to generate) does not fit in the context window."""


class NonFiniteLogitsError(LilyError, FloatingPointError):
    """The model produced NaN or infinite logits (broken weights or a broken kernel): generation stops."""

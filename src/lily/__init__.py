"""lily: fast local inference of Qwen3.6-35B-A3B with a C++ core.

    import lily
    model = lily.load("mlx-community/Qwen3.6-35B-A3B-4bit")
    print(model.generate([{"role": "user", "content": "Hi"}], max_tokens=64))

The C++ extension (lily._lily) is imported only when a model is loaded on a C++ backend.
"""
from importlib.metadata import PackageNotFoundError, version as _version

from .chat import ChatTemplateError
from .errors import BackendUnavailableError, CheckpointError, ContextLengthError, LilyError, NonFiniteLogitsError
from .generation import GenerationChunk, GenerationResult, GenerationStats
from .model import Model, load
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, SamplingParamsError
from .session import Session
from .session_file import SessionFileError

try:
    __version__ = _version("lily")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.1.0"

__all__ = ["load", "Model", "Session", "SamplingParams", "GenerationResult", "GenerationChunk",
           "GenerationStats", "LilyError", "CheckpointError", "BackendUnavailableError", "ContextLengthError",
           "NonFiniteLogitsError",
           "ChatTemplateError", "SamplingParamsError", "PrefixCache", "SessionFileError", "__version__"]

"""The reasoning / content splitter of the server: it lives in lily.reasoning (shared with
`GenerationResult.reasoning` and `lily chat`); these names are re-exported for the server's modules."""
from __future__ import annotations

from ..reasoning import THINK, THINK_END, TOOL_CALL, ReasoningParser, held_suffix, prompt_opens_reasoning  # noqa: F401

"""Exceptions -> OpenAI error objects with the HTTP status OpenAI (or HTTP) uses for them."""
from __future__ import annotations

from ..chat import ChatTemplateError
from ..errors import ContextLengthError
from ..sampling import SamplingParamsError
from .grammar import GrammarError
from .protocol import APIError, bad_request
from .worker import Cancelled, NonFiniteLogits, QueueFull, RequestTimeout


def as_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), code="context_length_exceeded")
    if isinstance(e, (GrammarError, ChatTemplateError, SamplingParamsError)):
        return bad_request(str(e))
    if isinstance(e, Cancelled):
        return APIError(499, str(e), type="cancelled")
    if isinstance(e, QueueFull):
        return APIError(503, str(e), type="server_busy", code="queue_full")
    if isinstance(e, RequestTimeout):
        return APIError(408, str(e), type="timeout", code="request_timeout")
    if isinstance(e, NonFiniteLogits):
        return APIError(500, str(e), type="server_error", code="non_finite_logits")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def retry_headers(e: BaseException) -> dict[str, str] | None:
    return {"Retry-After": str(e.retry_after_s)} if isinstance(e, QueueFull) else None

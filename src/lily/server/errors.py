"""Exceptions -> OpenAI error objects with the HTTP status OpenAI (or HTTP) uses for them, and the headers that
tell clients whether and when to retry (the official SDKs read `x-should-retry`, `retry-after-ms` and
`Retry-After`)."""
from __future__ import annotations

import math
import random

from ..chat import ChatTemplateError
from ..errors import ContextLengthError
from ..sampling import SamplingParamsError
from .grammar import GrammarError
from .protocol import APIError, bad_request
from .worker import Cancelled, NonFiniteLogits, QueueFull, RequestTimeout, ServerShutdown

# a request the server stopped must not be sent again: the SDKs retry a 408 (and 5xx) unless told not to
NO_RETRY = {"x-should-retry": "false"}


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
        return APIError(503, str(e), type="server_busy", code="queue_full", headers=retry_headers(e))
    if isinstance(e, ServerShutdown):
        return APIError(503, str(e), type="server_error", code="server_shutting_down", headers=dict(NO_RETRY))
    if isinstance(e, RequestTimeout):
        return APIError(408, str(e), type="timeout", code="request_timeout", headers=dict(NO_RETRY))
    if isinstance(e, NonFiniteLogits):
        return APIError(500, str(e), type="server_error", code="non_finite_logits")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def retry_headers(e: BaseException) -> dict[str, str] | None:
    """Retry-After (whole seconds, HTTP) and retry-after-ms (what the OpenAI SDKs read first) of a full queue, the
    estimate jittered by +-25% so that the clients refused together do not all come back in the same instant."""
    if not isinstance(e, QueueFull):
        return None
    after = e.retry_after_s * random.uniform(0.75, 1.25)
    return {"Retry-After": str(max(1, math.ceil(after))), "retry-after-ms": str(max(1, round(after * 1000)))}

"""Plain ASGI pieces of the server: SSE responses that notice a client going away, the API key check, and
the request guard (body size limit from Content-Length, request counts for /metrics). Plain ASGI, so
streaming responses and disconnect detection pass through untouched. Errors are OpenAI error objects, or
Ollama's {"error": message} under /api/ (server/ollama.py)."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse

from .protocol import APIError
from .validation import too_large

# paths that need the API key (when one is set); /health, /docs, /openapi.json and /api/version stay open
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/metrics", "/api/")
OPEN_PATHS = ("/api/version",)
OLLAMA_PREFIX = "/api/"


# An over-limit body is read and dropped before the 413 goes out (up to this much): a client that is still
# sending when the answer comes and the connection closes sees a broken pipe, not the 413 (httpx.AsyncClient,
# AsyncOpenAI). Past it the connection is closed after the answer.
DRAIN_MAX_BYTES = 256 << 20


def error_response(e: APIError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """The error as the API of `path` answers it: Ollama's shape under /api/, else OpenAI's."""
    body = {"error": e.message} if path.startswith(OLLAMA_PREFIX) else e.body()
    return JSONResponse(body, status_code=e.status, headers={**(e.headers or {}), **(headers or {})})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 once it passes `limit` bytes (also without a Content-Length). The rest of an
    over-limit body is read and dropped first (up to DRAIN_MAX_BYTES), so the client reads the 413."""
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            e = too_large(limit, None)
            async for rest in request.stream():
                n += len(rest)
                if n > max(DRAIN_MAX_BYTES, 4 * limit):
                    e.headers = {"Connection": "close"}
                    break
            raise e
        parts.append(part)
    return b"".join(parts)


async def drain_body(receive, limit: int) -> bool:
    """Read and drop the rest of a request body; False when more than `limit` bytes were left (or the client
    went away), so the connection cannot be reused."""
    n = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        n += len(message.get("body", b""))
        if n > limit:
            return False
        if not message.get("more_body", False):
            return True


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client going away: on disconnect the stream is
    cancelled and `on_close` runs at once (the engine job is cancelled within one decode step)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        import anyio
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()


class APIKeyMiddleware:
    """401 for protected requests without `Authorization: Bearer KEY` (or `x-api-key: KEY`)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES) and \
                scope["path"] not in OPEN_PATHS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            got = headers.get("authorization", "")
            token = got[7:].strip() if got.lower().startswith("bearer ") else headers.get("x-api-key")
            if token != self.key:
                e = APIError(401, "Incorrect API key provided: send it as 'Authorization: Bearer KEY' (the key "
                                  "given to lily serve --api-key)", type="authentication_error", code="invalid_api_key")
                await error_response(e, path=scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestGuard:
    """413 for a body whose Content-Length is over the limit, before the app sees it (the body is drained
    first, so every client reads the answer); counts answers for /metrics."""

    def __init__(self, app, max_body_bytes: int, count: Callable[[str, int], None]):
        self.app, self.max_body_bytes, self.count = app, max_body_bytes, count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [0]

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        length, expect = None, False
        for k, v in scope.get("headers", []):
            if k.lower() == b"content-length":
                try:
                    length = int(v)
                except ValueError:
                    length = None
            elif k.lower() == b"expect":
                expect = v.lower() == b"100-continue"
        try:
            if length is not None and length > self.max_body_bytes:
                # a client that waits for "100 Continue" has sent no body yet: answer before asking for it
                drained = not expect and await drain_body(receive, max(DRAIN_MAX_BYTES, 4 * self.max_body_bytes))
                await error_response(too_large(self.max_body_bytes, length),
                                     headers=None if drained else {"Connection": "close"},
                                     path=path)(scope, receive, send_counted)
                return
            await self.app(scope, receive, send_counted)
        finally:
            if status[0]:
                self.count(path, status[0])

"""Which web pages may call the server from a browser (CORS).

The server listens on this machine without an API key by default, so any web page a user opens could call
it from their browser and read the answers (or drive the tools an agent runs). Pages served from this machine
(origins on localhost, 127.0.0.1 or [::1], any port: a web UI such as Open WebUI or a dev server) are allowed,
as Ollama does; `--cors-origins` adds others ('*': every origin). A request from any other origin gets a 403
before it reaches the API, and the first one from each origin is logged with the flag that would allow it.
Clients that are not browsers send no Origin header and are not concerned.
"""
from __future__ import annotations

import re
import sys
from typing import Callable

from starlette.middleware.cors import CORSMiddleware

from .api_error import APIError
from .middleware import error_response

LOOPBACK_ORIGIN = re.compile(r"^https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?$")
# response headers a page's script may read: when and whether to retry
EXPOSED_HEADERS = ["Retry-After", "retry-after-ms", "x-should-retry"]


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class OriginGuard:
    """ASGI: CORS for the allowed origins (preflights answered before the API key check, as browsers send them
    without credentials), 403 for requests from other origins."""

    def __init__(self, app, extra_origins: tuple[str, ...] = (), log: Callable[[str], None] | None = None):
        self.app = app
        self.any_origin = "*" in extra_origins
        self.extra = {o.rstrip("/") for o in extra_origins if o != "*"}
        self.cors = CORSMiddleware(app, allow_origins=["*"] if self.any_origin else sorted(self.extra),
                                   allow_origin_regex=LOOPBACK_ORIGIN.pattern, allow_methods=["*"],
                                   allow_headers=["*"], expose_headers=EXPOSED_HEADERS, max_age=600)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.refused: set[str] = set()

    def allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/") in self.extra or bool(LOOPBACK_ORIGIN.match(origin))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if self.allowed(origin):
            await self.cors(scope, receive, send)
            return
        host = _header(scope, b"host")
        if host is not None and origin.split("://", 1)[-1] == host:  # a page this server served (e.g. /docs)
            await self.app(scope, receive, send)
            return
        if origin not in self.refused and len(self.refused) < 1024:
            self.refused.add(origin)
            self.log(f"[lily serve] refused a request from the web page origin {origin!r} (CORS): by default only "
                     f"pages on this machine (localhost, 127.0.0.1, [::1]) may call this server from a browser; "
                     f"start lily serve with --cors-origins {origin} to allow it")
        e = APIError(403, f"requests from the web page origin {origin!r} are not allowed by this server (CORS); "
                          f"its operator can allow them with lily serve --cors-origins {origin}",
                     type="invalid_request_error", code="cors_origin_refused")
        await error_response(e, path=scope["path"])(scope, receive, send)

"""Which web pages may call the server from a browser (CORS).

The server listens on this machine without an API key by default, so any web page a user opens could call
it from their browser and read the answers (or drive the tools an agent runs). Pages served from this machine
(origins on localhost, 127.0.0.1 or [::1], any port: a web UI such as Open WebUI or a dev server) are allowed,
as Ollama does; `--cors-origins` adds others ('*': every origin). A request from any other origin gets a 403
before it reaches the API, and the first one from each origin is logged with the flag that would allow it.
Clients that are not browsers send no Origin header and are not concerned.

A page can also reach the server without any Origin check by rebinding its own DNS name to 127.0.0.1 (DNS
rebinding): its requests then carry `Host: attacker.example:PORT`. So a server bound to this machine answers only
requests whose Host names this machine (localhost, *.localhost, 127.x.x.x, [::1]) or a name `--allowed-hosts` adds,
as Ollama does; others get a 403 naming the flag. Bound to other interfaces, it accepts any Host unless the flag
lists them.
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


async def refuse(scope, receive, send, refused: set[str], logger: Callable[[str], None], what: str, *, code: str,
                 log: str, message: str) -> None:
    """A 403 `code` with `message`; the first refusal of each `what` is logged (at most 1,024 remembered)."""
    if what not in refused and len(refused) < 1024:
        refused.add(what)
        logger(f"[lily serve] {log}")
    e = APIError(403, message, type="invalid_request_error", code=code)
    await error_response(e, path=scope.get("path", ""))(scope, receive, send)


def host_name(host: str) -> str:
    """The name of a Host header without its port, lowercased ('[::1]:8000' -> '[::1]')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_name(name: str) -> bool:
    return name in ("localhost", "[::1]", "::1") or name.endswith(".localhost") or \
        bool(re.fullmatch(r"127(\.\d{1,3}){3}", name))


def is_loopback_bind(host: str) -> bool:
    """Whether binding to `host` listens on this machine only."""
    return is_loopback_name(host_name(host) if host.startswith("[") else host.strip().lower())


class HostGuard:
    """ASGI: 403 for a request whose Host header names neither this machine nor an allowed host (DNS rebinding).
    allowed: extra names ('*': any Host)."""

    def __init__(self, app, allowed: tuple[str, ...] = (), log: Callable[[str], None] | None = None):
        self.app = app
        self.any_host = "*" in allowed
        self.allowed = {host_name(h) for h in allowed if h != "*"}
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.refused: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
        host = _header(scope, b"host") if scope["type"] in ("http", "websocket") else None
        name = host_name(host) if host is not None else None
        if self.any_host or name is None or is_loopback_name(name) or name in self.allowed:
            await self.app(scope, receive, send)  # (no Host: an HTTP/1.0 client, never a browser)
            return
        await refuse(scope, receive, send, self.refused, self.log, name, code="host_not_allowed",
                     log=f"refused a request for the host name {name!r}: a server bound to this machine answers only "
                         f"localhost, 127.0.0.1 and [::1] (DNS rebinding); start lily serve with --allowed-hosts "
                         f"{name} to allow it",
                     message=f"requests for the host name {name!r} are not allowed by this server (it answers this "
                             f"machine's names only); its operator can allow it with lily serve --allowed-hosts {name}")


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
        await refuse(scope, receive, send, self.refused, self.log, origin, code="cors_origin_refused",
                     log=f"refused a request from the web page origin {origin!r} (CORS): by default only pages on "
                         f"this machine (localhost, 127.0.0.1, [::1]) may call this server from a browser; start "
                         f"lily serve with --cors-origins {origin} to allow it",
                     message=f"requests from the web page origin {origin!r} are not allowed by this server (CORS); "
                             f"its operator can allow them with lily serve --cors-origins {origin}")

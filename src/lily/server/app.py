"""`lily serve`: an OpenAI-compatible HTTP server (FastAPI) over one model, with Ollama's API beside it.

POST /v1/chat/completions, /v1/completions, /v1/responses (SSE streaming or not), /tokenize, /detokenize,
GET /v1/models, /health, /metrics, POST /v1/sessions/save (with --session-dir); /api/chat, /api/generate,
/api/tags, /api/show, /api/version (server/ollama.py). Requests run on one engine thread (server/worker.py)
that interleaves the decode steps of up to --parallel requests, each with its own session, all sharing a
prefix cache of snapshots, so a conversation that comes back longer is prefilled only from where the longest
stored prefix ends. Parsing, validation and tokenizing run in a thread pool, in an order that refuses
oversized input before any large work.

Shutdown (SIGTERM, Ctrl-C): new requests get a 503 while every job ends (queued ones a 503, started ones their
text so far, a finish_reason and a shutdown error), then the listener closes, the sessions are saved and the
process exits, all within --shutdown-grace seconds.
"""
from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LilyError
from ..model import Model
from .cors import HostGuard, OriginGuard
from .errors import as_api_error
from .middleware import APIKeyMiddleware, RequestGuard, SSEResponse, error_response, read_body
from .output import ChatOutput
from .prepared import PreparedCompletion
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       bad_request, completion_logprobs, new_id, normalize_chat_messages, now, parse_request)
from .scoring import prompt_logprobs
from .service import LilyServer, ServerConfig
from .streams import chat_stream, chat_whole, completion_stream, completion_whole, watch_disconnect
from .validation import validate_tools

__all__ = ["ServerConfig", "LilyServer", "create_app", "serve"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", "/v1/sessions/save", "/api/chat", "/api/generate", "/api/tags",
             "/api/show", "/api/version")


def _openapi_body(cls: Any) -> dict[str, Any]:
    """A typed request body for /docs (the handlers parse the body themselves, to answer OpenAI errors)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": cls.model_json_schema()}}}}


def create_app(model: Model, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    srv = LilyServer(model, config)

    async def save_periodically() -> None:
        """What ran since the last save survives a kill: sessions are saved every save_interval_s seconds
        (on the worker thread, between steps) when a generation finished since the last save."""
        saved_at = srv.metrics.tokens["generated"]
        while True:
            await asyncio.sleep(config.save_interval_s)
            done = srv.metrics.tokens["generated"]
            if done == saved_at:
                continue
            try:
                await asyncio.wrap_future(srv.worker.call(srv.save_sessions))
                saved_at = done
            except Exception as e:  # report and keep serving; the next interval tries again
                print(f"[lily serve] periodic save to {config.session_dir} failed: {e}")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.startup()
        saver = (asyncio.create_task(save_periodically())
                 if config.session_dir and config.save_interval_s > 0 else None)
        yield
        if saver is not None:
            saver.cancel()
        await run_in_threadpool(srv.shutdown)

    app = FastAPI(title="lily", lifespan=lifespan,
                  description="OpenAI-compatible server of lily (docs/server.md). Try a request from /docs.")
    app.state.lily = srv

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind),
                              path=request.url.path)

    @app.exception_handler(LilyError)
    async def _lily_error(request: Request, e: LilyError):
        return error_response(as_api_error(e), path=request.url.path)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception):
        return error_response(as_api_error(e), path=request.url.path)

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, key=config.api_key)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes,
                       count=lambda path, status: srv.metrics.request(path if path in ENDPOINTS else "other", status))
    # outermost: preflights (no Authorization header) are answered before the key check
    app.add_middleware(OriginGuard, extra_origins=tuple(config.cors_origins))
    if config.allowed_hosts is not None:  # outermost of all: a rebound DNS name is refused before anything else
        app.add_middleware(HostGuard, allowed=tuple(config.allowed_hosts))

    async def parse(cls: Any, request: Request) -> Any:
        """Body -> request model, refusing at once when the queue is full or the server is shutting down
        (before any large work, and again once the body is in: a shutdown may have begun meanwhile)."""
        srv.worker.check_room()
        raw = await read_body(request, config.max_body_bytes)
        srv.worker.check_room()
        return await run_in_threadpool(parse_request, cls, raw)

    @app.get("/health")
    async def health():
        w = srv.worker
        return {"status": "shutting_down" if srv.draining else "ok", "model": srv.name, "backend": model.backend,
                "busy": w.busy, "running": w.running, "parked": w.parked, "queued": w.queued(),
                "scoring": w.scoring, "batch": w.batch_info(),
                "max_context": model.max_context, "limits": srv.limits(), "stats": dict(w.stats),
                "speculative": srv.speculative_info(),
                "parking": {"requests": w.parked, "bytes": w.parked_bytes, "max_bytes": w.park_bytes,
                            "parks": w.stats["parks"], "resumes": w.stats["resumes"]},
                "cache": {"snapshots": len(srv.cache), "bytes": srv.cache.nbytes, "max_bytes": srv.cache.max_bytes,
                          "hits": srv.cache.hits, "misses": srv.cache.misses}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        w = srv.worker
        gauges = {"lily_requests_running": ("Requests decoding now", w.running),
                  "lily_requests_parked": ("Started requests set aside (state kept) for newer ones", w.parked),
                  "lily_requests_queued": ("Requests waiting for a running slot", w.queued()),
                  "lily_requests_scoring": ("Prompt-scoring requests (echo + logprobs) in progress", w.scoring),
                  "lily_decode_tokens_per_second": ("Tokens sent to all clients together, over the last 5 s",
                                                    w.decode_rate()),
                  "lily_parked_bytes": ("Bytes of engine state held by parked requests", w.parked_bytes),
                  "lily_park_budget_bytes": ("Most bytes parked requests may hold (--park-gib)", w.park_bytes),
                  "lily_prefix_cache_bytes": ("Bytes held by prefix-cache snapshots", srv.cache.nbytes),
                  "lily_prefix_cache_budget_bytes": ("Most bytes the prefix cache may hold (--cache-gib)",
                                                     srv.cache.max_bytes),
                  "lily_prefix_cache_snapshots": ("Snapshots in the prefix cache", len(srv.cache))}
        counters = {"lily_parks_total": ("Times a running request was parked for a newer one", w.stats["parks"]),
                    "lily_batched_steps_total": ("Forwards that decoded several streams together",
                                                 w.stats["batched_steps"]),
                    "lily_batched_rows_total": ("Stream rows those forwards decoded (rows / steps = occupancy)",
                                                w.stats["batched_rows"])}
        return PlainTextResponse(srv.metrics.render(gauges, srv.cache, counters),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_card() -> dict[str, Any]:
        return {"id": srv.name, "object": "model", "created": srv.started, "owned_by": "lily",
                "max_model_len": model.max_context, "backend": model.backend}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str):
        srv.check_model(name)
        return _model_card()

    @app.post("/v1/sessions/save")
    async def save_sessions():
        files = await asyncio.wrap_future(srv.worker.call(srv.save_sessions))
        return {"object": "list", "data": files}

    @app.post("/tokenize", openapi_extra=_openapi_body(TokenizeRequest))
    async def tokenize(request: Request):
        raw = await read_body(request, config.max_body_bytes)

        def work() -> dict[str, Any]:
            req = parse_request(TokenizeRequest, raw)
            srv.check_model(req.model)
            if req.messages is not None:
                messages = normalize_chat_messages(req.messages)
                text = model.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                                  tools=validate_tools(req.tools) or None,
                                                  **(req.chat_template_kwargs or {}))
            elif req.prompt is not None:
                text = req.prompt
            else:
                raise bad_request("tokenize needs prompt (text) or messages (chat)", param="prompt")
            ids = srv.tokenizer.encode(text)
            return {"count": len(ids), "max_model_len": model.max_context, "tokens": ids}
        return await run_in_threadpool(work)

    @app.post("/detokenize", openapi_extra=_openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await read_body(request, config.max_body_bytes))
        srv.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < model.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range: expected 0..{model.vocab_size - 1}", param="tokens")
        return {"prompt": model.tokenizer.decode(req.tokens)}

    @app.post("/v1/chat/completions", openapi_extra=_openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req = await parse(ChatCompletionRequest, request)
        prep = await run_in_threadpool(srv.prepare_chat, req)
        job, ahead = srv.submit(prep)
        out = ChatOutput(model.tokenizer, in_reasoning=prep.in_reasoning, tools=prep.tools,
                         parse_tools=prep.parse_tools, logprobs=bool(req.logprobs),
                         reasoning_field=config.reasoning_field)
        rid, created, name = new_id("chatcmpl"), now(), req.model or srv.name
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        if req.stream:
            return SSEResponse(chat_stream(srv, job, ahead, out, rid, created, name, include_usage),
                               job.request_cancel)
        return await chat_whole(srv, request, job, out, rid, created, name)

    @app.post("/v1/completions", openapi_extra=_openapi_body(CompletionRequest))
    async def completions(request: Request):
        req = await parse(CompletionRequest, request)
        prep = await run_in_threadpool(srv.prepare_completion, req)
        rid, created, name = new_id("cmpl"), now(), req.model or srv.name
        echo = prep.prompt_text if req.echo else ""
        if prep.score_prompt:  # one piece per decode round of the others; a hang-up, the timeout or a shutdown end it
            cancel = threading.Event()
            fut = srv.worker.call_sliced(prompt_logprobs(model, prep.ids, prep.n_top), cancel,
                                         config.request_timeout_s or None, what="scoring the prompt")
            watcher = asyncio.create_task(watch_disconnect(request, SimpleNamespace(request_cancel=cancel.set)))
            try:
                prep.prompt_logprobs = await asyncio.wrap_future(fut)
            finally:
                watcher.cancel()
                cancel.set()
        if prep.max_tokens == 0:
            return JSONResponse(_scored_prompt(srv, prep, rid, created, name, echo))
        job, ahead = srv.submit(prep)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return SSEResponse(completion_stream(srv, prep, job, ahead, rid, created, name, echo, include_usage),
                               job.request_cancel)
        return await completion_whole(srv, prep, request, job, rid, created, name, echo)

    from .ollama import add_ollama_routes
    from .responses import add_responses_routes
    add_responses_routes(app, srv, parse)
    add_ollama_routes(app, srv, parse)
    return app


def _scored_prompt(srv: LilyServer, prep: PreparedCompletion, rid: str, created: int, name: str,
                   echo: str) -> dict[str, Any]:
    """max_tokens 0: the prompt (with its logprobs when asked), nothing generated."""
    items = prep.prompt_logprobs
    lp = completion_logprobs(srv.model.tokenizer, items, 0) if items else None
    n = len(prep.ids)
    return {"id": rid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"index": 0, "text": echo, "logprobs": lp, "finish_reason": "length"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


def serve(model: Model, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
          log_level: str = "info") -> None:
    """Run the server until SIGTERM / Ctrl-C, which end every job first (see the module docstring), then save
    the sessions (with a session_dir) and exit."""
    import uvicorn

    config = config or ServerConfig()
    app = create_app(model, config)
    srv: LilyServer = app.state.lily
    grace = max(1.0, config.shutdown_grace_s)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # before uvicorn closes the listener: the jobs end (half the grace at most), new requests get 503
            await srv.drain(grace / 2)
            await super().shutdown(sockets)

    try:  # (uvicorn raises the caught signal again once it has shut down, as uvicorn.run does)
        Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                              timeout_graceful_shutdown=max(1, int(grace / 2)))).run()
    except KeyboardInterrupt:
        pass

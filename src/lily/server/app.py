"""`lily serve`: an OpenAI-compatible HTTP server (FastAPI) over one model, batch 1.

POST /v1/chat/completions, POST /v1/completions (SSE streaming or not), GET /v1/models, GET /health,
POST /v1/sessions/save (with --session-dir). Requests queue in arrival order and run on one engine thread
(server/worker.py) that keeps the conversation state and a prefix cache of snapshots, so a conversation
that comes back longer is prefilled only from where the longest stored prefix ends.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from ..chat import ChatTemplateError
from ..errors import ContextLengthError, LilyError
from ..model import Model
from ..sampling import SamplingParamsError
from ..prefix_cache import DEFAULT_CACHE_BYTES, DEFAULT_SNAPSHOT_INTERVAL, PrefixCache, ReplyTokens
from .grammar import GrammarConstraint, GrammarError, json_schema_grammar, tool_call_grammar
from .output import ChatOutput
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, completion_logprobs,
                       max_tokens_of, new_id, normalize_chat_messages, now, parse_request, sampling_of, timings,
                       usage)
from .reasoning import prompt_opens_reasoning
from .worker import Cancelled, EngineWorker, Job


REPLIES_FILE = "replies.json"  # exact tokens of recent replies (session_dir), see ReplyTokens


@dataclass
class ServerConfig:
    model_name: str | None = None          # the id clients send as `model` (default: the folder name)
    api_key: str | None = None
    session_dir: str | None = None         # prefix-cache snapshots saved here at shutdown, loaded at startup
    cache_bytes: int = DEFAULT_CACHE_BYTES
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL
    keepalive_s: float = 10.0              # SSE comment when nothing else was sent for this long
    progress_tokens: int = 4096            # prefill progress comment every this many tokens
    default_thinking: bool | None = None   # server default for enable_thinking (None: the template's)
    reasoning_field: str = "both"          # "both", "reasoning_content" or "reasoning"


class SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client going away: on disconnect the stream is
    cancelled and `on_close` runs at once (the engine job is cancelled within one decode step)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
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
    """401 for /v1/* requests without `Authorization: Bearer KEY` (or `x-api-key: KEY`). Plain ASGI, so
    streaming responses and disconnect detection pass through untouched."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            got = headers.get("authorization", "")
            token = got[7:].strip() if got.lower().startswith("bearer ") else headers.get("x-api-key")
            if token != self.key:
                e = APIError(401, "Incorrect API key provided: send it as 'Authorization: Bearer KEY' (the key "
                                  "given to lily serve --api-key)", type="authentication_error", code="invalid_api_key")
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _as_api_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), code="context_length_exceeded")
    if isinstance(e, (GrammarError, ChatTemplateError, SamplingParamsError)):
        return bad_request(str(e))
    if isinstance(e, Cancelled):
        return APIError(499, str(e), type="cancelled")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


class LilyServer:
    """The app's state: model, worker, prefix cache, and request preparation."""

    def __init__(self, model: Model, config: ServerConfig):
        self.model = model
        self.config = config
        self.name = config.model_name or (Path(model.path).name if model.path else "lily")
        self.cache = PrefixCache(config.cache_bytes, config.snapshot_interval)
        self.replies = ReplyTokens()
        self.worker = EngineWorker(model, self.cache, config.progress_tokens)
        self.started = now()
        self.fingerprint = model.fingerprint[:16]

    # ---- lifecycle ----------------------------------------------------------------------------------
    def startup(self) -> None:
        if self.config.session_dir:
            self.cache.load_dir(self.config.session_dir, self.model)
            self.replies.load(Path(self.config.session_dir) / REPLIES_FILE)
        self.worker.start()

    def save_sessions(self) -> list[str]:
        """On the worker thread: the live state and every snapshot of the cache -> session_dir."""
        if not self.config.session_dir:
            raise bad_request("this server has no --session-dir: start it with --session-dir DIR to keep "
                              "sessions on disk")
        s = self.worker.session
        extra = []
        if s._tokens:
            from ..snapshot import SessionSnapshot
            extra.append(SessionSnapshot(s._state.snapshot(), tuple(s._tokens), (),
                                         None if s._last_logits is None else s._last_logits.copy()))
        files = [str(p) for p in self.cache.save_dir(self.config.session_dir, self.model, extra)]
        self.replies.save(Path(self.config.session_dir) / REPLIES_FILE)
        return files

    def shutdown(self) -> None:
        if self.config.session_dir:
            try:
                self.worker.call(self.save_sessions).result(timeout=300)
            except Exception as e:  # shutting down: report, do not raise
                print(f"[lily serve] could not save sessions to {self.config.session_dir}: {e}")
        self.worker.stop()

    # ---- request preparation (runs in a thread pool: template rendering and tokenizing) -------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.name, self.model.path):
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.name!r} (see "
                                f"GET /v1/models)", param="model", code="model_not_found")

    def _check_context(self, n_prompt: int, max_tokens: int | None) -> None:
        ctx = self.model.max_context
        need = n_prompt + (max_tokens or 1)
        if need > ctx:
            asked = f"{n_prompt} in the prompt" + (f" and {max_tokens} for the completion" if max_tokens else "")
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, you requested "
                              f"{need} tokens ({asked}). Please reduce the length of the messages or completion.",
                              param="messages", code="context_length_exceeded")

    def prepare_chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        model = self.model
        messages = normalize_chat_messages(req.messages)
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "continue_final_message"})
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them from "
                              f"the request (messages, tools)", param="chat_template_kwargs")
        if req.reasoning_effort is not None:
            if req.reasoning_effort not in ("none", "minimal", "low", "medium", "high"):
                raise bad_request(f"reasoning_effort={req.reasoning_effort!r} is invalid: expected none, minimal, "
                                  f"low, medium or high", param="reasoning_effort")
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
        if "enable_thinking" not in kwargs and self.config.default_thinking is not None:
            kwargs["enable_thinking"] = self.config.default_thinking
        tools = req.tools or None
        choice = req.tool_choice
        forced: str | None = None
        if choice is not None and tools is None and choice != "none":
            raise bad_request("tool_choice is set but tools is empty: expected a list of tools", param="tool_choice")
        if isinstance(choice, dict):
            forced = ((choice.get("function") or {}).get("name"))
            if not isinstance(forced, str):
                raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                  "'function': {'name': ...}}", param="tool_choice")
        elif choice not in (None, "none", "auto", "required"):
            raise bad_request(f"tool_choice={choice!r} is invalid: expected 'none', 'auto', 'required' or a "
                              f"named function", param="tool_choice")
        try:
            text = model.chat_template.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages") from None
        ids = self.replies.encode(model.tokenizer, text)
        max_tokens = max_tokens_of(req)
        self._check_context(len(ids), max_tokens)
        sampling = sampling_of(req, model.generation_config, model.vocab_size, max_tokens=max_tokens,
                               logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs if req.logprobs else None)
        in_reasoning = prompt_opens_reasoning(text)
        start_after = model.tokenizer.think_end_id if in_reasoning else None
        constraint = None
        fmt = req.response_format or {}
        if fmt.get("type") in ("json_schema", "json_object"):
            schema = None
            if fmt["type"] == "json_schema":
                spec = fmt.get("json_schema") or {}
                schema = spec.get("schema", spec.get("json_schema"))
                if not isinstance(schema, dict):
                    raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format")
            constraint = GrammarConstraint(model, json_schema_grammar(schema), start_after)
        elif fmt.get("type") not in (None, "text"):
            raise bad_request(f"response_format.type={fmt.get('type')!r} is invalid: expected text, json_object or "
                              f"json_schema", param="response_format")
        if tools and (choice == "required" or forced):
            if constraint is not None:
                raise bad_request("response_format and a forced tool_choice cannot be combined", param="tool_choice")
            grammar = tool_call_grammar(tools, forced, parallel=req.parallel_tool_calls is not False)
            constraint = GrammarConstraint(model, grammar, start_after)
        return {"ids": ids, "sampling": sampling, "constraint": constraint, "in_reasoning": in_reasoning,
                "tools": tools, "parse_tools": bool(tools) and choice != "none"}

    def prepare_completion(self, req: CompletionRequest) -> dict[str, Any]:
        model = self.model
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt has {len(prompt)} entries: lily serves one prompt per request",
                                  param="prompt")
            prompt = prompt[0]
        if req.suffix:
            raise bad_request("suffix is not supported by this model", param="suffix")
        if isinstance(prompt, str):
            ids, text = self.replies.encode_text(model.tokenizer, prompt), prompt
        else:
            bad = [t for t in prompt if not 0 <= t < model.vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is out of range: expected 0..{model.vocab_size - 1}",
                                  param="prompt")
            ids, text = list(prompt), model.tokenizer.decode(prompt)
        if not ids:
            raise bad_request("prompt is empty: expected at least one token", param="prompt")
        max_tokens = 16 if req.max_tokens is None else max_tokens_of(req)
        self._check_context(len(ids), max_tokens)
        n_top = req.logprobs
        if n_top is not None and n_top < 0:
            raise bad_request(f"logprobs={n_top} is invalid: expected 0..20", param="logprobs")
        sampling = sampling_of(req, model.generation_config, model.vocab_size, max_tokens=max_tokens,
                               logprobs=n_top is not None, top_logprobs=n_top)
        return {"ids": ids, "sampling": sampling, "prompt_text": text, "raw": isinstance(prompt, str)}

    # ---- running a job -----------------------------------------------------------------------------------
    def submit(self, prep: dict[str, Any]) -> tuple[Job, int]:
        job = Job(prep["ids"], prep["sampling"], asyncio.get_running_loop(), constraint=prep.get("constraint"))
        return job, self.worker.submit(job)

    def remember_completion(self, prep: dict[str, Any], ids: list[int], stop_reason: Any) -> None:
        """Keep prompt + completion text -> exact tokens, so a longer prompt that extends it reuses them."""
        if isinstance(stop_reason, int) and ids and ids[-1] == stop_reason:
            ids = ids[:-1]
        if prep.get("raw"):
            self.replies.remember_text(prep["prompt_text"] + self.model.tokenizer.decode(ids), prep["ids"] + ids)

    def remember_reply(self, ids: list[int], stop_reason: Any) -> None:
        """Keep the exact tokens of a reply (without its stop token) for the next turn's tokenization, and
        run the final stop token now when nothing is waiting, so the next turn reuses it too."""
        if isinstance(stop_reason, int) and ids and ids[-1] == stop_reason:
            ids = ids[:-1]
            if self.worker.waiting == 0:
                self.worker.call(self.worker.session.flush)
        if ids:
            self.replies.remember(self.model.tokenizer.decode(ids), ids)


async def _watch_disconnect(request: Request, job: Job) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.request_cancel()
            return


async def _events(job: Job, keepalive_s: float) -> AsyncIterator[tuple]:
    """The job's events; ("idle",) when nothing came for keepalive_s."""
    while True:
        try:
            ev = await asyncio.wait_for(job.events.get(), timeout=keepalive_s)
        except asyncio.TimeoutError:
            yield ("idle",)
            continue
        yield ev
        if ev[0] in ("end", "error"):
            return


def create_app(model: Model, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    srv = LilyServer(model, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.startup()
        yield
        await run_in_threadpool(srv.shutdown)

    app = FastAPI(title="lily", lifespan=lifespan)
    app.state.lily = srv

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.exception_handler(LilyError)
    async def _lily_error(request: Request, e: LilyError):
        return error_response(_as_api_error(e))

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception):
        return error_response(_as_api_error(e))

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, key=config.api_key)

    @app.get("/health")
    async def health():
        w = srv.worker
        return {"status": "ok", "model": srv.name, "backend": model.backend, "busy": w.busy, "queued": w.waiting,
                "max_context": model.max_context, "stats": dict(w.stats),
                "cache": {"snapshots": len(srv.cache), "bytes": srv.cache.nbytes, "max_bytes": srv.cache.max_bytes,
                          "hits": srv.cache.hits, "misses": srv.cache.misses}}

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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await request.body())
        srv.check_model(req.model)
        prep = await run_in_threadpool(srv.prepare_chat, req)
        job, ahead = srv.submit(prep)
        out = ChatOutput(model.tokenizer, in_reasoning=prep["in_reasoning"], tools=prep["tools"],
                         parse_tools=prep["parse_tools"], logprobs=bool(req.logprobs),
                         reasoning_field=config.reasoning_field)
        rid, created, name = new_id("chatcmpl"), now(), req.model or srv.name
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        if req.stream:
            return SSEResponse(_chat_stream(srv, job, ahead, out, rid, created, name, include_usage),
                               job.request_cancel)
        return await _chat_whole(srv, request, job, out, rid, created, name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await request.body())
        srv.check_model(req.model)
        prep = await run_in_threadpool(srv.prepare_completion, req)
        job, ahead = srv.submit(prep)
        rid, created, name = new_id("cmpl"), now(), req.model or srv.name
        echo = prep["prompt_text"] if req.echo else ""
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return SSEResponse(_completion_stream(srv, prep, job, ahead, rid, created, name, echo, include_usage),
                               job.request_cancel)
        return await _completion_whole(srv, prep, request, job, rid, created, name, echo)

    return app


# ---- chat ---------------------------------------------------------------------------------------------------
def _comment(ev: tuple, ahead: int) -> str | None:
    if ev[0] == "progress":
        return f": prefill {ev[1]}/{ev[2]} tokens\n\n"
    if ev[0] == "idle":
        return ": keep-alive\n\n"
    return None


async def _chat_stream(srv: LilyServer, job: Job, ahead: int, out: ChatOutput, rid: str, created: int, name: str,
                       include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
            "system_fingerprint": srv.fingerprint}

    def chunk(delta: dict, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    if ahead:
        yield f": queued, {ahead} request(s) ahead\n\n"
    yield chunk({"role": "assistant", "content": ""})
    ids: list[int] = []
    queue_s = 0.0
    async for ev in _events(job, srv.config.keepalive_s):
        if ev[0] == "start":
            queue_s = ev[1]
        elif ev[0] == "chunk":
            c = ev[1]
            ids.append(c.token_id)
            deltas, items = out.push(c)
            lp = {"content": items} if items else None
            for k, d in enumerate(deltas):
                yield chunk(d, logprobs=lp if k == len(deltas) - 1 else None)
            if not deltas and lp:
                yield chunk({}, logprobs=lp)
            if c.finish_reason is not None:
                srv.remember_reply(ids, c.stop_reason)
                extra = {"timings": timings(c.stats, queue_s)}
                yield chunk({}, out.finish_reason, **extra)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(c.stats, out.reasoning_tokens), **extra})
        elif ev[0] == "error":
            err = _as_api_error(ev[1])
            if isinstance(ev[1], Cancelled):
                return
            yield sse(err.body())
        elif (text := _comment(ev, ahead)) is not None:
            yield text
    yield "data: [DONE]\n\n"


async def _collect(srv: LilyServer, request: Request, job: Job, on_chunk: Callable[[Any], None]) -> tuple[Any, float]:
    """Run a job to its end for a non-streaming response; a client that goes away cancels it."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    last, queue_s = None, 0.0
    try:
        async for ev in _events(job, 3600.0):
            if ev[0] == "start":
                queue_s = ev[1]
            elif ev[0] == "chunk":
                on_chunk(ev[1])
                last = ev[1]
            elif ev[0] == "error":
                raise _as_api_error(ev[1])
    finally:
        watcher.cancel()
        job.request_cancel()
    return last, queue_s


async def _chat_whole(srv: LilyServer, request: Request, job: Job, out: ChatOutput, rid: str, created: int,
                      name: str) -> JSONResponse:
    ids: list[int] = []

    def on_chunk(c):
        ids.append(c.token_id)
        out.push(c)

    last, queue_s = await _collect(srv, request, job, on_chunk)
    srv.remember_reply(ids, last.stop_reason)
    body = {"id": rid, "object": "chat.completion", "created": created, "model": name,
            "system_fingerprint": srv.fingerprint,
            "choices": [{"index": 0, "message": out.message(),
                         "logprobs": {"content": out.logprobs} if out.want_logprobs else None,
                         "finish_reason": out.finish_reason}],
            "usage": usage(last.stats, out.reasoning_tokens), "timings": timings(last.stats, queue_s)}
    return JSONResponse(body)


# ---- completions --------------------------------------------------------------------------------------------
async def _completion_stream(srv: LilyServer, prep: dict[str, Any], job: Job, ahead: int, rid: str, created: int,
                             name: str, echo: str, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": name}
    want_lp = job.sampling.logprobs
    if ahead:
        yield f": queued, {ahead} request(s) ahead\n\n"
    if echo:
        yield sse({**base, "choices": [{"index": 0, "text": echo, "logprobs": None, "finish_reason": None}]})
    queue_s, offset = 0.0, len(echo)
    ids: list[int] = []
    async for ev in _events(job, srv.config.keepalive_s):
        if ev[0] == "start":
            queue_s = ev[1]
        elif ev[0] == "chunk":
            c = ev[1]
            ids.append(c.token_id)
            if c.finish_reason:
                srv.remember_completion(prep, ids, c.stop_reason)
            lp = completion_logprobs(srv.model.tokenizer, [(c.token_id, c.logprob, c.top_logprobs)], offset) \
                if want_lp and c.logprob is not None else None
            offset += len(c.text)
            extra = {"timings": timings(c.stats, queue_s)} if c.finish_reason else {}
            if c.text or lp or c.finish_reason:
                yield sse({**base, "choices": [{"index": 0, "text": c.text, "logprobs": lp,
                                                "finish_reason": c.finish_reason}], **extra})
            if c.finish_reason and include_usage:
                yield sse({**base, "choices": [], "usage": usage(c.stats), **extra})
        elif ev[0] == "error":
            if isinstance(ev[1], Cancelled):
                return
            yield sse(_as_api_error(ev[1]).body())
        elif (text := _comment(ev, ahead)) is not None:
            yield text
    yield "data: [DONE]\n\n"


async def _completion_whole(srv: LilyServer, prep: dict[str, Any], request: Request, job: Job, rid: str,
                            created: int, name: str, echo: str) -> JSONResponse:
    texts: list[str] = []
    items: list[tuple] = []
    ids: list[int] = []

    def on_chunk(c):
        texts.append(c.text)
        ids.append(c.token_id)
        if c.logprob is not None:
            items.append((c.token_id, c.logprob, c.top_logprobs))

    last, queue_s = await _collect(srv, request, job, on_chunk)
    srv.remember_completion(prep, ids, last.stop_reason)
    lp = completion_logprobs(srv.model.tokenizer, items, len(echo)) if job.sampling.logprobs else None
    body = {"id": rid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"index": 0, "text": echo + "".join(texts), "logprobs": lp,
                         "finish_reason": last.finish_reason}],
            "usage": usage(last.stats), "timings": timings(last.stats, queue_s)}
    return JSONResponse(body)


def serve(model: Model, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
          log_level: str = "info") -> None:
    """Run the server until interrupted (Ctrl-C / SIGTERM saves sessions when a session_dir is set)."""
    import uvicorn
    uvicorn.run(create_app(model, config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

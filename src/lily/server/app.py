"""`lily serve`: an OpenAI-compatible HTTP server (FastAPI) over one model.

POST /v1/chat/completions, /v1/completions, /v1/responses (SSE streaming or not), /tokenize, /detokenize,
GET /v1/models, /health, /metrics, POST /v1/sessions/save (with --session-dir). Requests run on one engine
thread (server/worker.py) that interleaves the decode steps of up to --parallel requests, each with its own
session, all sharing a prefix cache of snapshots, so a conversation that comes back longer is prefilled only
from where the longest stored prefix ends. Parsing, validation and tokenizing run in a thread pool, in an
order that refuses oversized input before any large work.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import ChatTemplateError
from ..errors import LilyError
from ..model import Model
from ..prefix_cache import DEFAULT_CACHE_BYTES, DEFAULT_SNAPSHOT_INTERVAL, PrefixCache, ReplyTokens
from .errors import as_api_error, retry_headers
from .grammar import GrammarConstraint, json_schema_grammar, tool_call_grammar
from .metrics import Metrics
from .middleware import APIKeyMiddleware, RequestGuard, SSEResponse, error_response
from .output import ChatOutput
from .prepared import Prepared, PreparedChat, PreparedCompletion
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       bad_request, completion_logprobs, max_tokens_of, new_id, normalize_chat_messages, now,
                       parse_request, sampling_of)
from .reasoning import prompt_opens_reasoning
from .scoring import prompt_logprobs
from .streams import chat_stream, chat_whole, completion_stream, completion_whole
from .validation import (GILFreeTokenizer, check_text_fits, longest_token_bytes, message_text_bytes, too_large,
                         validate_tools)
from .worker import EngineWorker, Job

REPLIES_FILE = "replies.json"  # exact tokens of recent replies (session_dir), see ReplyTokens
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", "/v1/sessions/save")


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
    # fair serving
    max_tokens: int = 4096                 # default and ceiling of a request's max_tokens
    parallel: int = 4                      # requests decoding at once (interleaved steps)
    max_queue: int = 64                    # requests allowed to wait for a slot; more get 503
    request_timeout_s: float = 600.0       # arrival to last token; 0: no limit
    max_body_bytes: int = 4 << 20          # request body limit (413 beyond)
    prefill_slice: int = 512               # prefill tokens between decode rounds of the other requests
    cors_origins: tuple[str, ...] = ()     # browser origins allowed (CORS); empty: none
    save_interval_s: float = 300.0         # with session_dir: save sessions this often when requests ran; 0: off


class LilyServer:
    """The app's state: model, worker, prefix cache, metrics, and request preparation."""

    def __init__(self, model: Model, config: ServerConfig):
        self.model = model
        self.config = config
        self.name = config.model_name or (Path(model.path).name if model.path else "lily")
        self.cache = PrefixCache(config.cache_bytes, config.snapshot_interval)
        self.replies = ReplyTokens()
        self.metrics = Metrics()
        self.worker = EngineWorker(model, self.cache, config.progress_tokens, parallel=config.parallel,
                                   max_queue=config.max_queue, prefill_slice=config.prefill_slice,
                                   metrics=self.metrics)
        self.tokenizer = GILFreeTokenizer(model.tokenizer)
        self.max_token_bytes = longest_token_bytes(model.tokenizer, model.vocab_size)
        self.started = now()
        self.fingerprint = model.fingerprint[:16]

    # ---- lifecycle ----------------------------------------------------------------------------------
    def startup(self) -> None:
        if self.config.session_dir:
            self.cache.load_dir(self.config.session_dir, self.model.identity, self.model.engine)
            self.replies.load(Path(self.config.session_dir) / REPLIES_FILE)
        self.worker.start()

    def save_sessions(self) -> list[str]:
        """On the worker thread: the live states and every snapshot of the cache -> session_dir."""
        if not self.config.session_dir:
            raise bad_request("this server has no --session-dir: start it with --session-dir DIR to keep "
                              "sessions on disk")
        extra = [s.snapshot() for s in self.worker.sessions if s._tokens]
        extra = [type(e)(e.state, e.tokens, (), e.last_logits) for e in extra]  # the pending token is not in the state
        files = [str(p) for p in self.cache.save_dir(self.config.session_dir, self.model.identity, extra)]
        self.replies.save(Path(self.config.session_dir) / REPLIES_FILE)
        return files

    def shutdown(self) -> None:
        if self.config.session_dir:
            try:
                self.worker.call(self.save_sessions).result(timeout=300)
            except Exception as e:  # shutting down: report, do not raise
                print(f"[lily serve] could not save sessions to {self.config.session_dir}: {e}")
        self.worker.stop()

    def limits(self) -> dict[str, Any]:
        c = self.config
        return {"max_tokens": c.max_tokens, "parallel": c.parallel, "max_queue": c.max_queue,
                "request_timeout_s": c.request_timeout_s or None, "max_body_bytes": c.max_body_bytes,
                "max_context": self.model.max_context, "prefill_slice": c.prefill_slice,
                "cors_origins": list(c.cors_origins),
                "save_interval_s": (c.save_interval_s or None) if c.session_dir else None}

    # ---- request preparation (runs in a thread pool: parsing, template rendering and tokenizing) ----------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.name, self.model.path):
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.name!r} (see "
                                f"GET /v1/models)", param="model", code="model_not_found")

    def _max_tokens(self, requested: int | None, n_prompt: int, param: str) -> int:
        """The request's max_tokens capped by --max-tokens; without one, as much as the cap and the context
        allow. 400 when the prompt (+ an explicit max_tokens) does not fit."""
        ctx = self.model.max_context
        if requested is None:
            if n_prompt >= ctx:
                raise bad_request(f"This model's maximum context length is {ctx} tokens. However, the prompt is "
                                  f"{n_prompt} tokens, which leaves no room to generate. Please reduce the length of "
                                  f"the {param}.", param=param, code="context_length_exceeded")
            return min(self.config.max_tokens, ctx - n_prompt)
        capped = min(requested, self.config.max_tokens)
        if n_prompt + capped > ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens. However, you requested "
                              f"{n_prompt + capped} tokens ({n_prompt} in the prompt and {capped} for the "
                              f"completion). Please reduce the length of the {param} or completion.",
                              param=param, code="context_length_exceeded")
        return capped

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedChat:
        model = self.model
        self.check_model(req.model)
        tools = validate_tools(req.tools) or None
        messages = normalize_chat_messages(req.messages)
        check_text_fits(message_text_bytes([m for m in messages if m.get("role") != "assistant"]),
                        self.max_token_bytes, model.max_context - 1, "messages")
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
        choice = req.tool_choice
        forced: str | None = None
        if choice is not None and tools is None and choice != "none":
            raise bad_request("tool_choice is set but tools is empty: expected a list of tools", param="tool_choice")
        if isinstance(choice, dict):
            forced = ((choice.get("function") or {}).get("name")) or choice.get("name")
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
        check_text_fits(len(text.encode("utf-8", "replace")) - message_text_bytes(
            [m for m in messages if m.get("role") == "assistant"]), self.max_token_bytes, model.max_context - 1,
            "messages")
        ids = self.replies.encode(self.tokenizer, text)
        max_tokens = self._max_tokens(max_tokens_of(req), len(ids), "messages")
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
        return PreparedChat(ids=ids, sampling=sampling, constraint=constraint, request=req, in_reasoning=in_reasoning,
                            tools=tools, parse_tools=bool(tools) and choice != "none")

    def fim_prompt(self, prefix: str, suffix: str) -> str:
        tok = self.model.tokenizer
        marks = [tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
        if any(m is None for m in marks):
            raise bad_request("suffix (fill-in-the-middle) is not supported: this model's tokenizer has no "
                              "<|fim_prefix|>/<|fim_suffix|>/<|fim_middle|> tokens, so it has no fill-in-the-middle "
                              "template; send the prompt without suffix", param="suffix")
        return f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"

    def prepare_completion(self, req: CompletionRequest) -> PreparedCompletion:
        model = self.model
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt has {len(prompt)} entries: lily serves one prompt per request",
                                  param="prompt")
            prompt = prompt[0]
        if req.suffix:
            if not isinstance(prompt, str):
                raise bad_request("suffix needs a text prompt, not token ids", param="suffix")
            prompt = self.fim_prompt(prompt, req.suffix)
        if isinstance(prompt, str):
            check_text_fits(len(prompt.encode("utf-8")), self.max_token_bytes, model.max_context, "prompt")
            ids, text = self.replies.encode_text(self.tokenizer, prompt), prompt
        else:
            bad = [t for t in prompt if not 0 <= t < model.vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is out of range: expected 0..{model.vocab_size - 1}",
                                  param="prompt")
            ids, text = list(prompt), model.tokenizer.decode(prompt)
        if not ids:
            raise bad_request("prompt is empty: expected at least one token", param="prompt")
        n_top = req.logprobs
        if n_top is not None and n_top < 0:
            raise bad_request(f"logprobs={n_top} is invalid: expected 0..20", param="logprobs")
        if req.max_tokens == 0:  # prompt scoring only (echo + logprobs), or just the usage
            if len(ids) > model.max_context:
                raise bad_request(f"This model's maximum context length is {model.max_context} tokens. However, "
                                  f"the prompt is {len(ids)} tokens.", param="prompt", code="context_length_exceeded")
            max_tokens = 0
        else:
            max_tokens = self._max_tokens(16 if req.max_tokens is None else max_tokens_of(req), len(ids), "prompt")
        sampling = sampling_of(req, model.generation_config, model.vocab_size, max_tokens=max_tokens or None,
                               logprobs=n_top is not None, top_logprobs=n_top)
        return PreparedCompletion(ids=ids, sampling=sampling, prompt_text=text, raw=isinstance(prompt, str),
                                  score_prompt=bool(req.echo) and n_top is not None, n_top=n_top or 0,
                                  max_tokens=max_tokens)

    # ---- running a job -----------------------------------------------------------------------------------
    def submit(self, prep: Prepared) -> tuple[Job, int]:
        timeout = self.config.request_timeout_s or None
        job = Job(prep.ids, prep.sampling, asyncio.get_running_loop(), constraint=prep.constraint,
                  timeout_s=timeout)
        return job, self.worker.submit(job)

    def remember_completion(self, prep: PreparedCompletion, ids: list[int], stop_reason: Any) -> None:
        """Keep prompt + completion text -> exact tokens, so a longer prompt that extends it reuses them."""
        if isinstance(stop_reason, int) and ids and ids[-1] == stop_reason:
            ids = ids[:-1]
        if prep.raw:
            self.replies.remember_text(prep.prompt_text + self.model.tokenizer.decode(ids), prep.ids + ids)

    def remember_reply(self, ids: list[int], stop_reason: Any) -> None:
        """Keep the exact tokens of a reply (without its stop token) for the next turn's tokenization (the
        worker runs the final stop token through the model while idle, so the next turn reuses it too)."""
        if isinstance(stop_reason, int) and ids and ids[-1] == stop_reason:
            ids = ids[:-1]
        if ids:
            self.replies.remember(self.model.tokenizer.decode(ids), ids)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it passes `limit` bytes (also without a Content-Length)."""
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise too_large(limit, None)
        parts.append(part)
    return b"".join(parts)


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
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind))

    @app.exception_handler(LilyError)
    async def _lily_error(request: Request, e: LilyError):
        return error_response(as_api_error(e), headers=retry_headers(e))

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception):
        return error_response(as_api_error(e))

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, key=config.api_key)
    app.add_middleware(RequestGuard, max_body_bytes=config.max_body_bytes,
                       count=lambda path, status: srv.metrics.request(path if path in ENDPOINTS else "other", status))
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        # outermost: preflights (no Authorization header) are answered before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)

    async def parse(cls: Any, request: Request) -> Any:
        """Body -> request model, refusing at once when the queue is full (before any large work)."""
        srv.worker.check_room()
        raw = await read_body(request, config.max_body_bytes)
        return await run_in_threadpool(parse_request, cls, raw)

    @app.get("/health")
    async def health():
        w = srv.worker
        return {"status": "ok", "model": srv.name, "backend": model.backend, "busy": w.busy, "running": w.running,
                "queued": w.queued(), "max_context": model.max_context, "limits": srv.limits(), "stats": dict(w.stats),
                "cache": {"snapshots": len(srv.cache), "bytes": srv.cache.nbytes, "max_bytes": srv.cache.max_bytes,
                          "hits": srv.cache.hits, "misses": srv.cache.misses}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        w = srv.worker
        gauges = {"lily_requests_running": ("Requests decoding now", w.running),
                  "lily_requests_queued": ("Requests waiting for a running slot", w.queued()),
                  "lily_prefix_cache_bytes": ("Bytes held by prefix-cache snapshots", srv.cache.nbytes),
                  "lily_prefix_cache_snapshots": ("Snapshots in the prefix cache", len(srv.cache))}
        return PlainTextResponse(srv.metrics.render(gauges, srv.cache),
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
        if prep.score_prompt:
            fut = srv.worker.call(lambda: prompt_logprobs(model, prep.ids, prep.n_top))
            prep.prompt_logprobs = await asyncio.wrap_future(fut)
        if prep.max_tokens == 0:
            return JSONResponse(_scored_prompt(srv, prep, rid, created, name, echo))
        job, ahead = srv.submit(prep)
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return SSEResponse(completion_stream(srv, prep, job, ahead, rid, created, name, echo, include_usage),
                               job.request_cancel)
        return await completion_whole(srv, prep, request, job, rid, created, name, echo)

    from .responses import add_responses_routes
    add_responses_routes(app, srv, parse)
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
    """Run the server until interrupted (Ctrl-C / SIGTERM saves sessions when a session_dir is set)."""
    import uvicorn
    uvicorn.run(create_app(model, config), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

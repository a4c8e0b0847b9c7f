"""Ollama's API on the same server, for tools that speak only Ollama's (Open WebUI's Ollama mode, editor
plugins, the `ollama` Python client): POST /api/chat and /api/generate (NDJSON streaming, on by default as in
Ollama), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, and GET / ("Ollama is running").

A request becomes the same prepared job as an OpenAI one (template, tools, grammar, limits, worker, prefix
cache), so both APIs share one engine and its reuse. `options` map to lily's sampling: temperature, top_p,
top_k, min_p, repeat_penalty (repetition_penalty), presence_penalty, frequency_penalty, seed, stop and
num_predict (max_tokens; -1 and -2: the server's default). Ollama's load-time options (num_ctx, num_gpu,
num_thread, ...) and repeat_last_n are accepted and have no effect (lily's context is --max-context, its
repetition penalty covers the whole context); mirostat, typical_p and tfs_z, which lily does not implement,
are refused unless neutral, and an unknown option is refused naming the valid ones. `think` turns the
reasoning on or off (a level turns it on), `format` ("json" or a JSON schema) constrains the answer. lily's own
option `speculative` (true, false or the drafted tokens per step) sets speculative decoding as the OpenAI routes'
top-level field does; the final line then carries `draft_count` and `draft_accepted_count`.
Errors are Ollama's shape: {"error": message} with the HTTP status, also as the last line of a stream.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from ..errors import LilyError
from .errors import as_api_error
from .grammar import GrammarConstraint, json_schema_grammar
from .middleware import SSEResponse, read_body
from .output import ChatOutput
from .prepared import PreparedChat
from .protocol import APIError, ChatCompletionRequest, bad_request, sampling_of
from ..reasoning import prompt_opens_reasoning
from ..sampling import GENERATION_CONFIG_KEYS, RULE_OPTIONS
from .service import LilyServer
from .streams import collect, events
from .worker import STOP_SHUTDOWN, STOP_TIMEOUT, Cancelled

# the Ollama API version whose fields these routes follow (`think` and `thinking` came in 0.9)
OLLAMA_API_VERSION = "0.9.0"
# Ollama's `options` name -> lily's: the options every API takes under their own names, and Ollama's two renames
OPTION_NAMES = {**{k: k for k in RULE_OPTIONS if k != "repetition_penalty"},
                "repeat_penalty": "repetition_penalty", "num_predict": "max_tokens"}
# accepted, no effect: the model is loaded once with its own context size, threads and devices
IGNORED_OPTIONS = ("num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                   "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "numa", "repeat_last_n",
                   "penalize_newline")
# samplers lily does not have: only their neutral value is accepted
NEUTRAL_ONLY = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


class OllamaError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def ollama_error(e: BaseException) -> OllamaError:
    if isinstance(e, OllamaError):
        return e
    api = as_api_error(e)
    return OllamaError(api.status, api.message)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _obj(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise OllamaError(400, f"the request body is not valid JSON ({e}): expected a JSON object") from None
    if not isinstance(data, dict):
        raise OllamaError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def sampling_fields(options: Any) -> dict[str, Any]:
    """Ollama `options` -> the OpenAI request fields lily samples with (400 for what lily cannot honour)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object of Ollama model options (temperature, num_predict, ...)")
    out: dict[str, Any] = {}
    for k, v in options.items():
        if v is None or k in IGNORED_OPTIONS:
            continue
        if k in NEUTRAL_ONLY:
            if v != NEUTRAL_ONLY[k]:
                raise OllamaError(400, f"option {k}={v!r} is not supported: lily has no {k} sampler (leave it out, "
                                       f"or {NEUTRAL_ONLY[k]!r})")
            continue
        if k not in OPTION_NAMES:
            valid = ", ".join([*OPTION_NAMES, *IGNORED_OPTIONS, *NEUTRAL_ONLY])
            raise OllamaError(400, f"option {k!r} is not known: expected one of {valid}")
        if k == "num_predict":
            if not isinstance(v, int) or isinstance(v, bool) or v < -2 or v == 0:
                raise OllamaError(400, f"option num_predict={v!r} is invalid: expected a positive number of "
                                       f"tokens, or -1 / -2 for the server's default")
            if v < 0:
                continue
        out[OPTION_NAMES[k]] = v
    return out


def _format_field(fmt: Any) -> dict[str, Any] | None:
    """Ollama `format` -> OpenAI response_format."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise OllamaError(400, f"format={fmt!r} is invalid: expected \"json\" or a JSON schema object")


def _thinking(think: Any) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high"):
        return {"enable_thinking": True}
    raise OllamaError(400, f"think={think!r} is invalid: expected true, false, \"low\", \"medium\" or \"high\"")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Ollama messages -> OpenAI ones: tool calls with ids, tool results answering them, `thinking` kept as
    the reasoning of earlier turns."""
    if not isinstance(messages, list) or not messages:
        raise OllamaError(400, "messages must be a non-empty list of {role, content} messages")
    out, calls = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise OllamaError(400, f"messages[{i}] must be an object with role and content")
        if m.get("images"):
            raise OllamaError(400, f"messages[{i}] has images: lily serves a text-only model")
        msg: dict[str, Any] = {"role": m.get("role"), "content": m.get("content")}
        if m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        if m.get("tool_calls"):
            msg["tool_calls"] = []
            for c in m["tool_calls"]:
                calls += 1
                fn = (c or {}).get("function") or {}
                msg["tool_calls"].append({"id": f"call_{calls}", "type": "function",
                                          "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or {}}})
        if msg["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_name") or m.get("tool_call_id") or f"call_{calls}"
        out.append(msg)
    return out


class OllamaRoutes:
    def __init__(self, srv: LilyServer):
        self.srv, self.model = srv, srv.model

    # ---- facts ---------------------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        return (self.srv.name, f"{self.srv.name}:latest", *((self.model.path,) if self.model.path else ()))

    def check_model(self, name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required: expected the name GET /api/tags lists")
        if name not in self.names():
            raise OllamaError(404, f"model {name!r} not found: this server serves {self.srv.name!r}")
        return name

    def details(self) -> dict[str, Any]:
        q = self.model.config.quant_default
        n = self.model.params
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        return {"parent_model": "", "format": "safetensors", "family": "qwen3moe", "families": ["qwen3moe"],
                "parameter_size": size, "quantization_level": f"MLX_{q.bits}BIT" if q else "BF16"}

    def card(self) -> dict[str, Any]:
        return {"name": f"{self.srv.name}:latest", "model": f"{self.srv.name}:latest",
                "modified_at": datetime.fromtimestamp(self.srv.started, timezone.utc).isoformat(),
                "size": self.model.nbytes, "digest": self.srv.model.identity.fingerprint, "details": self.details()}

    def show(self, name: str) -> dict[str, Any]:
        cfg = self.model.config
        params = "\n".join(f"{k} {v}" for k, v in sorted(self.model.generation_config.items())
                           if k in GENERATION_CONFIG_KEYS)
        return {"modelfile": f"# lily serves {self.model.path}\nFROM {self.model.path}\n",
                "parameters": params, "template": self.model.chat_template.source or "", "details": self.details(),
                "model_info": {"general.architecture": "qwen3moe", "general.parameter_count": self.model.params,
                               "qwen3moe.context_length": self.model.max_context,
                               "qwen3moe.block_count": cfg.num_hidden_layers,
                               "qwen3moe.embedding_length": cfg.hidden_size,
                               "qwen3moe.expert_count": cfg.num_experts,
                               "qwen3moe.expert_used_count": cfg.num_experts_per_tok},
                "capabilities": ["completion", "tools", "thinking"], "modified_at": self.card()["modified_at"]}

    # ---- preparing a request -------------------------------------------------------------------------
    def prepare_chat(self, body: dict[str, Any]) -> PreparedChat:
        req = {"model": None, "messages": chat_messages(body.get("messages")), "tools": body.get("tools") or None,
               "response_format": _format_field(body.get("format")), **sampling_fields(body.get("options")),
               "chat_template_kwargs": _thinking(body.get("think")) or None}
        if body.get("logprobs"):
            req.update(logprobs=True, top_logprobs=body.get("top_logprobs"))
        try:
            chat = ChatCompletionRequest.model_validate(req)
        except Exception as e:  # a value of the wrong type in options
            raise OllamaError(400, f"invalid request: {e}") from None
        return self.srv.prepare_chat(chat, speculative_param="options.speculative")

    def prepare_generate(self, body: dict[str, Any]) -> PreparedChat:
        """/api/generate: the prompt as a user turn (with `system`) through the chat template, or with raw=true
        as it is; `context` (the ids a previous answer returned) goes before it; `suffix` fills in the middle."""
        if body.get("images"):
            raise OllamaError(400, "images are not supported: lily serves a text-only model")
        if body.get("template"):
            raise OllamaError(400, "template is not supported: lily renders the checkpoint's own chat template "
                                   "(use raw=true to send the prompt as it is)")
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise OllamaError(400, "prompt must be a string")
        model, srv = self.model, self.srv
        raw = bool(body.get("raw"))
        if body.get("suffix"):
            text, raw = srv.fim_prompt(prompt, body["suffix"]), True
        elif raw:
            text = prompt
        else:
            messages = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + \
                       [{"role": "user", "content": prompt}]
            kwargs = _thinking(body.get("think"))
            if "enable_thinking" not in kwargs and srv.config.default_thinking is not None:
                kwargs["enable_thinking"] = srv.config.default_thinking
            text = model.chat_template.render(messages, add_generation_prompt=True, **kwargs)
        context = body.get("context") or []
        if not isinstance(context, list) or not all(isinstance(t, int) and 0 <= t < model.vocab_size
                                                    for t in context):
            raise OllamaError(400, f"context must be the token ids a previous answer returned (each "
                                   f"0..{model.vocab_size - 1})")
        ids = list(context) + srv.tokenizer.encode(text)
        if not ids:
            raise OllamaError(400, "prompt is empty")
        fields = sampling_fields(body.get("options"))
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}], **fields})
        max_tokens = srv.max_tokens_for(fields.get("max_tokens"), len(ids), "prompt")
        sampling = sampling_of(req, model.generation_config, model.vocab_size, max_tokens=max_tokens,
                               logprobs=bool(body.get("logprobs")), top_logprobs=body.get("top_logprobs"),
                               speculative=srv.speculative_of(req.speculative, "options.speculative"))
        in_reasoning = not raw and prompt_opens_reasoning(text)
        constraint = None
        fmt = _format_field(body.get("format"))
        if fmt is not None:
            schema = fmt.get("json_schema", {}).get("schema") if fmt["type"] == "json_schema" else None
            constraint = GrammarConstraint(model, json_schema_grammar(schema),
                                           model.tokenizer.think_end_id if in_reasoning else None)
        return PreparedChat(ids=ids, sampling=sampling, constraint=constraint, request=req, in_reasoning=in_reasoning,
                            tools=None, parse_tools=False)


def _stats(c: Any) -> dict[str, Any]:
    s = c.stats
    out = {"done_reason": c.finish_reason, "total_duration": _ns(s.total_s), "load_duration": 0,
           "prompt_eval_count": s.prefill_tokens, "prompt_eval_duration": _ns(s.prefill_s),
           "eval_count": s.generated_tokens, "eval_duration": _ns(s.decode_s)}
    if s.drafted_tokens:  # lily's own: speculative decoding's drafted tokens and those the verify kept
        out.update(draft_count=s.drafted_tokens, draft_accepted_count=s.accepted_tokens)
    if c.token_id < 0 and c.stop_reason in (STOP_TIMEOUT, STOP_SHUTDOWN):
        out["stop_reason"] = c.stop_reason
    return out


def _ollama_calls(out: ChatOutput) -> list[dict[str, Any]]:
    calls = []
    for call in out.tool_calls:
        fn = call.to_openai()["function"]
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"] else {}
        except ValueError:  # cut off by num_predict: the partial text, as the OpenAI route returns it
            args = {"_partial_arguments": fn["arguments"]}
        calls.append({"function": {"name": fn["name"], "arguments": args}})
    return calls


def _logprobs(items: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not items:
        return None
    return [{"token": i["token"], "logprob": i["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in i["top_logprobs"]]}
            for i in items]


def add_ollama_routes(app: FastAPI, srv: LilyServer, parse: Callable) -> None:
    routes = OllamaRoutes(srv)
    config = srv.config

    async def body_of(request: Request) -> dict[str, Any]:
        srv.worker.check_room()
        raw = await read_body(request, config.max_body_bytes)
        srv.worker.check_room()
        return _obj(raw)

    def fail(e: BaseException) -> JSONResponse:
        err = ollama_error(e)
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_API_VERSION}

    @app.get("/", response_class=PlainTextResponse)
    async def root():  # what Ollama answers there: some clients probe it before anything else
        return "Ollama is running (lily serve: Ollama's API under /api, OpenAI's under /v1)"

    @app.get("/api/tags")
    async def tags():
        return {"models": [routes.card()]}

    @app.get("/api/ps")
    async def ps():
        card = routes.card()
        return {"models": [{**card, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": srv.model.max_context}]}

    @app.post("/api/show")
    async def show(request: Request):
        try:
            body = _obj(await read_body(request, config.max_body_bytes))
            return routes.show(routes.check_model(body.get("model") or body.get("name")))
        except (OllamaError, APIError, LilyError) as e:
            return fail(e)

    async def run(request: Request, kind: str):
        try:
            body = await body_of(request)
            name = routes.check_model(body.get("model"))
            if kind == "generate" and not body.get("prompt") and not body.get("suffix"):
                return {"model": name, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
            prepare = routes.prepare_chat if kind == "chat" else routes.prepare_generate
            prep = await run_in_threadpool(prepare, body)
            job, _ = srv.submit(prep)
        except (OllamaError, APIError, LilyError) as e:
            return fail(e)
        want_lp = bool(body.get("logprobs"))
        out = ChatOutput(srv.model.tokenizer, in_reasoning=prep.in_reasoning, tools=prep.tools,
                         parse_tools=prep.parse_tools, logprobs=want_lp, reasoning_field="reasoning")
        ids: list[int] = []

        def piece(deltas: list[dict[str, Any]]) -> tuple[str, str]:
            content = "".join(d.get("content") or "" for d in deltas)
            return content, "".join(d.get("reasoning") or "" for d in deltas)

        def message(content: str, thinking: str, calls: list | None = None) -> dict[str, Any]:
            m: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                m["thinking"] = thinking
            if calls:
                m["tool_calls"] = calls
            return m

        def line(content: str, thinking: str, done: bool, lp=None, extra: dict | None = None) -> dict[str, Any]:
            d: dict[str, Any] = {"model": name, "created_at": _now()}
            if kind == "chat":
                d["message"] = message(content, thinking, (extra or {}).pop("tool_calls", None))
            else:
                d["response"] = content
                if thinking:
                    d["thinking"] = thinking
            if lp:
                d["logprobs"] = lp
            d["done"] = done
            return {**d, **(extra or {})}

        def final(c: Any) -> dict[str, Any]:
            srv.remember_reply(ids, c.stop_reason)
            extra = _stats(c)
            if kind == "chat" and out.tool_calls:
                extra["tool_calls"] = _ollama_calls(out)
            if kind == "generate":
                extra["context"] = prep.ids + ids
            return extra

        if body.get("stream", True) is False:
            lps: list[dict[str, Any]] = []

            def on_chunk(c):
                if c.token_id >= 0:
                    ids.append(c.token_id)
                lps.extend(out.push(c)[1] or [])

            try:
                last, _ = await collect(srv, request, job, on_chunk)
            except (APIError, LilyError) as e:
                return fail(e)
            return line("".join(out.content_text), "".join(out.reasoning_text), True, _logprobs(lps), final(last))

        async def ndjson() -> AsyncIterator[str]:
            async for ev in events(job, config.keepalive_s):
                if ev[0] == "chunk":
                    c = ev[1]
                    if c.token_id >= 0:
                        ids.append(c.token_id)
                    deltas, items = out.push(c)
                    content, thinking = piece(deltas)
                    if content or thinking or items:
                        yield json.dumps(line(content, thinking, False, _logprobs(items)), ensure_ascii=False) + "\n"
                    if c.finish_reason is not None:
                        yield json.dumps(line("", "", True, None, final(c)), ensure_ascii=False) + "\n"
                elif ev[0] == "error":
                    if isinstance(ev[1], Cancelled):
                        return
                    yield json.dumps({"error": ollama_error(ev[1]).message}, ensure_ascii=False) + "\n"

        return SSEResponse(ndjson(), job.request_cancel, media_type="application/x-ndjson")

    @app.post("/api/chat")
    async def chat(request: Request):
        return await run(request, "chat")

    @app.post("/api/generate")
    async def generate(request: Request):
        return await run(request, "generate")

"""The server's state and request preparation (`LilyServer`), apart from the routes (server/app.py): the model, the
engine worker, the prefix cache and the memory budgets, and turning a parsed request into a prepared job
(template rendering, tokenizing, limits, grammars) in a thread pool."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..chat import ChatTemplateError
from ..model import Model
from ..prefix_cache import DEFAULT_SNAPSHOT_INTERVAL, PrefixCache
from ..reply_tokens import ReplyTokens
from .budget import memory_budgets
from .grammar import GrammarConstraint, json_schema_grammar, tool_call_grammar
from .metrics import Metrics
from .prepared import Prepared, PreparedChat, PreparedCompletion
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, max_tokens_of,
                       normalize_chat_messages, now, sampling_of)
from ..reasoning import prompt_opens_reasoning
from ..speculative import REQUEST_VALUES, describe, drafts, head_summary, no_head_message, request_value
from .validation import GILFreeTokenizer, check_text_fits, longest_token_bytes, message_text_bytes, validate_tools
from .worker import EngineWorker, Job

REPLIES_FILE = "replies.json"  # exact tokens of recent replies (session_dir), see ReplyTokens


@dataclass
class ServerConfig:
    model_name: str | None = None          # the id clients send as `model` (default: the folder name)
    api_key: str | None = None
    session_dir: str | None = None         # prefix-cache snapshots saved here at shutdown, loaded at startup
    cache_bytes: int | None = None         # prefix-cache budget; None: from the model and the free memory (budget.py)
    park_bytes: int | None = None          # parked requests' states; None: as cache_bytes; 0: no parking
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
    cors_origins: tuple[str, ...] = ()     # browser origins allowed besides this machine's (CORS); '*': all
    # Host header names answered besides this machine's (DNS rebinding); None: any (the default of create_app and of
    # a server bound to other interfaces than loopback); '*' inside: any
    allowed_hosts: tuple[str, ...] | None = None
    shutdown_grace_s: float = 5.0          # SIGTERM/Ctrl-C: jobs end, sessions are saved and the server exits in this
    save_interval_s: float = 300.0         # with session_dir: save sessions this often when requests ran; 0: off
    # speculative decoding (the MTP head) for requests that do not set it: None auto, True on, False off, k drafts
    speculative: bool | int | None = None


class LilyServer:
    """The app's state: model, worker, prefix cache, metrics, and request preparation."""

    def __init__(self, model: Model, config: ServerConfig):
        self.model = model
        self.config = config
        self.name = config.model_name or (Path(model.path).name if model.path else "lily")
        ok, _ = request_value(config.speculative)
        if not ok or isinstance(config.speculative, str):
            raise ValueError(f"ServerConfig.speculative={config.speculative!r} is invalid: expected None (auto), "
                             f"True, False or the drafted tokens per step")
        if config.speculative is not None and config.speculative is not False and not drafts(model):
            raise ValueError(no_head_message(f"speculative={describe(config.speculative)} as the server's default",
                                             model, "start the server with `lily serve --mtp SOURCE`"))
        self.budgets = memory_budgets(model, config.parallel, config.cache_bytes, config.park_bytes)
        self.cache = PrefixCache(self.budgets.cache_bytes, config.snapshot_interval)
        self.replies = ReplyTokens()
        self.metrics = Metrics()
        self.worker = EngineWorker(model, self.cache, config.progress_tokens, parallel=config.parallel,
                                   max_queue=config.max_queue, prefill_slice=config.prefill_slice,
                                   park_bytes=self.budgets.park_bytes, metrics=self.metrics)
        self.tokenizer = GILFreeTokenizer(model.tokenizer)
        self.max_token_bytes = longest_token_bytes(model.tokenizer, model.vocab_size)
        self.started = now()
        self.fingerprint = model.fingerprint[:16]
        self.draining = False  # shutting down: /health says so

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
        extra = [s.snapshot() for s in self.worker.sessions if s.state_tokens]
        extra = [type(e)(e.state, e.tokens, (), e.last_logits) for e in extra]  # the pending token is not in the state
        files = [str(p) for p in self.cache.save_dir(self.config.session_dir, self.model.identity, extra)]
        self.replies.save(Path(self.config.session_dir) / REPLIES_FILE)
        return files

    async def drain(self, timeout_s: float) -> None:
        """Shutdown, first part (the listener still open, so a new request gets a 503 rather than a refused
        connection): every queued request gets a 503, every started one its text so far, a finish_reason and a
        shutdown error, at its next step; waits until the worker has none left (at most timeout_s)."""
        self.draining = True
        self.worker.begin_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.worker.idle() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the handlers write the last events their jobs got

    def shutdown(self) -> None:
        """Shutdown, last part: the sessions saved (with --session-dir), the engine thread ended."""
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
                "cors_origins": ["http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*", *c.cors_origins],
                "allowed_hosts": None if c.allowed_hosts is None or "*" in c.allowed_hosts else
                ["localhost", "127.0.0.1", "[::1]", *c.allowed_hosts],
                "cache_bytes": self.budgets.cache_bytes, "park_bytes": self.budgets.park_bytes,
                "budgets": dict(self.budgets.how), "shutdown_grace_s": c.shutdown_grace_s,
                "save_interval_s": (c.save_interval_s or None) if c.session_dir else None}

    def speculative_info(self) -> dict[str, Any]:
        """/health's `speculative`: whether the model drafts, the server's default, and the totals so far."""
        t = self.metrics.tokens
        return {"drafts": drafts(self.model), "default": describe(self.config.speculative),
                "summary": head_summary(self.model, self.config.speculative),
                "drafted_tokens": t["drafted"], "accepted_tokens": t["accepted"], "verify_steps": t["verify_steps"],
                "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None}

    # ---- request preparation (runs in a thread pool: parsing, template rendering and tokenizing) ----------
    def speculative_of(self, value: Any, param: str = "speculative") -> bool | int | None:
        """A request's `speculative` -> the value it runs with (null: the server's default); 400 for a bad value,
        or for drafting asked of a model that cannot draft."""
        ok, v = request_value(value)
        if not ok:
            raise bad_request(f"{param}={value!r} is invalid: expected {REQUEST_VALUES}", param=param)
        if v is None:
            return self.config.speculative
        if v is not False and not drafts(self.model):
            shown = "true" if v is True else str(v)
            raise bad_request(no_head_message(f"{param}={shown}", self.model,
                                              "start the server with `lily serve --mtp SOURCE`",
                                              f"leave {param} out (plain decoding, the same output)"),
                              param=param, code="speculative_unavailable")
        return v

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.name, self.model.path):
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.name!r} (see "
                                f"GET /v1/models)", param="model", code="model_not_found")

    def max_tokens_for(self, requested: int | None, n_prompt: int, param: str) -> int:
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

    def prepare_chat(self, req: ChatCompletionRequest, speculative_param: str = "speculative") -> PreparedChat:
        model = self.model
        self.check_model(req.model)
        speculative = self.speculative_of(req.speculative, speculative_param)
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
        max_tokens = self.max_tokens_for(max_tokens_of(req), len(ids), "messages")
        sampling = sampling_of(req, model.generation_config, model.vocab_size, max_tokens=max_tokens,
                               logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs if req.logprobs else None,
                               speculative=speculative)
        in_reasoning = prompt_opens_reasoning(text)
        start_after = model.tokenizer.think_end_id if in_reasoning else None
        constraint = None
        fmt = req.response_format or {}
        if fmt.get("type") in ("json_schema", "json_object"):
            schema = None
            if fmt["type"] == "json_schema":
                spec = fmt.get("json_schema") or {}
                if not isinstance(spec, dict):
                    raise bad_request(f"response_format.json_schema is a {type(spec).__name__}: expected an object "
                                      f"{{'name': ..., 'schema': {{...}}}}", param="response_format.json_schema")
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
        speculative = self.speculative_of(req.speculative)
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
            max_tokens = self.max_tokens_for(16 if req.max_tokens is None else max_tokens_of(req), len(ids), "prompt")
        sampling = sampling_of(req, model.generation_config, model.vocab_size, max_tokens=max_tokens or None,
                               logprobs=n_top is not None, top_logprobs=n_top, speculative=speculative)
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

"""OpenAI wire format: request models, validation into lily's own types, errors, response pieces.

Requests are parsed with pydantic; a chat or completion request's unknown top-level field is a 400 naming it (as
OpenAI answers), except the few bookkeeping fields in IGNORED_FIELDS;
every range check names the parameter and what was expected, and comes back as an OpenAI error object
(`{"error": {"message", "type", "param", "code"}}`) with the HTTP status OpenAI uses.
"""
from __future__ import annotations

import difflib
import json
import time
import uuid
from typing import Any, ClassVar, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..generation import GenerationStats
from ..sampling import MAX_TOP_LOGPROBS, SAMPLING_OPTIONS, SamplingParams, SamplingParamsError, resolve_sampling
from .api_error import APIError, bad_request  # noqa: F401 (re-exported: the handlers import them from here)
from .validation import check_body, check_message_content, too_deep


# ---- requests -------------------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    logit_bias: Optional[dict[str, float]] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # lily's own: speculative decoding with the MTP head (null: the server's default; validated by LilyServer)
    speculative: Optional[Any] = None


class ChatCompletionRequest(_Request):
    STRICT_FIELDS: ClassVar[bool] = True  # unknown top-level fields are refused (check_fields)
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None


class CompletionRequest(_Request):
    STRICT_FIELDS: ClassVar[bool] = True
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    tokens: list[int]


# Fields of OpenAI's requests that change nothing a local server does (bookkeeping, routing, caching hints): accepted
# and ignored, as documented in docs/server.md. Any other field a request model does not declare is refused.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


def check_fields(cls: type[BaseModel], data: Mapping[str, Any]) -> None:
    """400 for a top-level field the request model does not declare (a typo such as max_token would otherwise be
    dropped silently), naming it and the nearest known one, in OpenAI's words."""
    if not getattr(cls, "STRICT_FIELDS", False):
        return
    known = set(cls.model_fields) | IGNORED_FIELDS
    for name in data:
        if name not in known:
            near = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise bad_request(f"Unrecognized request argument supplied: {name}{hint}", param=str(name),
                              code="unknown_parameter")


def parse_request(cls: type[BaseModel], raw: bytes) -> Any:
    """Body bytes -> request model, or a 400 naming the problem (also for text no tokenizer can take)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e}): expected a JSON object") from None
    except RecursionError:
        raise too_deep("the request body") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    check_body(data)
    check_fields(cls, data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        value = err.get("input")
        shown = json.dumps(value)[:80] if not isinstance(value, dict) else "{...}"
        raise bad_request(f"{loc}={shown} is invalid: {err.get('msg', 'invalid value')}", param=loc or None) \
            from None


def max_tokens_of(req: _Request) -> int | None:
    n = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if n is None:
        n, param = req.max_tokens, "max_tokens"
    if n is not None and n < 1:
        raise bad_request(f"{param}={n} is invalid: expected an integer >= 1 (or leave it out to generate until "
                          f"a stop or the end of the context)", param=param)
    return n


def sampling_of(req: _Request, generation_config: Mapping[str, Any], vocab_size: int, *, max_tokens: int | None,
                logprobs: bool | int, top_logprobs: int | None, extra_stop_ids: tuple[int, ...] = (),
                speculative: bool | int | None = None) -> SamplingParams:
    """The request's sampling (400 for a value out of range); speculative: the value the server resolved for it."""
    if req.n not in (None, 1):
        raise bad_request(f"n={req.n} is not supported: lily serves one choice per request (n=1)", param="n")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs={top_logprobs} is invalid: expected 0..{MAX_TOP_LOGPROBS}",
                          param="top_logprobs")
    bias = None
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            try:
                t = int(k)
            except ValueError:
                raise bad_request(f"logit_bias key {k!r} is invalid: expected a token id", param="logit_bias") \
                    from None
            if not 0 <= t < vocab_size:
                raise bad_request(f"logit_bias names token id {t}: expected 0..{vocab_size - 1}", param="logit_bias")
            bias[t] = v
    try:
        # the request's fields carry the options' own names; the ones resolved above (and by the caller) override
        fields = {k: getattr(req, k) for k in SAMPLING_OPTIONS if k in type(req).model_fields}
        return resolve_sampling(
            generation_config, **{**fields, "max_tokens": max_tokens, "logprobs": logprobs,
                                  "top_logprobs": top_logprobs, "logit_bias": bias, "speculative": speculative,
                                  "stop_token_ids": tuple(req.stop_token_ids or ()) + extra_stop_ids})
    except SamplingParamsError as e:
        msg = str(e).removeprefix("[SamplingParams] ")
        raise bad_request(msg, param=msg.split("=")[0].split(" ")[0]) from None


# ---- responses ------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(stats: GenerationStats, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage. Speculative decoding's drafts go where OpenAI reports predicted-output tokens (typed fields of
    the official clients): accepted_prediction_tokens = drafted tokens the verify kept (they are in the completion),
    rejected_prediction_tokens = the others (0 and 0 for plain decoding)."""
    details: dict[str, Any] = {} if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    details.update(accepted_prediction_tokens=stats.accepted_tokens,
                   rejected_prediction_tokens=stats.drafted_tokens - stats.accepted_tokens)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}, "completion_tokens_details": details}


def timings(stats: GenerationStats, queue_s: float = 0.0) -> dict[str, Any]:
    """llama.cpp's `timings` names, plus TTFT and the time spent queued; for a speculative generation also
    llama.cpp's draft_n / draft_n_accepted, the verify forwards (verify_n) and lily's note (`speculative`)."""
    t = {"cache_n": stats.cached_tokens, "prompt_n": stats.prefill_tokens,
         "prompt_ms": stats.prefill_s * 1e3, "prompt_per_second": stats.prefill_tokens_per_s,
         "predicted_n": stats.generated_tokens, "predicted_ms": stats.decode_s * 1e3,
         "predicted_per_second": stats.decode_tokens_per_s, "ttft_ms": stats.ttft_s * 1e3,
         "queue_ms": queue_s * 1e3, "total_ms": stats.total_s * 1e3}
    if stats.speculative is not None:
        t.update(draft_n=stats.drafted_tokens, draft_n_accepted=stats.accepted_tokens, verify_n=stats.verify_steps,
                 speculative=stats.speculative)
    return t


def token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    b = tokenizer.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprob_item(tokenizer: Any, token_id: int, logprob: float, top: Mapping[int, float] | None
                      ) -> dict[str, Any]:
    text, raw = token_text(tokenizer, token_id)
    alts = []
    for t, lp in (top or {}).items():
        at, ab = token_text(tokenizer, t)
        alts.append({"token": at, "logprob": lp, "bytes": ab})
    return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alts}


def completion_logprobs(tokenizer: Any, items: list[tuple[int, float, Mapping[int, float] | None]],
                        offset0: int = 0) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    offset = offset0
    for token_id, lp, top in items:
        text, _ = token_text(tokenizer, token_id)
        tokens.append(text)
        lps.append(lp)
        tops.append({token_text(tokenizer, t)[0]: v for t, v in (top or {}).items()} if top is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what the chat template reads: `developer` is a system message, text parts are
    kept (other parts are refused), tool-call arguments given as JSON strings become objects."""
    if not messages:
        raise bad_request("messages is empty: expected at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role={role!r} is invalid: expected one of {', '.join(ROLES)}",
                              param=f"messages.{i}.role")
        check_message_content(i, m)
        m = dict(m)
        if role == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") in ("text", "input_text") and "text" in part):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"messages[{i}].content has a part of type {kind!r}: lily serves a text-only "
                                      f"model, expected text parts", param=f"messages.{i}.content")
                if not isinstance(part["text"], str):
                    raise bad_request(f"messages[{i}].content has a text part whose text is a "
                                      f"{type(part['text']).__name__}: expected a string", param=f"messages.{i}.content")
            m["content"] = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              param=f"messages.{i}.content")
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise bad_request(f"messages[{i}].tool_calls is a {type(m['tool_calls']).__name__}: expected a list of "
                                  f"{{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                                  param=f"messages.{i}.tool_calls")
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                if not isinstance(c, dict) or not isinstance(c.get("function"), dict) or \
                        not isinstance(c["function"].get("name"), str):
                    raise bad_request(f"messages[{i}].tool_calls[{j}] must be an object with a function "
                                      f"{{'name': string, 'arguments': JSON object string}}",
                                      param=f"messages.{i}.tool_calls")
                fn = dict(c["function"])
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                                          f"expected a JSON object string", param=f"messages.{i}.tool_calls") from None
                if not isinstance(args, dict):
                    raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                                      param=f"messages.{i}.tool_calls")
                fn["arguments"] = args
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out

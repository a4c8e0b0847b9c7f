"""Request checks that must happen before any large work: text that cannot be tokenized (lone UTF-16
surrogates), prompts that cannot fit the context judged by their byte length alone, tools without a usable
function name, messages without content. Tokenizing itself goes through `encode_batch`, which releases the
GIL, so a huge prompt does not freeze the event loop or the engine thread.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from .api_error import APIError, bad_request

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


MAX_DEPTH = 64  # nesting levels of a request body (OpenAI allows 10 in a structured-output schema)


def too_deep(where: str) -> APIError:
    return bad_request(f"{where} is nested more than {MAX_DEPTH} levels deep: expected a shallower JSON value",
                       code="too_deeply_nested")


def check_body(data: Any, limit: int = MAX_DEPTH) -> None:
    """One walk over a parsed body: 400 for nesting deeper than `limit` (later stages walk it recursively: schemas,
    templates) and for a string (key or value) holding a lone UTF-16 surrogate (JSON allows "\\ud800", but such a
    string is not Unicode text: no tokenizer can encode it), each naming where."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        v, d, path = stack.pop()
        if d > limit:
            raise too_deep(path or "the request body")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad_request(f"{path} holds a lone UTF-16 surrogate at character {e.start} (e.g. \"\\ud800\" "
                                  f"without its pair): expected valid Unicode text", param=path or None,
                                  code="invalid_unicode") from None
            continue
        if isinstance(v, dict):
            for k, x in v.items():
                where = f"{path}.{k}" if path else str(k)
                if isinstance(k, str):
                    stack.append((k, d, where))
                stack.append((x, d + 1, where))
        elif isinstance(v, list):
            stack.extend((x, d + 1, f"{path}.{i}" if path else str(i)) for i, x in enumerate(v))


class GILFreeTokenizer:
    """`encode` through the `tokenizers` batch path (which releases the GIL); everything else as the
    wrapped lily Tokenizer."""

    def __init__(self, tokenizer: Any):
        self._inner = tokenizer
        self._fast = getattr(tokenizer, "_tok", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._fast is None or not hasattr(self._fast, "encode_batch"):
            return self._inner.encode(text, add_special_tokens=add_special_tokens)
        return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def longest_token_bytes(tokenizer: Any, vocab_size: int) -> int:
    """The most UTF-8 bytes one token stands for (a prompt of B bytes has at least B / this many tokens)."""
    best = 1
    for i in range(vocab_size):
        try:
            n = len(tokenizer.token_bytes(i))
        except Exception:  # ids past the tokenizer's own vocab
            continue
        best = max(best, n)
    return best


def check_text_fits(nbytes: int, max_token_bytes: int, room: int, param: str) -> None:
    """400 at once, without tokenizing, when text of `nbytes` bytes cannot fit in `room` tokens."""
    least = -(-nbytes // max_token_bytes)
    if least > room:
        raise bad_request(f"the prompt is {nbytes} bytes, so at least {least} tokens (one token is at most "
                          f"{max_token_bytes} bytes), which exceeds the {room} tokens this model's context has "
                          f"room for. Please reduce the length of the messages or prompt.", param=param,
                          code="context_length_exceeded")


def message_text_bytes(messages: list[Mapping[str, Any]]) -> int:
    n = 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            n += len(c.encode("utf-8"))
        elif isinstance(c, list):
            n += sum(len(p.get("text", "").encode("utf-8")) for p in c
                     if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools` -> the same list, or a 400 naming the first bad entry."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {'type': 'function', 'function': {'name': ...}}", param="tools")
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object {{'type': 'function', 'function': {{...}}}}", param=where)
        if t.get("type", "function") != "function":
            raise bad_request(f"{where}.type={t.get('type')!r} is invalid: expected 'function'", param=f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function is missing: expected an object with a name", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad_request(f"{where}.function.name={name!r} is invalid: expected 1 to 64 letters, digits, "
                              f"'_', '-', '.' or ':'", param=f"{where}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              param=f"{where}.function.parameters")
    return tools


def check_message_content(i: int, m: Mapping[str, Any]) -> None:
    """The content rules OpenAI enforces: system/developer/user/tool messages need content; an assistant
    message needs content or tool_calls; a tool message needs tool_call_id."""
    role = m.get("role")
    has = "content" in m and m["content"] is not None
    if role == "assistant":
        if not has and not m.get("tool_calls"):
            raise bad_request(f"messages[{i}] (assistant) has neither content nor tool_calls: expected at least "
                              f"one of them", param=f"messages.{i}.content")
        return
    if not has:
        raise bad_request(f"messages[{i}] ({role}) has no content: expected a string or a list of text parts",
                          param=f"messages.{i}.content")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise bad_request(f"messages[{i}] (tool) has no tool_call_id: expected the id of the call it answers",
                          param=f"messages.{i}.tool_call_id")


def too_large(limit: int, got: int | None) -> APIError:
    size = f"{got} bytes" if got is not None else "more"
    return APIError(413, f"the request body is {size}, over this server's limit of {limit} bytes "
                         f"(lily serve --max-body-mb)", code="request_too_large")

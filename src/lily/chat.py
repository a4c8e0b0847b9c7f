"""Chat template rendering: the checkpoint's own Jinja template, rendered the way transformers does.

Same environment as `transformers.apply_chat_template`: an immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, a `{% generation %}` block, `tojson` that does not HTML-escape,
`raise_exception`, `strftime_now`, and underscore-safe `namespace`. Messages are reduced to plain JSON data
(keys whose value is None dropped, reasoning aliases filled) so the sandbox only ever sees dicts, lists
and scalars. Template kwargs (`enable_thinking`, `preserve_thinking`, ...) are passed through; a kwarg
left as None is not passed, so the template's own `is defined` default applies.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from .errors import LilyError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "LILY_CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(LilyError, ValueError):
    """No chat template, or the template rejected the messages (its `raise_exception`)."""


def _plain(value: Any) -> Any:
    """Rebuild a value out of plain JSON types (the sandbox must not see rich objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic (e.g. openai client messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Messages -> plain dicts; None-valued keys dropped; reasoning under every name templates read."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"[chat] messages must be a list of {{'role', 'content'}} dicts, "
                                f"got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        m = _plain(m)
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"[chat] message {i} must be a dict with a 'role' (and usually 'content'), "
                                    f"got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _tool_schemas(tools: Sequence[Any] | None) -> list | None:
    if tools is None:
        return None
    schemas = []
    for t in tools:
        if isinstance(t, Mapping):
            schemas.append(_plain(t))
        elif callable(t):
            try:
                from transformers.utils import get_json_schema  # optional: only for Python callables
            except ImportError:
                raise ChatTemplateError(f"[chat] tool {t!r} is a function; pass its JSON schema (a dict) "
                                        f"instead, or install transformers to convert functions") from None
            schemas.append(get_json_schema(t))
        else:
            raise ChatTemplateError(f"[chat] tools must be JSON-schema dicts, got {type(t).__name__}")
    return schemas


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore names (no way to reach interpreter internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates may reference (bos_token, ...)."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None,
                 origin: str = "the checkpoint"):
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        if source is not None:
            import jinja2

            try:
                _compile(source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"[chat] the chat template of {origin} does not parse (line {e.lineno}): "
                                        f"{e.message}") from None

    @property
    def available(self) -> bool:
        return self.source is not None

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True, tools: Sequence[Any] | None = None,
               documents: Sequence[Any] | None = None, continue_final_message: bool = False,
               enable_thinking: bool | None = None, preserve_thinking: bool | None = None, **kwargs: Any) -> str:
        """messages -> prompt text (special tokens written out, e.g. `<|im_start|>`)."""
        import jinja2

        if self.source is None:
            raise ChatTemplateError(
                f"[chat] {self.origin} has no chat template (no chat_template.jinja and no 'chat_template' in "
                f"tokenizer_config.json), so chat messages cannot be rendered: pass a prompt string or token "
                f"ids instead, or add the model's chat_template.jinja to the checkpoint folder")
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("[chat] add_generation_prompt and continue_final_message cannot both be set: "
                                    "one starts a new assistant turn, the other continues the last message")
        chat = normalize_messages(messages)
        if not chat:
            raise ChatTemplateError("[chat] messages is empty: expected at least one {'role', 'content'} message")
        final = None
        if continue_final_message:
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError("[chat] continue_final_message needs a final message with string content")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
        extra = {k: _plain(v) for k, v in kwargs.items() if v is not None}
        if enable_thinking is not None:
            extra["enable_thinking"] = bool(enable_thinking)
        if preserve_thinking is not None:
            extra["preserve_thinking"] = bool(preserve_thinking)
        context = {**self.special_tokens, **extra}
        try:
            text = _compile(self.source).render(messages=chat, tools=_tool_schemas(tools), documents=_plain(documents),
                                                add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"[chat] the chat template of {self.origin} rejected the messages: {e}") from None
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                raise ChatTemplateError("[chat] continue_final_message: the template dropped the final message's "
                                        "content, so it cannot be continued")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin!r}, {'present' if self.source else 'missing'})"


def render_chat(template: str | None, messages: Sequence[Any], **kwargs: Any) -> str:
    """One-shot rendering: `render_chat(source, messages, add_generation_prompt=True, enable_thinking=False)`."""
    return ChatTemplate(template).render(messages, **kwargs)


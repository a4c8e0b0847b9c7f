"""Qwen3.6 XML tool calls -> OpenAI `tool_calls`, incrementally.

The model writes (docs/model.md §8):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

`ToolCallParser.feed(content_text)` returns events as soon as they are known: content text outside calls,
`start` (index, id, name) once `<function=NAME>` is complete, `args` fragments once each parameter is
complete, `end` at `</function>`. The fragments of one call concatenate to its JSON `arguments` object.
Values are typed by the tool's JSON schema (integer, number, boolean, null, object, array; anything that
does not convert stays a string). Parallel calls are consecutive `<tool_call>` blocks. The older Hermes
form (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) is accepted too.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..reasoning import held_suffix

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_FUNCTION_END = "</function>"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolEvent:
    kind: str                 # "content" | "start" | "args" | "end"
    text: str = ""            # content text, or an arguments fragment
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""       # the JSON object, complete once `end` was seen
    done: bool = False
    truncated: bool = False   # cut off (max_tokens): `arguments` is the raw partial text, not closed JSON

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _schema_types(schema: Mapping[str, Any] | None) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    types = [t] if isinstance(t, str) else [x for x in (t or []) if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types += _schema_types(sub)
    if not types and "enum" in schema:
        types = ["enum"]
    if not types and "properties" in schema:
        types = ["object"]
    return types


def convert_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text -> a JSON value of the type its schema names (the text itself as a fallback)."""
    types = _schema_types(schema)
    if not types or (types == ["string"]):
        return raw
    text = raw.strip()
    for t in types:
        try:
            if t == "integer":
                return int(text)
            if t == "number":
                v = float(text)
                return int(v) if v.is_integer() and re.fullmatch(r"-?\d+", text) else v
            if t == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if t == "null" and text.lower() in ("null", "none"):
                return None
            if t in ("object", "array"):
                v = json.loads(text)
                if isinstance(v, dict if t == "object" else list):
                    return v
            if t == "enum":
                if text in schema["enum"]:
                    return text
                v = json.loads(text)
                if v in (schema or {}).get("enum", []):
                    return v
        except (ValueError, TypeError):
            continue
    if "string" in types:
        return raw
    try:
        return json.loads(text)
    except ValueError:
        return raw


def tool_parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: JSON schema}} from OpenAI `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, Mapping) else {}
        name = fn.get("name")
        if isinstance(name, str):
            props = (fn.get("parameters") or {}).get("properties") or {}
            out[name] = dict(props) if isinstance(props, Mapping) else {}
    return out


@dataclass
class _Open:
    index: int
    buf: str = ""                # text of the call after <tool_call>
    call: ToolCall | None = None
    pos: int = 0                 # parsed up to here in buf
    n_args: int = 0
    ws: str = ""                 # whitespace before <tool_call> (content again if this is not a call)


class ToolCallParser:
    """Streaming parser of the model's tool calls, over content text (reasoning already split off)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None):
        self.schemas = tool_parameter_schemas(tools)
        self.calls: list[ToolCall] = []
        self.buf = ""
        self.open: _Open | None = None
        self.after_call = False      # whitespace between / after calls is not content

    def feed(self, text: str) -> list[ToolEvent]:
        self.buf += text
        events: list[ToolEvent] = []
        while True:
            if self.open is None:
                at = self.buf.find(TOOL_CALL)
                if at < 0:
                    # hold back a possible start of <tool_call> and trailing whitespace (dropped if a call
                    # follows, passed on if more content does)
                    safe = self.buf[:len(self.buf) - held_suffix(self.buf, (TOOL_CALL,))]
                    emit = safe.rstrip()
                    self._content(events, emit)
                    self.buf = self.buf[len(emit):]
                    return events
                before = self.buf[:at]
                self._content(events, before.rstrip())
                self.buf = self.buf[at + len(TOOL_CALL):]
                self.open = _Open(len(self.calls), ws=before[len(before.rstrip()):])
            end = self.buf.find(TOOL_CALL_END)
            body = self.buf if end < 0 else self.buf[:end]
            self.open.buf = body
            self._parse(events, final=end >= 0)
            if end < 0:
                return events
            self.buf = self.buf[end + len(TOOL_CALL_END):]
            self.open = None
            self.after_call = True

    def finish(self, truncated: bool = False) -> list[ToolEvent]:
        """End of the reply: close an unterminated call (if its function name was seen), else pass its
        text on as content. truncated=True (the reply hit max_tokens): an unterminated call is left as what
        it is, its arguments the partial JSON text so far (never closed into valid-looking JSON)."""
        events: list[ToolEvent] = []
        if self.open is not None:
            o = self.open
            self._parse(events, final=True, truncated=truncated)
            if o.call is None:
                self._content(events, o.ws + TOOL_CALL + o.buf)
            self.open = None
        elif self.buf:
            self._content(events, self.buf)
        self.buf = ""
        return events

    # ---- pieces ---------------------------------------------------------------------------------------
    def _content(self, events: list[ToolEvent], text: str) -> None:
        if not text:
            return
        if self.after_call and not text.strip():
            return
        if self.after_call:
            text = text.lstrip()
        self.after_call = False
        if events and events[-1].kind == "content":
            events[-1].text += text
        else:
            events.append(ToolEvent("content", text))

    def _parse(self, events: list[ToolEvent], final: bool, truncated: bool = False) -> None:
        o = self.open
        body = o.buf
        if o.call is None:
            stripped = body.lstrip()
            if stripped.startswith("{"):  # Hermes JSON form: parse when complete
                if final:
                    self._hermes(events, stripped)
                return
            m = _FUNCTION.search(body)
            if m is None:
                return
            o.call = ToolCall(new_call_id(), m.group(1).strip())
            self.calls.append(o.call)
            events.append(ToolEvent("start", index=o.index, id=o.call.id, name=o.call.name))
            o.pos = m.end()
        schema = self.schemas.get(o.call.name, {})
        for m in _PARAM.finditer(body, o.pos):
            name = m.group(1).strip()
            value = convert_value(m.group(2), schema.get(name))
            self._args(events, o, ("{" if o.n_args == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " +
                       json.dumps(value, ensure_ascii=False))
            o.n_args += 1
            o.pos = m.end()
        if not o.call.done and truncated and _FUNCTION_END not in body[o.pos:]:
            self._partial(events, o, body[o.pos:], schema)
            return
        if not o.call.done and (final or _FUNCTION_END in body[o.pos:]):
            self._args(events, o, "{}" if o.n_args == 0 else "}")
            o.call.done = True
            events.append(ToolEvent("end", index=o.index, id=o.call.id, name=o.call.name))

    def _partial(self, events: list[ToolEvent], o: _Open, rest: str, schema: Mapping[str, Any]) -> None:
        """The call was cut off: its arguments end with the parameter being written, as far as it got
        (a string value without its closing quote), and no closing brace."""
        o.call.truncated = True
        m = re.search(r"<parameter=([^>\n]+)>\n?", rest)
        frag = "{" if o.n_args == 0 else ""
        if m is not None:
            name = m.group(1).strip()
            raw = rest[m.end():]
            raw = raw[:len(raw) - held_suffix(raw, ("\n" + "</parameter>",))]  # a closing tag begun, not finished
            types = _schema_types(schema.get(name))
            value = json.dumps(raw, ensure_ascii=False)[:-1] if not types or "string" in types else raw.strip()
            frag += ("" if o.n_args == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " + value
        if frag:
            self._args(events, o, frag)

    def _args(self, events: list[ToolEvent], o: _Open, fragment: str) -> None:
        o.call.arguments += fragment
        events.append(ToolEvent("args", fragment, index=o.index, id=o.call.id, name=o.call.name))

    def _hermes(self, events: list[ToolEvent], text: str) -> None:
        o = self.open
        try:
            obj = json.loads(text)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            self._content(events, o.ws + TOOL_CALL + o.buf)
            return
        o.call = ToolCall(new_call_id(), name)
        self.calls.append(o.call)
        events.append(ToolEvent("start", index=o.index, id=o.call.id, name=name))
        self._args(events, o, json.dumps(args, ensure_ascii=False))
        o.call.done = True
        events.append(ToolEvent("end", index=o.index, id=o.call.id, name=name))


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """Whole-text version: (content outside the calls, calls)."""
    p = ToolCallParser(tools)
    events = p.feed(text) + p.finish()
    return "".join(e.text for e in events if e.kind == "content"), p.calls

"""Grammar-constrained decoding through llguidance: `response_format` (json_schema / json_object) and forced
tool calls (`tool_choice: "required"` or a named function) in the model's XML format.

`GrammarConstraint` is a `lily.sampling.TokenConstraint`: each step llguidance computes the bitmask of
allowed tokens, the sampler sets the others to -inf before choosing, and the chosen token advances the
matcher. When the grammar is complete only the end-of-turn token is allowed, so the reply ends there.
With thinking on, the constraint starts after `</think>` (the reasoning is free text), as in vLLM.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ..errors import LilyError

if TYPE_CHECKING:
    from ..model import Model


class GrammarError(LilyError, ValueError):
    """A response_format / tool grammar is invalid or llguidance is not installed."""


def _llg():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("response_format json_schema and forced tool calls need the llguidance package "
                           "(a dependency of lily: pip install llguidance)") from None
    return llguidance


_TOKENIZERS: dict[int, Any] = {}


def ll_tokenizer(model: "Model"):
    """llguidance's view of the model's tokenizer (cached per model; ~1 s for a 248K vocab)."""
    key = id(model)
    tok = _TOKENIZERS.get(key)
    if tok is None:
        llg = _llg()
        eos = model.tokenizer.im_end_id
        tok = llg.LLTokenizer(model.tokenizer.path.read_text(encoding="utf-8"), n_vocab=model.vocab_size,
                              eos_token=eos if eos is not None else list(model.stop_token_ids)[0])
        _TOKENIZERS[key] = tok
    return tok


def json_schema_grammar(schema: Mapping[str, Any] | None) -> str:
    """A grammar for one JSON value matching `schema` (None: any JSON object). Compact JSON (no free
    whitespace), so a model cannot stall in blank space."""
    llg = _llg()
    schema = {"type": "object"} if schema is None else dict(schema)
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema could not be compiled: {e}") from None


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


# bounds of a forced call, so that a call always ends: a string without maxLength, an integer without
# minimum/maximum and a number take at most this many characters / digits, and at most MAX_PARALLEL calls
MAX_STRING_CHARS = 4096
MAX_INT = 10 ** 18 - 1
MAX_PARALLEL = 8
_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?/"


def _value_rule(schema: Mapping[str, Any] | None) -> str:
    """Lark for one XML parameter value of this JSON schema (strings raw, everything else JSON), every
    value bounded in length."""
    schema = schema if isinstance(schema, Mapping) else {}
    if "enum" in schema and all(isinstance(v, (str, int, float, bool)) or v is None for v in schema["enum"]):
        alts = [_lark_str(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"]]
        return "(" + " | ".join(alts) + ")" if alts else '""'
    t = schema.get("type")
    if t == "string" or t is None or (isinstance(t, list) and "string" in t):
        n = schema.get("maxLength")
        n = int(n) if isinstance(n, int) and 0 <= n <= MAX_STRING_CHARS else MAX_STRING_CHARS
        return rf"/([^<]|<[^\/]){{0,{n}}}/"   # raw text, no "</" (which would start </parameter>)
    if t == "integer":
        bounded = dict(schema)
        lo, hi = schema.get("minimum"), schema.get("maximum")
        bounded["minimum"] = lo if isinstance(lo, (int, float)) and lo >= -MAX_INT else -MAX_INT
        bounded["maximum"] = hi if isinstance(hi, (int, float)) and hi <= MAX_INT else MAX_INT
        return "%json " + json.dumps(bounded, ensure_ascii=False)
    if t == "number" and not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return _NUMBER
    return "%json " + json.dumps(dict(schema), ensure_ascii=False)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None, parallel: bool = True) -> str:
    """Lark grammar: one (named, or parallel=False) or one or more (required) tool calls in the model's XML
    format, with each function's parameters in schema order (required ones always, optional ones allowed)."""
    llg = _llg()
    fns = []
    for t in tools:
        fn = t.get("function", t)
        if name is None or fn.get("name") == name:
            fns.append(fn)
    if not fns:
        raise GrammarError(f"tool_choice names function {name!r}, which is not in tools")
    rules, alts = [], []
    for i, fn in enumerate(fns):
        params = (fn.get("parameters") or {})
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            rules.append(f'{rule}: {_lark_str(f"<parameter={pname}>" + chr(10))} {_value_rule(pschema)} '
                         f'{_lark_str(chr(10) + "</parameter>" + chr(10))}')
            parts.append(rule if pname in required else f"{rule}?")
        rules.append(f'f{i}: {_lark_str(chr(10) + "<function=" + fn["name"] + ">" + chr(10))} {" ".join(parts)} '
                     f'{_lark_str("</function>" + chr(10))}')
        alts.append(f"f{i}")
    call = "call: <tool_call> (" + " | ".join(alts) + ") </tool_call>"
    start = "start: call" if name is not None or not parallel else \
        f'start: call ("\\n" call){{0,{MAX_PARALLEL - 1}}}'
    return llg.LLMatcher.grammar_from_lark("\n".join([start, call, *rules]))


class GrammarConstraint:
    """Token mask from an llguidance matcher (see module doc). `start_after`: a token id (</think>) before
    which the constraint is inactive."""

    def __init__(self, model: "Model", grammar: str, start_after: int | None = None):
        llg = _llg()
        tok = ll_tokenizer(model)
        self.matcher = llg.LLMatcher(tok, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar is invalid: {self.matcher.get_error()}")
        self.vocab = model.vocab_size
        self.start_after = start_after
        self.active = start_after is None
        self._mask = np.full(((self.vocab + 31) // 32,), -1, np.int32)
        # added tokens (<tool_call>, <think>, ...): llguidance may offer one whose text fits although the
        # grammar wants the literal characters; those are re-checked every step
        self.eos = set(model.stop_token_ids)
        self._added = sorted(i for i in getattr(model.tokenizer, "_added", {}) if i < self.vocab and i not in self.eos)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if not self.active:
            return logits
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)
        for t in self._added:
            if allowed[t] and m.validate_tokens([t]) == 0:
                allowed[t] = False
        x = np.array(logits, np.float32, copy=True)
        x[~allowed] = -np.inf
        return x

    def accept(self, token: int) -> None:
        if not self.active:
            if token == self.start_after:
                self.active = True
            return
        if token in self.eos and self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()

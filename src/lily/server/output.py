"""Turn the worker's token chunks into OpenAI chat deltas / messages (reasoning, content, tool calls,
logprobs), the same code for streaming and non-streaming responses."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..generation import GenerationChunk, GenerationStats
from .protocol import chat_logprob_item
from ..reasoning import ReasoningParser
from .tool_calls import ToolCallParser


class ChatOutput:
    """push(chunk) -> list of `delta` dicts (possibly empty); finish() -> the last ones.

    reasoning goes out under both `reasoning_content` (llama.cpp, SGLang, LM Studio) and `reasoning`
    (vLLM, Ollama, mlx-lm) unless `reasoning_field` picks one."""

    def __init__(self, tokenizer: Any, *, in_reasoning: bool, tools: Sequence[Mapping[str, Any]] | None,
                 parse_tools: bool, logprobs: bool, reasoning_field: str = "both"):
        self.tokenizer = tokenizer
        self.reasoning = ReasoningParser(in_reasoning)
        self.tools = ToolCallParser(tools) if parse_tools else None
        self.want_logprobs = logprobs
        self.fields = ("reasoning_content", "reasoning") if reasoning_field == "both" else (reasoning_field,)
        self.think_end = tokenizer.think_end_id
        self.counting_reasoning = in_reasoning
        self.reasoning_tokens = 0
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.stats: GenerationStats | None = None

    @property
    def tool_calls(self) -> list:
        return self.tools.calls if self.tools is not None else []

    def push(self, chunk: GenerationChunk) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """-> (deltas, logprob items of this token or None)."""
        if self.counting_reasoning and chunk.token_id >= 0:  # (-1: the server's final chunk, no token)
            if chunk.token_id == self.think_end:
                self.counting_reasoning = False
            else:
                self.reasoning_tokens += 1
        deltas = self._text(self.reasoning.feed(chunk.text))
        if chunk.finish_reason is not None:
            deltas += self._text(self.reasoning.finish())
            if self.tools is not None:
                deltas += self._tool_events(self.tools.finish(truncated=chunk.finish_reason == "length"))
            self.stats = chunk.stats
            self.finish_reason = "tool_calls" if self.tool_calls and chunk.finish_reason == "stop" \
                else chunk.finish_reason
        items = None
        if self.want_logprobs and chunk.logprob is not None:
            items = [chat_logprob_item(self.tokenizer, chunk.token_id, chunk.logprob, chunk.top_logprobs)]
            self.logprobs += items
        return _merge(deltas), items

    def _text(self, parts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                self.reasoning_text.append(text)
                out.append({f: text for f in self.fields})
            elif self.tools is not None:
                out += self._tool_events(self.tools.feed(text))
            else:
                self.content_text.append(text)
                out.append({"content": text})
        return out

    def _tool_events(self, events) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if e.kind == "content":
                self.content_text.append(e.text)
                out.append({"content": e.text})
            elif e.kind == "start":
                out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
            elif e.kind == "args":
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return out

    def message(self) -> dict[str, Any]:
        content = "".join(self.content_text)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.tool_calls else None}
        reasoning = "".join(self.reasoning_text)
        if reasoning:
            for f in self.fields:
                msg[f] = reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join consecutive text deltas of the same kind (fewer SSE events)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and "tool_calls" not in d and "tool_calls" not in out[-1] and out[-1].keys() == d.keys():
            out[-1] = {k: out[-1][k] + d[k] for k in d}
        else:
            out.append(dict(d))
    return [d for d in out if "tool_calls" in d or any(v for v in d.values())]

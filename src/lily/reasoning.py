"""Split a reply into reasoning (`<think>...</think>`) and content: one parser for `lily serve`,
`GenerationResult.reasoning` / `GenerationChunk.channel` (lily.generation.split_reasoning) and `lily chat`.

Qwen3.6's generation prompt ends with `<think>\\n` when thinking is on, so the reply starts inside the
reasoning block; with thinking off the prompt already holds an empty `<think>\\n\\n</think>\\n\\n`. A model
may also open `<think>` itself at the start of its reply, and may start a tool call inside its reasoning
without closing it: `<tool_call>` ends the reasoning (the call and everything after it are content, for
the tool-call parser), and a later stray `</think>` is dropped.
"""
from __future__ import annotations

THINK = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"


def held_suffix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of the tags (text that cannot be
    emitted yet because the next characters may complete a tag)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt ends inside an open `<think>` block (the reply starts as reasoning)."""
    start = prompt_text.rfind(THINK)
    return start >= 0 and prompt_text.find(THINK_END, start) < 0 and \
        prompt_text.rfind("<|im_start|>") < start


class ReasoningParser:
    """feed(text) -> [("reasoning" | "content", text), ...]; finish() flushes what was held back."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.buf = ""
        self.seen_content = False    # some content (even whitespace) has been passed on
        self.strip_leading = False   # drop the blank lines that follow </think>
        self.drop_think_end = False  # reasoning ended by a tool call: a later </think> is stray

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.in_reasoning:
                if not self._reasoning_step(out):
                    break
            elif not self._content_step(out):
                break
        return [(k, t) for k, t in out if t]

    def finish(self) -> list[tuple[str, str]]:
        kind = "reasoning" if self.in_reasoning else "content"
        text, self.buf = self.buf, ""
        if kind == "content" and self.strip_leading:
            text = text.lstrip()
        return [(kind, text)] if text else []

    def _reasoning_step(self, out: list) -> bool:
        buf = self.buf
        end, call = buf.find(THINK_END), buf.find(TOOL_CALL)
        if end >= 0 and (call < 0 or end < call):
            out.append(("reasoning", buf[:end].rstrip("\n")))
            self.buf = buf[end + len(THINK_END):]
            self.in_reasoning, self.strip_leading = False, True
            return True
        if call >= 0:
            out.append(("reasoning", buf[:call].rstrip("\n")))
            self.buf = buf[call:]
            self.in_reasoning, self.drop_think_end = False, True
            return True
        keep = held_suffix(buf, (THINK_END, TOOL_CALL))
        # a newline right before </think> is formatting, not reasoning: hold trailing newlines back too
        cut = len(buf) - keep
        while cut > 0 and buf[cut - 1] == "\n":
            cut -= 1
        out.append(("reasoning", buf[:cut]))
        self.buf = buf[cut:]
        return False

    def _content_step(self, out: list) -> bool:
        if self.strip_leading:
            stripped = self.buf.lstrip()
            if not stripped:
                self.buf = ""
                return False
            self.buf, self.strip_leading = stripped, False
        buf = self.buf
        if not self.seen_content:  # the model may open its own think block at the start of the reply
            head = buf.lstrip()
            if head.startswith(THINK):
                self.buf = head[len(THINK):].lstrip("\n")
                self.in_reasoning = True
                return True
            if THINK.startswith(head):
                return False  # could still become <think>
        if self.drop_think_end:
            at = buf.find(THINK_END)
            if at >= 0:
                out.append(("content", buf[:at]))
                self.buf = buf[at + len(THINK_END):]
                self.drop_think_end = False
                self.seen_content = True
                return True
            keep = held_suffix(buf, (THINK_END,))
            out.append(("content", buf[:len(buf) - keep]))
            self.buf = buf[len(buf) - keep:]
            self.seen_content = self.seen_content or len(buf) > keep
            return False
        out.append(("content", buf))
        self.buf = ""
        self.seen_content = True
        return False

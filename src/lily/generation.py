"""What a generation returns (result, stream chunks, timing stats) and the pieces of the decode loop that
are pure Python: stop-string matching across chunk boundaries, splitting a chat reply into reasoning and
answer, and resolving sampling options.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from .reasoning import ReasoningParser, prompt_opens_reasoning
from .sampling import TokenLogprobs, resolve_sampling  # noqa: F401 (resolve_sampling moved to lily.sampling)

FINISH_STOP = "stop"      # a stop token or stop string ended generation
FINISH_LENGTH = "length"  # max_tokens reached, or the context window is full
CHANNEL_REASONING = "reasoning"  # inside the reply's <think> block
CHANNEL_CONTENT = "content"      # the answer


@dataclass
class GenerationStats:
    """Timings of one request. prompt_tokens counts the whole context before generation, cached_tokens
    the part that was already in the session's state (not recomputed)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0       # call -> first token sampled (prefill + first sample)
    prefill_s: float = 0.0    # time spent in the prefill forward
    decode_s: float = 0.0     # first token -> last token
    total_s: float = 0.0
    # speculative decoding (the MTP head): what it did, None when the request decoded plainly from the start
    # ("speculative k=3", "plain: <why>"); drafted / accepted tokens and the verify forwards that checked them
    speculative: str | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        """Drafted tokens the verify kept (0 when none were drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens one verify forward gave (its accepted drafts + the token it drew); 0 without verifies."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "ttft_s": self.ttft_s, "prefill_s": self.prefill_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_s": self.decode_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "total_s": self.total_s,
                "speculative": self.speculative, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens, "verify_steps": self.verify_steps}

    def summary(self) -> str:
        """One line: `prompt 12 tok, prefill 850.2 tok/s, TTFT 0.014 s, decode 41.3 tok/s, 64 tok` (and, for a
        speculative generation, `, speculative k=3: 61% of 90 drafts accepted, 2.8 tok/verify`)."""
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        spec = ""
        if self.speculative is not None:
            drafts = (f"{self.acceptance:.0%} of {self.drafted_tokens} drafts accepted, "
                      f"{self.tokens_per_verify:.2f} tok/verify") if self.drafted_tokens else ""
            if self.speculative.startswith("plain: ") and drafts:  # drafted first, then fell back
                spec = f", drafted ({drafts}), then {self.speculative}"
            else:
                spec = f", {self.speculative}" + (f" ({drafts})" if drafts else "")
        return (f"prompt {self.prompt_tokens} tok{cached}, prefill {self.prefill_tokens_per_s:.1f} tok/s, "
                f"TTFT {self.ttft_s:.3f} s, decode {self.decode_tokens_per_s:.1f} tok/s, "
                f"{self.generated_tokens} tok{spec}")


@dataclass
class GenerationChunk:
    """One sampled token of a stream. `text` is the new text it completes (may be empty: partial UTF-8
    or text held back because it could be the start of a stop string). The last chunk has
    `finish_reason` and `stats`.

    In a stream split by `split_reasoning` (chat replies), `text` is new answer text only and `reasoning`
    the new text of the `<think>` block, both without the tags; `channel` says which part of the reply
    this token belongs to ("reasoning" for the tokens of the think block and its tags, then "content").
    An unsplit stream (a raw prompt) has all its text in `text` and channel None."""

    text: str
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended generation
    stats: GenerationStats | None = None
    reasoning: str = ""
    channel: str | None = None


@dataclass
class GenerationResult:
    """A finished generation. token_ids: every sampled token, including a final stop token; text excludes
    stop tokens, special tokens and the stop string (and anything after it). For a chat reply split by
    `split_reasoning`, `text` is the answer and `reasoning` the think block (tags and the blank lines
    after `</think>` removed); otherwise reasoning is ""."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    reasoning: str = ""

    def __str__(self) -> str:
        return self.text


def split_reasoning(chunks: Iterable[GenerationChunk], in_reasoning: bool | str) -> Iterator[GenerationChunk]:
    """The chunks of a chat reply with reasoning and answer apart (see GenerationChunk), one chunk per
    token as before. in_reasoning: whether the reply starts inside `<think>`, or the prompt text, from
    which `lily.reasoning.prompt_opens_reasoning` decides it. The same parser as `lily serve`. Chunks that
    are already split pass through unchanged, so splitting twice is harmless."""
    if isinstance(in_reasoning, str):
        in_reasoning = prompt_opens_reasoning(in_reasoning)
    parser = ReasoningParser(bool(in_reasoning))
    try:
        for c in chunks:
            if c.channel is not None:
                yield c
                continue
            was_reasoning = parser.in_reasoning
            pieces = parser.feed(c.text)
            if c.finish_reason is not None:
                pieces += parser.finish()
            content = "".join(t for kind, t in pieces if kind == CHANNEL_CONTENT)
            reasoning = "".join(t for kind, t in pieces if kind == CHANNEL_REASONING)
            if content:
                channel = CHANNEL_CONTENT
            elif reasoning or was_reasoning or parser.in_reasoning:  # a tag token (<think>, </think>) joins its block
                channel = CHANNEL_REASONING
            else:
                channel = CHANNEL_CONTENT
            yield dataclasses.replace(c, text=content, reasoning=reasoning, channel=channel)
    finally:  # closing this stream early closes the session's, which settles the tokens it ran
        getattr(chunks, "close", lambda: None)()


def collect(chunks: Iterable[GenerationChunk], in_reasoning: bool | str | None = None) -> GenerationResult:
    """Drain a chunk stream into a `GenerationResult`. in_reasoning (as for `split_reasoning`): split a
    chat reply into `.reasoning` and `.text`; None keeps the chunks as they are."""
    if in_reasoning is not None:
        chunks = split_reasoning(chunks, in_reasoning)
    parts: list[str] = []
    thought: list[str] = []
    ids: list[int] = []
    lps: list[TokenLogprobs] = []
    last = None
    for c in chunks:
        parts.append(c.text)
        thought.append(c.reasoning)
        ids.append(c.token_id)
        if c.logprob is not None:
            lps.append(TokenLogprobs(c.token_id, c.logprob, dict(c.top_logprobs or {})))
        last = c
    assert last is not None and last.finish_reason is not None, "a generation always ends with a final chunk"
    return GenerationResult("".join(parts), ids, last.finish_reason, last.stats or GenerationStats(),
                            last.stop_reason, lps if lps else None, "".join(thought))


class StopStringMatcher:
    """Finds stop strings in streamed text, across chunk boundaries, and never lets one out.

    push(delta) -> (text safe to emit, matched stop string or None). Text that could be the start of a
    stop string is held back until it is disambiguated; since held text is always such a prefix, a match
    can never straddle text already emitted.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, delta: str) -> tuple[str, str | None]:
        if not self.stops:
            return delta, None
        buf = self.held + delta
        hit = self._earliest(buf)
        if hit is not None:
            self.held = ""
            return buf[:hit[0]], hit[1]
        keep = self._held_suffix_len(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self, delta: str = "") -> tuple[str, str | None]:
        """End of stream: emit everything held (a stop string can still complete in `delta`)."""
        buf = self.held + delta
        self.held = ""
        hit = self._earliest(buf) if self.stops else None
        return (buf[:hit[0]], hit[1]) if hit is not None else (buf, None)

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

"""Exact tokens of replies sent back as text: a client that sends a conversation back as chat messages (or a
completions prompt plus its completion) gets the token ids that were sampled, not a re-tokenization, so prefix
reuse (lily.prefix_cache) continues past its own replies."""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

_REPLY_OPENERS = ("<|im_start|>assistant\n", "<think>\n", "</think>\n\n")
_REPLY_CLOSER = "<|im_end|>"


class ReplyTokens:
    """The token ids a model generated for its recent replies, so that a conversation sent back as text
    (chat messages) re-tokenizes to exactly the tokens the session state holds: BPE re-encoding of a reply
    often splits it differently from how it was sampled, and one differing token ends prefix reuse there.

    `encode(tokenizer, text)` tokenizes `text`, splicing in the remembered ids wherever a remembered reply
    appears as a whole assistant turn (after `<|im_start|>assistant\n`, `<think>\n` or `</think>\n\n`,
    and followed by `<|im_end|>`); the decoded text is identical, only the split differs."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = int(max_entries)
        self._replies: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._texts: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # raw prompt + completion (no template)
        self._lock = threading.Lock()  # a server remembers on one thread and encodes on others

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, text: str, ids: Sequence[int]) -> None:
        if not text or not ids:
            return
        with self._lock:
            self._replies[text] = tuple(int(t) for t in ids)
            self._replies.move_to_end(text)
            while len(self._replies) > self.max_entries:
                self._replies.popitem(last=False)

    def export(self) -> list[list]:
        """[[reply text, [ids]], ...] oldest first, JSON-ready (kept with a saved session)."""
        with self._lock:
            return [[t, list(ids)] for t, ids in self._replies.items()]

    def remember_all(self, entries: Sequence[Sequence]) -> None:
        """Inverse of export()."""
        for text, ids in entries:
            self.remember(str(text), [int(t) for t in ids])

    def remember_text(self, text: str, ids: Sequence[int]) -> None:
        """A raw-text context (a completions prompt plus its completion) and its exact tokens."""
        if text and ids:
            with self._lock:
                self._texts[text] = tuple(int(t) for t in ids)
                self._texts.move_to_end(text)
                while len(self._texts) > self.max_entries:
                    self._texts.popitem(last=False)

    def encode_text(self, tokenizer: Any, text: str) -> list[int]:
        """Raw text -> ids, continuing the exact tokens of the longest remembered context it starts with."""
        with self._lock:
            best = max((t for t in self._texts if text.startswith(t)), key=len, default=None)
            head = self._texts[best] if best is not None else None
        if best is None:
            return tokenizer.encode(text)
        rest = text[len(best):]
        return list(head) + (tokenizer.encode(rest) if rest else [])

    def save(self, path: str | os.PathLike) -> None:
        with self._lock:
            items = [[t, list(ids)] for t, ids in self._replies.items()]
        Path(path).write_text(json.dumps(items, ensure_ascii=False))

    def load(self, path: str | os.PathLike) -> None:
        try:
            for text, ids in json.loads(Path(path).read_text()):
                self.remember(text, ids)
        except (OSError, ValueError, TypeError):
            pass  # a missing or damaged file only costs some prefix reuse

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        spans: list[tuple[int, int, tuple[int, ...]]] = []
        with self._lock:
            replies = list(self._replies.items())
        for reply, ids in reversed(replies):
            i = text.find(reply)
            while i >= 0:
                j = i + len(reply)
                if text.startswith(_REPLY_CLOSER, j) and any(text.endswith(o, 0, i) for o in _REPLY_OPENERS) \
                        and not any(a < j and i < b for a, b, _ in spans):
                    spans.append((i, j, ids))
                i = text.find(reply, j)
        if not spans:
            return tokenizer.encode(text)
        out: list[int] = []
        at = 0
        for i, j, ids in sorted(spans):
            if i > at:
                out += tokenizer.encode(text[at:i])
            out += ids
            at = j
        if at < len(text):
            out += tokenizer.encode(text[at:])
        return out

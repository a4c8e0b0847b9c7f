"""Tokenizer: the checkpoint's `tokenizer.json` through `tokenizers`, plus a streaming detokenizer.

Qwen3.6 is byte-level BPE (GPT-2 byte map): one token can hold part of a UTF-8 character. The streaming
detokenizer works on bytes, so it never emits half a character and costs O(1) per token.
"""
from __future__ import annotations

import codecs
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from .errors import CheckpointError

# Qwen special/added tokens the API needs by name (docs/model.md §8)
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level map inverse: printable unicode char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the Qwen special tokens looked up by name."""

    def __init__(self, path: str | Path):
        import tokenizers

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"[lily.Tokenizer] {self.path} not found: a checkpoint needs a tokenizer.json")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"[lily.Tokenizer] {self.path} could not be read by `tokenizers`: {e}") from None
        self._added: dict[int, tuple[str, bool]] = {
            i: (t.content, bool(t.special)) for i, t in self._tok.get_added_tokens_decoder().items()}
        self.special_ids: frozenset[int] = frozenset(i for i, (_, sp) in self._added.items() if sp)
        self.byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        return cls(path)

    # ---- ids ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (base vocab + added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def im_start_id(self) -> int | None:
        return self.token_to_id(IM_START)

    @property
    def im_end_id(self) -> int | None:
        return self.token_to_id(IM_END)

    @property
    def endoftext_id(self) -> int | None:
        return self.token_to_id(ENDOFTEXT)

    @property
    def think_id(self) -> int | None:
        return self.token_to_id(THINK)

    @property
    def think_end_id(self) -> int | None:
        return self.token_to_id(THINK_END)

    def stop_token_ids(self) -> list[int]:
        """End-of-turn tokens of the chat format: <|im_end|> and <|endoftext|> (those present)."""
        return [i for i in (self.im_end_id, self.endoftext_id) if i is not None]

    # ---- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special tokens written in the text (`<|im_start|>`) become their ids; no BOS is added."""
        if not isinstance(text, str):
            raise TypeError(f"[lily.Tokenizer.encode] expected str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token contributes to decoded text (byte-level tokenizers only)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            b = self._compute_token_bytes(int(token_id))
            self._bytes_cache[token_id] = b
        return b

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id][0].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        table = byte_decoder()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:  # a piece outside the byte map is taken literally (tokenizers does the same)
            return piece.encode("utf-8")

    def streaming_detokenizer(self, skip_special_tokens: bool = True) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class StreamingDetokenizer:
    """Token ids in, text deltas out; a delta never ends inside a UTF-8 character.

    detok = tokenizer.streaming_detokenizer()
    for t in ids: out += detok.add(t)
    out += detok.flush()          # any incomplete trailing bytes, as U+FFFD
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        if tokenizer.byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:  # other decoders (Metaspace, WordPiece): re-decode a short window of ids
            self._ids: list[int] = []
            self._prefix = 0  # ids before this are fully emitted and cannot change any more
            self._read = 0

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        delta = self._add_bytes(token_id) if self.tokenizer.byte_level else self._add_window(token_id)
        self.text += delta
        return delta

    def add_many(self, ids: Sequence[int]) -> str:
        return "".join(self.add(t) for t in ids)

    def flush(self) -> str:
        if self.tokenizer.byte_level:
            delta = self._utf8.decode(b"", final=True)
        else:
            full = self.tokenizer.decode(self._ids[self._prefix:], self.skip_special_tokens)
            done = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
            delta = full[len(done):]
            self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta

    def _add_bytes(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def _add_window(self, token_id: int) -> str:
        # vLLM/HF TextStreamer scheme: decode ids[prefix:] and ids[prefix:read]; emit the difference once
        # it does not end in a replacement character (an incomplete byte sequence).
        self._ids.append(token_id)
        done = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[self._prefix:], self.skip_special_tokens)
        if len(full) > len(done) and not full.endswith("\ufffd"):
            delta = full[len(done):]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

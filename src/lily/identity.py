"""What identifies a model for its saved states: a cheap digest of the checkpoint's weights (computed by
`lily.load`), the fingerprint (config + tokenizer + that digest) that session files carry, and `ModelIdentity`,
the values a session file records of its model and checks on reading."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np


def weights_digest(tensors: Mapping[str, np.ndarray], sample: int = 256) -> str:
    """A cheap digest of a checkpoint's weights: every tensor's name, dtype and shape, and its first, middle
    and last `sample` bytes (a few pages of a memory map, whatever the checkpoint size)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        n = flat.size
        mid = max(0, n // 2 - sample // 2)
        for part in (flat[:sample], flat[mid:mid + sample], flat[max(0, n - sample):]):
            h.update(part.tobytes())
    return h.hexdigest()


def model_fingerprint(config: Mapping[str, Any], tokenizer_path: str | Path, tokenizer_vocab_size: int,
                      weights: str | None) -> str:
    """Identity of the model a session state belongs to: its config (as a dict), its tokenizer (file and vocab
    size) and the digest of its weights (`weights_digest`; None for a model built by hand, which is then
    identified by config + tokenizer only). The bytes hashed are those of every earlier lily, so session files
    saved before stay readable."""
    h = hashlib.sha256()
    h.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
    h.update(f"|vocab={tokenizer_vocab_size}|".encode())
    try:
        h.update(hashlib.sha256(Path(tokenizer_path).read_bytes()).digest())
    except OSError:
        pass
    h.update(str(weights).encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class ModelIdentity:
    """What a session file records of the model it was saved from, and checks on reading."""

    fingerprint: str   # model_fingerprint: a file from another model is refused
    path: str | None   # where the model was loaded from (named in messages and in the file's metadata)
    vocab_size: int    # rows of its logits

"""What identifies a model for its saved states: a cheap digest of the checkpoint's weights (recorded by
`lily.load`) and the fingerprint (config + tokenizer + that digest) that session files carry."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

if TYPE_CHECKING:
    from .model import Model


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


def model_fingerprint(model: "Model") -> str:
    """Identity of the model a session state belongs to: config, tokenizer, and the weights digest that
    `lily.load` records (models built by hand without one are identified by config + tokenizer only)."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    tok = model.tokenizer
    h.update(f"|vocab={tok.vocab_size}|".encode())
    try:
        h.update(hashlib.sha256(Path(tok.path).read_bytes()).digest())
    except OSError:
        pass
    h.update(str(getattr(model, "weights_digest", None)).encode())
    return h.hexdigest()[:32]

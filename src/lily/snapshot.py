"""`SessionSnapshot`: a point of a session to come back to, shared by `Session`, `PrefixCache` and session
files (its own module so that none of those needs to import another for it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SessionSnapshot:
    """A point of a session to come back to (`Session.restore`); the engine state is a deep copy."""

    state: Any
    tokens: tuple[int, ...]
    pending: tuple[int, ...]
    last_logits: np.ndarray | None

    @property
    def position(self) -> int:
        return len(self.tokens) + len(self.pending)


def snapshot_nbytes(snap: SessionSnapshot) -> int:
    """Bytes a snapshot holds (the engine state, the logits row and the tokens), for the cache's budget."""
    logits = 0 if snap.last_logits is None else int(snap.last_logits.nbytes)
    return int(getattr(snap.state, "nbytes", 0)) + logits + 8 * len(snap.tokens)

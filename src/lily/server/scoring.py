"""Prompt scoring for `/v1/completions` with `echo` and `logprobs` (lm-evaluation-harness sends
`max_tokens: 0`): the log-probability of every prompt token given the ones before it, teacher-forced from
an empty state, in pieces so a long prompt never holds a [S, vocab] array."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .worker import NonFiniteLogits

if TYPE_CHECKING:
    from ..model import Model

PIECE = 256  # prompt tokens per engine call (logits of a piece: PIECE x vocab float32)


def prompt_logprobs(model: "Model", ids: list[int], n_top: int) -> list[tuple[int, float | None, dict | None]]:
    """[(token id, logprob or None for the first token, {id: logprob} of the n_top best or None)]."""
    out: list[tuple[int, float | None, dict | None]] = [(ids[0], None, None)]
    engine = model.engine
    state = engine.new_state()
    for start in range(0, len(ids) - 1, PIECE):
        piece = ids[start:min(start + PIECE, len(ids) - 1)]
        rows = np.asarray(engine.forward(state, np.asarray(piece, np.int32), logits="all",
                                         chunk_size=model.chunk_size), np.float64)
        if not np.isfinite(rows).all():
            raise NonFiniteLogits(f"the model produced non-finite logits (NaN or inf) while scoring prompt tokens "
                                  f"{start}..{start + len(piece) - 1}: the weights or the engine are broken")
        m = rows.max(axis=1, keepdims=True)
        logz = m[:, 0] + np.log(np.exp(rows - m).sum(axis=1))
        for r in range(len(piece)):
            t = ids[start + r + 1]
            top = None
            if n_top > 0:
                best = np.argpartition(-rows[r], n_top - 1)[:n_top]
                best = best[np.argsort(-rows[r][best], kind="stable")]
                top = {int(b): float(rows[r][b] - logz[r]) for b in best}
            out.append((t, float(rows[r][t] - logz[r]), top))
    return out

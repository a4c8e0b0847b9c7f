"""Prompt scoring for `/v1/completions` with `echo` and `logprobs` (lm-evaluation-harness sends
`max_tokens: 0`): the log-probability of every prompt token given the ones before it, teacher-forced from
an empty state, in pieces: the worker runs one piece between the decode rounds of the other requests
(EngineWorker.call_sliced), so a long prompt neither stalls the running streams nor ignores a hang-up, a
timeout or a shutdown, and only one piece's logits [piece, vocab] are ever held."""
from __future__ import annotations

from typing import TYPE_CHECKING, Generator

import numpy as np

from .worker import NonFiniteLogits

if TYPE_CHECKING:
    from ..model import Model

PIECE = 256                # prompt tokens per engine call at most
PIECE_LOGITS = 1 << 24     # ... and at most this many logits a piece (64 MB float32: 67 rows of a 248K vocabulary)
PIECE_MIN = 16             # ... and at least this many (a piece's fixed costs)
ATTENTION_EVEN = 2048      # keys at which a row's attention costs about what the rest of its layers cost


def piece_rows(vocab: int, position: int = 0) -> int:
    """Prompt tokens in the piece that starts at `position`. A row's cost grows with the keys it attends to, so the
    pieces shrink as the prompt goes on (by ATTENTION_EVEN / (ATTENTION_EVEN + position)), so a piece near the end of
    a long prompt stalls the other streams about as long as one at its start (a fixed 256 tokens cost 10x more at
    20K than at 0 on the CPU with the tiled attention kernel).
    The sizes depend on the position alone, never on timings, so the same prompt is cut the same way every time
    (its logprobs do not depend on the server's load)."""
    by_cost = PIECE * ATTENTION_EVEN // (ATTENTION_EVEN + max(0, position))
    return max(1, min(PIECE_LOGITS // max(1, vocab), max(PIECE_MIN, by_cost)))


def prompt_logprobs(model: "Model", ids: list[int], n_top: int) -> Generator[int, None, list]:
    """A generator: yields the prompt tokens scored so far after each piece, and returns [(token id, logprob or None
    for the first token, {id: logprob} of the n_top best or None)]."""
    out: list[tuple[int, float | None, dict | None]] = [(ids[0], None, None)]
    engine = model.engine
    state = engine.new_state()
    start = 0
    while start < len(ids) - 1:
        piece = ids[start:min(start + piece_rows(model.vocab_size, start), len(ids) - 1)]
        rows = np.asarray(engine.forward(state, np.asarray(piece, np.int32), logits="all",
                                         chunk_size=model.chunk_size), np.float32)
        if not np.isfinite(rows).all():
            raise NonFiniteLogits(f"the model produced non-finite logits (NaN or inf) while scoring prompt tokens "
                                  f"{start}..{start + len(piece) - 1}: the weights or the engine are broken")
        m = rows.max(axis=1, keepdims=True)
        # log-sum-exp: the exponentials of the shifted row in float32 (each in [0, 1]), their sum in float64
        logz = m[:, 0].astype(np.float64) + np.log(np.exp(rows - m).sum(axis=1, dtype=np.float64))
        for r in range(len(piece)):
            t = ids[start + r + 1]
            top = None
            if n_top > 0:
                best = np.argpartition(-rows[r], n_top - 1)[:n_top]
                best = best[np.argsort(-rows[r][best], kind="stable")]
                top = {int(b): float(rows[r][b] - logz[r]) for b in best}
            out.append((t, float(rows[r][t] - logz[r]), top))
        start += len(piece)
        yield start
    return out

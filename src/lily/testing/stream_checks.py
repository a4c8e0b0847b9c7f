"""Checks of the engine's device-mode token streams against the host sampler (lily.sampling.draw_token, one step of
`Sampler`), for every backend that draws on its device (the CPU backend's twin with the flag device_draw, emulated
Metal, CUDA): a stream's draws are replayed lock-step to get each step's logits row, and every drawn token must be
the host's draw from that row with the stream's uniform sequence (lily.sampling.stream_uniforms), seen / counts
following the draws.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sampling import Sampler, SamplingParams, draw_token, stream_uniforms

# A draw may differ from the host's (float64 weights) only where its uniform lands within this of a CDF step (the
# devices sum in float32; the CUDA kernel check benchmarks/kernels/check_sample.cu uses the same bound).
CDF_TOL = 1e-5


def near_boundary(logits, params, seen, counts, u, token) -> bool:
    """True when `token` is kept by the host sampler and u lies within CDF_TOL of its CDF interval."""
    lo_tok = draw_token(logits, params, seen, counts, max(0.0, u - CDF_TOL))
    hi_tok = draw_token(logits, params, seen, counts, min(1 - 1e-9, u + CDF_TOL))
    return min(lo_tok, hi_tok) <= token <= max(lo_tok, hi_tok)


def host_record(vocab: int, prompt, first: int) -> tuple[np.ndarray, np.ndarray]:
    """(seen uint8 [V], counts int32 [V]) as a Session hands them to a stream: the prompt and the first generated
    token seen, the first token counted once."""
    seen = np.zeros(vocab, np.uint8)
    seen[np.asarray(prompt)] = 1
    seen[first] = 1
    counts = np.zeros(vocab, np.int32)
    counts[first] = 1
    return seen, counts


@dataclass
class StreamRun:
    device: bool            # the engine drew on its device (else it declined the sampler)
    position: int           # state.position after close()
    tokens: list[int]       # the stream's draws, in order
    held: np.ndarray | None  # close(logits=True): the last step's row, held on the device
    rows: np.ndarray        # [steps, V] each step's logits, replayed lock-step


def run_and_replay(engine: Any, state: Any, snap: Any, first: int, steps: int, params: SamplingParams,
                   seen: np.ndarray | None, counts: np.ndarray | None, seed: int) -> StreamRun:
    """A device-mode stream of `steps` tokens from `first` (state restored from snap first), then the same tokens fed
    lock-step from snap again for the rows each draw came from."""
    state.restore(snap)
    s = engine.open_stream(state, first, steps, device=True, seen=seen, counts=counts, seed=seed,
                           **params.draw_options())
    got = [s.next() for _ in range(steps)] if s.device else []
    held = s.close(logits=True)
    run = StreamRun(s.device, state.position, got, held, np.zeros((0, 0), np.float32))
    state.restore(snap)
    lock = engine.open_stream(state, first, steps, device=False)
    rows, tok = [], first
    for t in got:
        rows.append(lock.step(tok))
        tok = t
    lock.close()
    run.rows = np.stack(rows) if rows else run.rows
    return run


def draws_vs_host(run: StreamRun, params: SamplingParams, seen: np.ndarray | None, counts: np.ndarray | None,
                  seed: int, exact: bool) -> tuple[list[tuple[int, int, int]], int]:
    """(mismatches [(step, drawn, host's)], draws within CDF_TOL of a CDF step) of one run. exact: the backend
    weighs in float64 as the host does (the CPU twin), so no boundary allowance."""
    V = run.rows.shape[-1] if run.rows.size else 0
    seen = np.zeros(V, bool) if seen is None else np.asarray(seen).astype(bool)
    counts = np.zeros(V, np.int32) if counts is None else np.asarray(counts, np.int32).copy()
    bad, boundary = [], 0
    for i, u in enumerate(stream_uniforms(seed, len(run.tokens))):
        want = draw_token(run.rows[i], params, seen, counts, u)
        got = run.tokens[i]
        if got != want:
            if not exact and near_boundary(run.rows[i], params, seen, counts, u, got):
                boundary += 1
            else:
                bad.append((i, got, want))
        seen[got] = True
        counts[got] += 1
    return bad, boundary


def parting_explained(row_a: np.ndarray, row_b: np.ndarray, params: SamplingParams, seen: np.ndarray,
                      counts: np.ndarray, u: float, token_a: int) -> tuple[bool, float]:
    """Where two backends' texts for one seed part (token_a drawn from row_a [V], another from row_b [V], both with
    the uniform number u and the record seen / counts [V]; params sampled, not greedy): (whether the two rows'
    difference explains it, delta). The kept
    distributions of the two rows differ by delta = sum |p_a - p_b|, which bounds how far any CDF step moved, so
    token_a must be a draw from row_b with a number within delta of u (draws are monotone in u)."""
    probs = []
    for row in (row_a, row_b):
        s = Sampler(params, row.size)
        s.seen[:] = np.asarray(seen).astype(bool)
        s.counts[:] = np.asarray(counts, np.int32)
        ids, p = s.candidates(s.process(row))
        probs.append(dict(zip(ids.tolist(), p.tolist())))
    delta = sum(abs(probs[0].get(k, 0.0) - probs[1].get(k, 0.0)) for k in probs[0].keys() | probs[1].keys())
    lo = draw_token(row_b, params, seen, counts, max(0.0, u - delta - CDF_TOL))
    hi = draw_token(row_b, params, seen, counts, min(1 - 1e-9, u + delta + CDF_TOL))
    return lo <= token_a <= hi, delta

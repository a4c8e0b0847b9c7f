"""Checks of the engine's device-mode token streams against the host sampler (lily.sampling.draw_token, one step of
`Sampler`), for every backend that draws on its device (the CPU backend's twin with the flag device_draw, emulated
Metal, CUDA): a stream's draws are replayed lock-step to get each step's logits row, and every drawn token must be
the host's draw from that row with the stream's uniform sequence (lily.sampling.stream_uniforms), seen / counts
following the draws. Also: `parting_explained` / `parting_probability` for two backends' rows, `teacher_forced_draws`
(a device's draw at every step of the host's text), and `precision_cases` (crafted rows where a float32 choice of
the one semantics decides the kept set).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sampling import Sampler, SamplingParams, draw_token, resolve_sampling, stream_uniform, stream_uniforms
from .tolerances import KERNEL_CHECKS

# A draw may differ from the host's (float64 weights) only where its uniform lands within this of a CDF step (the
# devices weigh and sum in float32): the tolerance table's device-sampler bound, as the kernel suite uses it.
CDF_TOL = KERNEL_CHECKS["sample_rel"]


def _kept(row: np.ndarray, params: SamplingParams, seen: np.ndarray, counts: np.ndarray):
    """The host rule's kept tokens of row [V] and their probabilities, in vocabulary order (ids, p)."""
    s = Sampler(params, row.size)
    s.seen[:] = np.asarray(seen).astype(bool)
    s.counts[:] = np.asarray(counts, np.int32)
    return s.candidates(s.process(row))


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
    token_a must be a draw from row_b with a number within delta of u (draws are monotone in u). This holds by that
    bound whenever token_a is the host rule's draw from row_a: it checks the two rows' comparison, not a device's
    rule (that is: a device's draw == the host rule's on the device's own row, `draws_vs_host`)."""
    probs = [dict(zip(ids.tolist(), p.tolist())) for ids, p in (_kept(r, params, seen, counts) for r in (row_a, row_b))]
    delta = sum(abs(probs[0].get(k, 0.0) - probs[1].get(k, 0.0)) for k in probs[0].keys() | probs[1].keys())
    lo = draw_token(row_b, params, seen, counts, max(0.0, u - delta - CDF_TOL))
    hi = draw_token(row_b, params, seen, counts, min(1 - 1e-9, u + delta + CDF_TOL))
    return lo <= token_a <= hi, delta


@dataclass
class ForcedStep:
    """One step of `teacher_forced_draws`: at the host text's context, the host's token and the device's draw."""
    step: int
    want: int                # the host's token (its generation)
    got: int                 # the device's draw at the same context, seed number and record
    u: float                 # the step's uniform number (stream_uniform(seed, step))
    row: np.ndarray          # [V] the device's logits row it drew from
    seen: np.ndarray         # [V] bool: the record the step drew with (prompt and the host's tokens before it)
    counts: np.ndarray       # [V] int32


def teacher_forced_draws(host: Any, device: Any, prompt: str, n: int, **kw: Any
                         ) -> tuple[SamplingParams, list[int], list[ForcedStep]]:
    """The host model's seeded generation of n tokens, then at every step i of it the draw the device model's engine
    makes at that context: step 0 as a session draws a first token (the host Sampler on the device's prefill row),
    step i >= 1 by a one-step device-mode stream that feeds token i - 1 with seed + i (the handover a session makes
    after its first draw, Sampler.stream_seed, moved to step i) and the host's record (prompt seen, tokens before i
    seen and counted). So every step is checked, not only the steps before the texts first part.
    Returns (the resolved options, the prompt ids, the steps)."""
    params = resolve_sampling(host.generation_config, **kw)
    if params.seed is None:
        raise ValueError("teacher_forced_draws: a seed is needed")
    want = list(host.generate(prompt, max_tokens=n, **kw).token_ids)
    ids = list(host.tokenize(prompt))
    eng = device.engine
    V = int(eng.vocab_size)
    seen = np.zeros(V, bool)
    seen[ids] = True
    counts = np.zeros(V, np.int32)
    steps = []
    for i, tok in enumerate(want):
        u = stream_uniform(params.seed, i)
        if i == 0:  # a session's first token: the host's draw from the prompt's last row
            row = np.asarray(eng.forward(eng.new_state(), np.asarray(ids, np.int32), logits="last")[-1], np.float32)
            got = draw_token(row, params, seen, counts, u)
        else:
            st = eng.new_state()
            eng.forward(st, np.asarray(ids + want[:i - 1], np.int32), logits="none")
            s = eng.open_stream(st, want[i - 1], 1, device=True, seed=(params.seed + i) & ((1 << 64) - 1),
                                seen=seen.astype(np.uint8), counts=counts.copy(), **params.draw_options())
            if not s.device:
                raise RuntimeError(f"teacher_forced_draws: the {eng.backend} engine declined the device sampler")
            got = s.next()
            row = s.close(logits=True)
        steps.append(ForcedStep(i, int(tok), int(got), u, row, seen.copy(), counts.copy()))
        seen[tok] = True
        counts[tok] += 1
    return params, ids, steps


def parting_probability(row_a: np.ndarray, row_b: np.ndarray, params: SamplingParams, seen: np.ndarray,
                        counts: np.ndarray) -> float:
    """The measure of the uniform numbers u in [0, 1) for which the draws from row_a and row_b (the same record and
    options; sampled, not greedy) differ: the chance that two backends whose rows are these part at this step."""
    cdfs = [(ids, np.cumsum(p)) for ids, p in (_kept(r, params, seen, counts) for r in (row_a, row_b))]
    edges = np.unique(np.concatenate([[0.0, 1.0], np.clip(cdfs[0][1], 0, 1), np.clip(cdfs[1][1], 0, 1)]))
    mids, widths = (edges[1:] + edges[:-1]) / 2, np.diff(edges)
    tok = [ids[np.minimum(np.searchsorted(cdf, mids, side="right"), ids.size - 1)] for ids, cdf in cdfs]
    return float(widths[tok[0] != tok[1]].sum())


# ---- crafted rows where a precision choice decides the draw -------------------------------------------------------

@dataclass
class PrecisionCase:
    """A row on which one choice of the one semantics (float32 options, float32 processing rounded per operation, the
    greedy limit) decides which tokens are kept: `kept` is what the rule keeps, `draws` (u, token) what it draws.
    Another choice (float64 options, a fused multiply-add, double processing) keeps or draws otherwise."""
    name: str
    x: np.ndarray            # float32 [V] raw logits
    params: SamplingParams
    seen: np.ndarray         # bool [V]
    counts: np.ndarray       # int32 [V]
    kept: set[int]
    draws: list[tuple[float, int]]


def _f32_neighbours(v: np.float32) -> tuple[float, float, float]:
    """(v, the next float32 above, the midpoint between them) as float64."""
    up = np.nextafter(v, np.float32(np.inf))
    return float(v), float(up), (float(v) + float(up)) / 2


def precision_cases() -> list[PrecisionCase]:
    """The crafted rows (each found by a search over float32 neighbours, so each holds on any IEEE machine)."""
    f32 = np.float32
    out = []

    def case(name, x, params, kept, draws, seen=(), counts=None):
        x = np.asarray(x, np.float32)
        sn = np.zeros(x.size, bool)
        sn[list(seen)] = True
        c = np.zeros(x.size, np.int32) if counts is None else np.asarray(counts, np.int32)
        out.append(PrecisionCase(name, x, params, sn, c, set(kept), [(float(f32(u)), t) for u, t in draws]))

    # top_p that rounds to 1 in float32 is off on the devices (o.top_p < 1.f is false): every token stays
    case("top_p rounding to 1 is off", [0.0, -25.0], SamplingParams(top_p=1 - 1e-9), {0, 1}, [(0.5, 0)])

    # top-p's threshold is float32(top_p) * the kept mass: x = [0, a] keeps token 1 iff top_p > q = 1 / (1 + e^a);
    # top_p is a double just below q that rounds to a float32 just above it (float64 top_p would drop token 1)
    a = f32(-2.2)
    while True:
        q = 1.0 / (1.0 + np.exp(np.float64(a)))
        lo = f32(q) if float(f32(q)) < q else np.nextafter(f32(q), f32(0))
        _, t32, mid = _f32_neighbours(lo)
        if mid < q and t32 - q > 1e-12 and q - (mid + q) / 2 > 1e-12 and float(f32((mid + q) / 2)) == t32:
            break
        a = np.nextafter(a, f32(0))
    case("top_p threshold with float32(top_p)", [0.0, a], SamplingParams(top_p=(mid + q) / 2), {0, 1},
         [(0.999, 1), (0.5, 0)])

    # min-p's threshold is float32(min_p): w = e^a lies in [float32(min_p), min_p)
    a = f32(-0.1)
    while True:
        w = float(np.exp(np.float64(a)))
        d32 = f32(w) if float(f32(w)) <= w else np.nextafter(f32(w), f32(0))
        d, _, mid = _f32_neighbours(d32)
        if d < w < mid and (w + mid) / 2 - w > 1e-13 and float(f32((w + mid) / 2)) == d:
            break
        a = np.nextafter(a, f32(-1))
    case("min_p threshold with float32(min_p)", [0.0, a], SamplingParams(min_p=(w + mid) / 2), {0, 1},
         [(0.99, 1), (0.3, 0)])

    # a T whose float32 reciprocal overflows draws the argmax (lowest index on ties), as T = 0 does: the devices'
    # weights are NaN at the max there, which they count as no weight (a float64 1/T would split the tie by u)
    case("T with an overflowing float32 1/T is greedy", [0.0, 5.0, 5.0], SamplingParams(temperature=1e-40), {1},
         [(0.0, 1), (0.9, 1)])

    # the repetition penalty in float32: 1.0 / 3 ties token 0's 0.33333334 at top-k's 2nd value (both kept); in
    # double they would not tie and token 1 would drop
    x = [float(f32(1.0) / f32(3.0)), 1.0, 5.0]
    wt = np.exp(np.float64(x[0]) - 5.0)
    case("repetition penalty tie in float32", x, SamplingParams(top_k=2, repetition_penalty=3.0), {0, 1, 2},
         [(1.5 * wt / (1 + 2 * wt), 1), (0.5 * wt / (1 + 2 * wt), 0), (0.9, 2)], seen=[1])

    # frequency * count + presence with the product and the sum rounded apart: 0.1 * 10 + 0.3 is 1.3 in float32
    # (a fused multiply-add gives 1.3000001): token 0 (0, counted 10 times) ties token 1 (-1.3) at top-k's 2nd value
    freq, pres, c = 0.1, 0.3, 10
    two = f32(f32(f32(freq) * f32(c)) + f32(pres))
    assert two != f32(float(f32(freq)) * c + float(f32(pres)))  # the fused value differs (exact in float64 here)
    x = [0.0, float(-two), 1.0]
    wt = np.exp(np.float64(-two) - 1.0)
    case("penalty product and sum rounded apart", x,
         SamplingParams(top_k=2, frequency_penalty=freq, presence_penalty=pres), {0, 1, 2},
         [(1.5 * wt / (1 + 2 * wt), 1), (0.5 * wt / (1 + 2 * wt), 0), (0.9, 2)], seen=[0], counts=[c, 0, 0])

    # a row with nothing above -inf: token 0, as the devices' argmax of it
    case("nothing above -inf", [-np.inf] * 4, SamplingParams(temperature=0.7), {0}, [(0.5, 0)])
    return out

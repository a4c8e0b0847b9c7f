"""Device sampling checks of lily.testing.cuda_checks (rows in its format; benchmarks/cuda_check.py prints them):
the CUDA engine's decode_sample against the NumPy twin lily.sampling.device_sample_reference on the step's own logits, over option sets and draws;
seen/counts carried across steps on the device; the stale-sampler and stale-logits rules; and, on the bundled
model, greedy generation with the device sampler == with the host sampler, plus seeded reproducibility.
"""
from __future__ import annotations

import numpy as np

from ..sampling import SamplingParams, device_sample_reference

# The same relative tolerance as the kernel twin (benchmarks/kernels/check_sample.cu): a draw may differ from
# the twin only where uniform lands within this of a CDF step (float32 sums on the device, float64 here).
CDF_TOL = 1e-5

OPTION_SETS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+penalties+bias": SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                            frequency_penalty=0.3, logit_bias={0: 5.0, 3: -100.0}),
    "t1": SamplingParams(temperature=1.0),
    "t0.7 top_k 5": SamplingParams(temperature=0.7, top_k=5),
    "top_p 0.8": SamplingParams(top_p=0.8),
    "min_p 0.1": SamplingParams(min_p=0.1),
    "all": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                          presence_penalty=0.4, frequency_penalty=0.2, logit_bias={1: 2.0}),
}
DRAWS = (0.0, 0.123, 0.5, 0.77, 0.999999)


def _near_boundary(logits, params, seen, counts, u, token):
    """True when `token` is kept by the twin and u lies within CDF_TOL of its CDF interval."""
    lo_tok = device_sample_reference(logits, params, seen, counts, max(0.0, u - CDF_TOL))
    hi_tok = device_sample_reference(logits, params, seen, counts, min(1 - 1e-9, u + CDF_TOL))
    return min(lo_tok, hi_tok) <= token <= max(lo_tok, hi_tok)


def _begin(gpu, p, seen, counts):
    bias = p.logit_bias or {}
    return gpu.sampler_begin(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                             p.frequency_penalty, np.fromiter(bias.keys(), np.int32, len(bias)),
                             np.fromiter(bias.values(), np.float32, len(bias)), seen.astype(np.uint8),
                             counts.astype(np.int32))


def check_engine_sampling(name, cfg, gpu, toks, add):
    """decode_sample vs the twin on the same logits, per option set and draw, and over an 8-step chain."""
    V = cfg.vocab_size
    if len(toks) < 12:
        raise ValueError(f"check_engine_sampling: {len(toks)} tokens, expected >= 12 (a prefix, then 8 steps)")
    n0 = min(16, len(toks) - 10)
    st = gpu.new_state()
    gpu.forward(st, toks[:n0], logits="none")
    snap = st.snapshot()
    ref_row = gpu.forward(st, toks[n0:n0 + 1], logits="last")[0]
    rng = np.random.default_rng(17)
    seen0 = np.zeros(V, bool)
    seen0[toks[:n0 + 1]] = True
    mism, boundary, total, row_err = [], 0, 0, 0.0
    for label, p in OPTION_SETS.items():
        counts0 = np.zeros(V, np.int32)
        counts0[rng.integers(0, V, 5)] += 1
        for u in DRAWS:
            st.restore(snap)
            sid = _begin(gpu, p, seen0, counts0)
            nxt = gpu.decode_sample(st, int(toks[n0]), u, sid)
            lg = gpu.decode_logits(st)
            row_err = max(row_err, float(np.sqrt(np.mean((lg - ref_row) ** 2) / np.mean(ref_row ** 2))))
            want = device_sample_reference(lg, p, seen0, counts0, u)
            total += 1
            if nxt != want:
                if _near_boundary(lg, p, seen0, counts0, u, nxt):
                    boundary += 1
                else:
                    mism.append((label, u, nxt, want))
    add("device sampling == twin", not mism and row_err < 2e-2, cases=total, boundary=boundary,
        mismatches=mism[:4], logits_rel_rms_vs_forward=row_err)

    # A chain: the device's seen/counts must follow the drawn tokens (penalties change the next draws).
    p = OPTION_SETS["all"]
    st.restore(snap)
    seen, counts = seen0.copy(), np.zeros(V, np.int32)
    sid = _begin(gpu, p, seen, counts)
    tok, bad = int(toks[n0]), []
    for i in range(8):
        u = float(rng.random()) * 0.999
        nxt = gpu.decode_sample(st, tok, u, sid)
        want = device_sample_reference(gpu.decode_logits(st), p, seen, counts, u)
        if nxt != want and not _near_boundary(gpu.decode_logits(st), p, seen, counts, u, nxt):
            bad.append((i, nxt, want))
        seen[nxt] = True
        counts[nxt] += 1
        tok = nxt
    add("device sampling chain (seen/counts)", not bad and st.position == n0 + 8, steps=8, mismatches=bad)

    # Another begin makes an older id stale: nothing runs. A forward step invalidates the held logits.
    st.restore(snap)
    old = _begin(gpu, p, seen0, counts0)
    _begin(gpu, p, seen0, counts0)
    stale = gpu.decode_sample(st, int(toks[n0]), 0.5, old)
    pos_kept = st.position == n0
    gpu.forward(st, toks[n0:n0 + 1], logits="last")
    add("device sampling stale id / stale logits", stale == -1 and pos_kept and gpu.decode_logits(st) is None,
        stale_return=stale)


def check_session_sampling(results):
    """The bundled model on CUDA: greedy generation with the device sampler == with the host sampler; a seeded
    sampled generation is reproducible; decode tok/s of both samplers."""
    import lily

    def add(check, ok, **fig):
        results.append({"config": "bundled_model", "check": check, "pass": bool(ok), **fig})

    model = lily.load(backend="cuda")
    prompt = "The list type"
    out, speed = {}, {}
    for device in (True, False):
        for label, kw in (("greedy", dict(temperature=0.0)),
                          ("greedy+rep", dict(temperature=0.0, repetition_penalty=1.3)),
                          ("sampled", dict(temperature=0.8, top_p=0.9, top_k=50, seed=5))):
            s = model.session()
            s.device_sampling = device
            r = s.generate(prompt, max_tokens=96, stream=False, **kw)
            speed[(device, label)] = r.stats.decode_tokens_per_s
            out[(device, label)] = list(r.token_ids)
    add("session greedy: device == host", out[(True, "greedy")] == out[(False, "greedy")],
        tokens=len(out[(True, "greedy")]))
    add("session greedy+rep penalty: device == host", out[(True, "greedy+rep")] == out[(False, "greedy+rep")])
    s = model.session()
    again = s.generate(prompt, max_tokens=96, stream=False, temperature=0.8, top_p=0.9, top_k=50, seed=5)
    again = list(again.token_ids)
    add("session sampled: seeded run repeats", again == out[(True, "sampled")],
        decode_tok_s_device=speed[(True, "sampled")], decode_tok_s_host=speed[(False, "sampled")])

"""The CUDA device sampler (csrc/cuda/sample.cu: three launches, every buffer visible through cuda_ops.sample_launch)
against lily.sampling's one semantics (draw_token, the host Sampler's step): bias, repetition, presence / frequency
penalties; greedy (lowest index on ties) or top-k (ties kept), top-p over the kept (ties kept), min-p, and the draw by
the uniform number. The real vocab and awkward ones (1, 7, 31, 33, ...), rows of every kind (normal, flat, duplicated
values, -inf entries, one dominant token), every option alone and combined, signed zeros, ties at the cutoffs; five
uniform numbers a case (0, 0.5, 0.999999 and two random).

Exact: seen[token] = 1 and counts[token] + 1 and no other entry (nor a guard entry past V) changed; the raw row left as
it was; the processed-logits scratch written for every entry < V (and none past V) within sample_scratch_rel (1e-6)
of the host's processing, relative to the operands (a few fp32 roundings). The kernel weighs in fp32, so a token may
differ from the host's where a rounding decides it: it counts as the host's when the host draws it with the uniform
number moved by sample_rel (1e-5: a CDF step), or on the kernel's own processed row with top-p's and min-p's thresholds
moved by sample_rel relative (fp32 masses and weights)."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from cuda_checks import KC

from lily.sampling import Sampler, SamplingParams, draw_token

GUARD = 64  # entries past V in the scratch, seen and counts that nothing may write
REP, PRES, FREQ = 1.3, 0.5, 0.3
VOCABS = [1, 7, 31, 33, 1000, 4097, 65537, 248320]
ROWS = ["normal3", "flat", "dup0.5", "-inf", "dominant"]


def _row(rng, kind, V):
    x = (rng.standard_normal(V) * 3).astype(np.float32)
    if kind == "flat":
        x[:] = 1.25
    elif kind == "dup0.5":  # + 0: -0.0 would tie +0.0 on the host but not in the kernel's keys (the signed-zero case)
        x = np.round(2 * x) / 2 + np.float32(0)
    elif kind == "-inf" and V > 1:
        x[rng.random(V) < 0.3] = -np.inf
        x[[0, V // 2]] = -np.inf
        x[V - 1] = rng.standard_normal() * 3  # one finite entry at least
    elif kind == "dominant":  # N(0, 1) and one token at 20
        x /= 3
        x[rng.integers(0, V)] = 20
    return x.astype(np.float32)


def _record(rng, V):
    """(seen uint8 [V], counts int32 [V]): 10% of tokens generated 1-3 times, 20% more in the prompt."""
    counts = np.where(rng.random(V) < 0.1, rng.integers(1, 4, V), 0).astype(np.int32)
    return ((counts > 0) | (rng.random(V) < 0.2)).astype(np.uint8), counts


# (T, top_k, top_p, min_p, repetition, penalties, bias, top_k counted from V)
def _params(rng, V, T=1.0, k=0, p=1.0, mp=0.0, rep=False, pen=False, bias=False, k_rel=False) -> SamplingParams:
    logit_bias = None
    if bias:  # distinct ids, always the last and the first
        logit_bias = {V - 1: 6.0}
        if V > 1:
            logit_bias[0] = 3.0
        while len(logit_bias) < min(V, 5):
            logit_bias.setdefault(int(rng.integers(0, V)), float(rng.uniform(-4, 4)))
    return SamplingParams(temperature=T, top_k=V + k if k_rel else k, top_p=p, min_p=mp,
                          repetition_penalty=REP if rep else 1.0, presence_penalty=PRES if pen else 0.0,
                          frequency_penalty=FREQ if pen else 0.0, logit_bias=logit_bias)


def _processed(x, params, seen, counts):
    """The host's processed row (bias, penalties: fp32) and each entry's operand scale (for the scratch's bound)."""
    s = Sampler(params, x.size)
    s.seen[:], s.counts[:] = seen.astype(bool), counts
    rep = params.repetition_penalty if params.repetition_penalty != 1.0 else 1.0
    scale = np.abs(x.astype(np.float64)) * np.where(seen.astype(bool), rep, 1.0)
    scale += np.where(counts > 0, params.frequency_penalty * counts + params.presence_penalty, 0.0)
    for i, b in (params.logit_bias or {}).items():
        scale[i] += abs(b) * rep
    return s.process(x), scale


def _explained(x, params, seen, counts, u, token, xk) -> bool:
    """Whether `token` is the host's draw with u moved by sample_rel, or on the kernel's processed row xk (nothing
    left to process) with top-p's and min-p's thresholds moved by sample_rel relative."""
    eps = KC["sample_rel"]
    bare = dataclasses.replace(params, logit_bias=None, repetition_penalty=1.0, presence_penalty=0.0,
                               frequency_penalty=0.0)
    tps = {params.top_p} | ({min(1.0, params.top_p * (1 + d)) for d in (-eps, eps)} if params.top_p < 1 else set())
    mps = {params.min_p} | ({min(1.0, params.min_p * (1 + d)) for d in (-eps, eps)} if params.min_p > 0 else set())
    us = {u, max(0.0, u - eps), min(1 - 1e-9, u + eps)}
    for uu in us:
        if draw_token(x, params, seen, counts, uu) == token:
            return True
    # any u' within eps of u, not only its ends: the draw walks the vocabulary in order, so it is monotone in u, and
    # in a row's far tail (one dominant token, u near 1) many tokens lie between the ends' draws
    if draw_token(x, params, seen, counts, max(0.0, u - eps)) <= token <= \
            draw_token(x, params, seen, counts, min(1 - 1e-9, u + eps)):
        return True
    for tp, mp, uu in itertools.product(tps, mps, us):
        if draw_token(xk, dataclasses.replace(bare, top_p=tp, min_p=mp), None, None, uu) == token:
            return True
    return False


def _check(cuda, name, x, params, seen, counts, uniforms):
    V = x.size
    seen_g = np.concatenate([seen, np.full(GUARD, 0x5A, np.uint8)])  # guard entries: sentinels
    counts_g = np.concatenate([counts, np.full(GUARD, 0x12345, np.int32)])
    x_host, scale = _processed(x, params, seen, counts)
    boundary = 0
    for u in uniforms:
        r = cuda.sample_launch(x, float(u), seen_g, counts_g, **params.draw_options())
        tok = r["token"]
        tag = f"cuda sample {name} u={u:.7f}"
        assert 0 <= tok < V, f"{tag}: token {tok} out of range"
        want_seen, want_counts = seen_g.copy(), counts_g.copy()
        want_seen[tok], want_counts[tok] = 1, counts_g[tok] + 1
        np.testing.assert_array_equal(r["seen"], want_seen, err_msg=tag + " seen")
        np.testing.assert_array_equal(r["counts"], want_counts, err_msg=tag + " counts")
        np.testing.assert_array_equal(r["logits"].view(np.uint32), x.view(np.uint32), err_msg=tag + " raw row changed")
        xk = r["x"][:V]
        finite = np.isfinite(x_host)
        off = np.abs(xk[finite].astype(np.float64) - x_host[finite]) / np.maximum(scale[finite], 1e-30)
        assert np.all(off <= KC["sample_scratch_rel"]), f"{tag}: scratch off the host's processing ({off.max():.1e})"
        np.testing.assert_array_equal(xk[~finite], x_host[~finite], err_msg=tag + " scratch's -inf entries")
        assert np.all(r["x"][V:].view(np.uint32) == 0xFFFFFFFF), f"{tag}: scratch entries past V written"
        want = draw_token(x, params, seen, counts, float(u))
        if tok != want:
            assert _explained(x, params, seen, counts, float(u), tok, xk), f"{tag}: token {tok}, host's {want}"
            boundary += 1
    print(f"cuda sample {name}: {len(uniforms)} draws, {boundary} decided by a rounding")


def _uniforms(rng):
    return np.array([0.0, 0.5, 0.999999, rng.random(), rng.random()], np.float32)


GREEDY_ALL = dict(T=0.0, k=5, p=0.5, mp=0.05, rep=True, pen=True, bias=True)  # processing only matters
COMBO = dict(T=0.7, k=50, p=0.9, mp=0.05, rep=True, pen=True, bias=True)  # the penalties reorder before the cuts


@pytest.mark.parametrize("opts", ["greedy_all", "combo"])
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("V", VOCABS)
def test_rows(cuda, rng, V, row, opts):
    x = _row(rng, row, V)
    seen, counts = _record(rng, V)
    params = _params(rng, V, **(GREEDY_ALL if opts == "greedy_all" else COMBO))
    _check(cuda, f"V={V} {row} {opts}", x, params, seen, counts, _uniforms(rng))


# one option at a time and small combinations: greedy (+ bias, which moves the argmax); temperatures; top-k 1, 5, 50,
# V-1, V, V+3; top-p 0.9, 0.5, 1e-6; min-p 0.05 and 1; each penalty; pairs and the full set
FEATS = [dict(T=0.0), dict(T=0.0, bias=True), dict(), dict(T=0.7), dict(T=1.5), dict(k=1), dict(k=5), dict(k=50),
         dict(k=-1, k_rel=True), dict(k=0, k_rel=True), dict(k=3, k_rel=True), dict(p=0.9), dict(p=0.5),
         dict(p=1e-6), dict(mp=0.05), dict(mp=1.0), dict(rep=True), dict(pen=True), dict(bias=True),
         dict(T=1.5, k=5, p=0.5), dict(T=0.7, p=0.9, mp=0.05), dict(k=-1, p=0.9, k_rel=True),
         dict(k=50, rep=True, pen=True), dict(k=1, bias=True),
         dict(T=1.5, p=1e-6, mp=1.0, rep=True, pen=True, bias=True)]
# each feature at the real vocab and at two (row, vocab) pairs that rotate through the others
FEAT_CASES = [(i, row, V) for i in range(len(FEATS))
              for row, V in (("normal3", 248320), (ROWS[i % 5], VOCABS[i % 7]),
                             (ROWS[(i + 2) % 5], VOCABS[(i + 3) % 7]))]


@pytest.mark.parametrize("i,row,V", FEAT_CASES, ids=[f"feat{i}-{r}-V{V}" for i, r, V in FEAT_CASES])
def test_features(cuda, rng, i, row, V):
    x = _row(rng, row, V)
    seen, counts = _record(rng, V)
    _check(cuda, f"V={V} {row} {FEATS[i]}", x, _params(rng, V, **FEATS[i]), seen, counts, _uniforms(rng))


@pytest.mark.parametrize("opts", [dict(k=3), dict(p=0.5)], ids=["topk", "topp"])
def test_signed_zeros(cuda, rng, opts):
    """-0.0 == +0.0: the host keeps both at a top-k / top-p cutoff of 0 (u = 0 then picks index 0)."""
    x = np.array([-0.0, 0.0, 0.0, -0.0, -1.0, -2.0, 0.0], np.float32)
    seen, counts = _record(rng, 7)
    _check(cuda, f"+-zeros {opts}", x, _params(rng, 7, **opts), seen, counts, _uniforms(rng))


# Ties at the k-th value: top-k's kept set of about 670, 1,000 (beside the final block's 1,024 threads) or 1,370+
# entries, gathered into the final block's shared memory or left to the whole set's path; k = 600 of 3 levels keeps
# the top two, which top-p 0.9 keeps and top-p 0.5 cuts.
TIES = [dict(k=50, p=0.9), dict(T=0.7, k=20, p=0.5, mp=0.05), dict(k=600, p=0.9), dict(k=600, p=0.5)]


@pytest.mark.parametrize("opts", range(len(TIES)))
@pytest.mark.parametrize("V", [1500, 2000, 3000, 4097, 8000])
def test_ties(cuda, rng, V, opts):
    x = rng.integers(0, 3, V).astype(np.float32)  # 3 levels
    seen, counts = _record(rng, V)
    _check(cuda, f"3 levels V={V} {TIES[opts]}", x, _params(rng, V, **TIES[opts]), seen, counts, _uniforms(rng))

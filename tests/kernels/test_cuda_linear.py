"""CUDA prefill GEMMs (csrc/cuda/gemm*.cu): the engine's dispatch (wgmma / mma.sync / one-output kernel) and the wmma
fallback (impl 1), plain, accumulate, SiLU(gate) * up, concatenated projections and the grouped (MoE) products over a
tile map, on the real sizes (hidden 2,048, a 2,048-token chunk, the 248,320-row head) and awkward ones (one row, odd
M / N / K, padded strides, misaligned scales, empty experts, 8-bit). Weights with random codes (cuda_checks.RawWeight).

Reference: lily.quant's dequantized weights rounded once to bf16 (what the tensor-core tiles hold) times the bf16
inputs, in fp64, on sampled rows. Tolerances (KERNEL_CHECKS): fp32 outputs differ by fp32 accumulation order only
(~1e-6): gemm_rel_rms 2e-3, the low end of the bf16 band; bf16 outputs (the dual, the grouped down's d) one more
bf16 rounding (~1.1e-3): gemm_bf16_rel_rms 5e-3. Every output element must be written (NaN poison)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from cuda_checks import KC, RawWeight, bits, sample_rows, silu, vals

AUTO, FALLBACK, MMA = 0, 1, 2  # cuda_ops impl: the engine's dispatch, the wmma fallback, the mma GEMM launched directly
TOL, TOL_BF16 = KC["gemm_rel_rms"], KC["gemm_bf16_rel_rms"]


def _product(a: np.ndarray, w: RawWeight, e: int | None = None, chunk: int = 16384) -> np.ndarray:
    """a fp64 [R, in] @ W^T with W as the tiles hold it, a slice of rows at a time (the head's 248,320 rows)."""
    if w.experts or w.out <= chunk:
        return a @ w.tiles(e).astype(np.float64).T
    from lily.quant import round_bf16
    return np.concatenate([a @ round_bf16(w.rows(r, min(r + chunk, w.out))).astype(np.float64).T
                           for r in range(0, w.out, chunk)], axis=1)


# name, bits, M, N, K, mode, lda pad, ldy pad, scale/bias offset (bf16 elements past an aligned start)
REAL = [("deltanet_qkv", 4, 2048, 8192, 2048, "store"), ("deltanet_out", 4, 2048, 2048, 4096, "acc"),
        ("attn_kv", 4, 2048, 512, 2048, "store"), ("deltanet_b", 4, 2048, 32, 2048, "store"),
        ("router", 8, 2048, 256, 2048, "store"), ("shared_gate_up", 4, 2048, 512, 2048, "dual"),
        ("shared_down", 4, 2048, 2048, 512, "store"), ("shared_expert_gate", 4, 2048, 1, 2048, "store"),
        ("lm_head", 4, 5, 248320, 2048, "store")]
# every (M, N, K) of the awkward sizes; mode and bits rotate so each of the six pairs appears four times
ODD = [("odd", 8 if (i // 3) % 2 else 4, M, N, K, ("store", "acc", "dual")[i % 3])
       for i, (M, N, K) in enumerate(itertools.product([1, 3, 77, 130], [1, 32, 200], [64, 192]))]
PADDED = [("padded", 4, 77, 200, 192, "store", 8, 1, 1), ("padded", 4, 130, 72, 128, "dual", 16, 3, 1),
          ("padded", 8, 33, 40, 256, "acc", 8, 1, 1)]


@pytest.mark.parametrize("case", REAL + ODD + PADDED,
                         ids=lambda c: "{}-q{}-{}-M{}-N{}-K{}".format(*c[:2], c[5], *c[2:5]))
def test_gemm_plain(cuda, rng, case):
    name, nbits, M, N, K, mode = case[:6]
    lda_pad, ldy_pad, sb_off = case[6:] if len(case) > 6 else (0, 0, 0)
    lda, ldy = K + lda_pad, N + ldy_pad
    W0 = RawWeight(rng, nbits, N, K)
    W1 = RawWeight(rng, nbits, N, K) if mode == "dual" else None
    A = bits(rng.uniform(-1, 1, (M, lda)))
    y0 = rng.uniform(-1, 1, (M, ldy)).astype(np.float32)
    rows = sample_rows(rng, M, 64)
    a = vals(A[rows, :K]).astype(np.float64)
    r0 = _product(a, W0)
    ref = silu(r0) * _product(a, W1) if W1 else r0
    # one row: the mma GEMM itself (linear() would take the GEMV); else the dispatch, then the wmma fallback
    for impl in ([MMA] if M == 1 else [AUTO, FALLBACK]):
        tag = f"cuda gemm {('auto', 'wmma', 'mma')[impl]}/{name} q{nbits} {mode} M={M} N={N} K={K}"
        if W1:
            out = vals(cuda.linear_silu_mul(A, W0.t, W1.t, ldy=ldy, impl=impl, sb_offset=sb_off))
            base = 0.0
        else:
            out = cuda.linear(A, W0.t, y0=y0 if mode == "acc" else None, ldy=ldy, impl=impl, sb_offset=sb_off)
            base = y0[rows, :N] if mode == "acc" else 0.0
        assert np.all(np.isfinite(out[:, :N])), f"{tag}: unwritten (NaN) outputs"
        assert_close(tag, out[rows, :N] - base, ref, TOL_BF16 if W1 else TOL)


# name, bits, M, part rows, part output pads, K: the DeltaNet and attention in-projections, part boundaries inside the
# GEMMs' 64-row blocks, a one-row part, padded outputs; 8-bit (the router with the shared expert's gate)
CONCAT = [("deltanet_in", 4, 2048, [8192, 4096, 32, 32], [0, 0, 0, 0], 2048),
          ("attn_in", 4, 300, [8192, 512, 512], [0, 0, 0], 2048),
          ("odd", 4, 300, [1000, 37, 1, 300], [1, 3, 0, 5], 192),
          ("odd", 4, 33, [100, 37, 1], [0, 3, 2], 128), ("q8", 8, 2048, [256, 1], [0, 0], 2048),
          ("q8", 8, 5, [256, 1], [0, 0], 2048), ("odd", 8, 77, [33, 1, 70, 3], [1, 0, 2, 3], 128)]


@pytest.mark.parametrize("name,nbits,M,parts,pads,K", CONCAT,
                         ids=[f"{c[0]}-q{c[1]}-M{c[2]}-{len(c[3])}parts" for c in CONCAT])
def test_gemm_concat(cuda, rng, name, nbits, M, parts, pads, K):
    """One GEMM over the concatenated rows (the wgmma / mma epilogues route each feature to its part) and, as its twin,
    the parts alone (one linear() each), every part's output in its own poisoned buffer."""
    W = RawWeight(rng, nbits, sum(parts), K)
    A = bits(rng.uniform(-1, 1, (M, K)))
    rows = sample_rows(rng, M, 48)
    ref = _product(vals(A[rows]).astype(np.float64), W)
    bounds = np.cumsum([0] + parts)
    for concatenated in (True, False):
        ys = cuda.linear_concat(A, W.t, parts, pads, concatenated)
        for i, y in enumerate(ys):
            tag = f"cuda linear_concat {'concat' if concatenated else 'parts'} {name} q{nbits} M={M} part {i}"
            assert y.shape == (M, parts[i] + pads[i])
            assert np.all(np.isfinite(y[:, :parts[i]])), f"{tag}: unwritten (NaN) outputs"
            assert_close(tag, y[rows, :parts[i]], ref[:, bounds[i]:bounds[i + 1]], TOL)


def _routing_from_counts(rng, counts, S):
    """Pairs sorted by expert (counts [E]): token row a_rows [P], output row y_rows [P] (a permutation), weight
    scale [P]."""
    P = int(sum(counts))
    return (rng.integers(0, S, P).astype(np.int32), rng.permutation(P).astype(np.int32),
            rng.uniform(0.05, 1.0, P).astype(np.float32))


def _routing_skewed(rng, S, E, k):
    """Top-k of skewed expert popularity per token (Gumbel top-k over log-normal popularity), like real routing:
    (counts [E], a_rows, y_rows, scale)."""
    logp = 1.2 * rng.standard_normal(E)
    keys = logp[None, :] - np.log(-np.log(rng.uniform(1e-300, 1.0, (S, E))))
    top = np.argsort(-keys, axis=1)[:, :k]  # [S, k] experts of each token's pairs
    pair = np.arange(S * k)
    order = np.argsort(top.reshape(-1), kind="stable")  # pair ids grouped by expert, tokens ascending
    counts = np.bincount(top.reshape(-1), minlength=E)
    return counts, (pair[order] // k).astype(np.int32), pair[order].astype(np.int32), \
        rng.uniform(0.02, 0.5, S * k).astype(np.float32)


def _tile_map(counts, tile):
    """The tile map moe_sort builds (per expert, consecutive tiles of <= tile pairs), its capacity's unused entries
    holding garbage the kernels must not read: (tile_expert, tile_row0, tile_rows, n_tiles)."""
    te, t0, tr, off = [], [], [], 0
    for e, c in enumerate(counts):
        for r in range(0, c, tile):
            te.append(e), t0.append(off + r), tr.append(min(tile, c - r))
        off += c
    n, cap = len(te), -(-off // tile) + len(counts)
    pad = cap - n
    return (np.array(te + [0x7FFFFFFF] * pad, np.int32), np.array(t0 + [-1] * pad, np.int32),
            np.array(tr + [1 << 20] * pad, np.int32), n)


# name, counts (or "skewed"), tokens, bits, H, I (gate/up out), Kd (down in), D (down out), sampled pairs, tiles.
# The down reads its own random act_in, so I and Kd may differ.
def _grouped_cases():
    rng = np.random.default_rng(1)  # the counts only (the inputs come from the test's rng)
    c32 = (rng.uniform(0, 1, 32) ** 2 * 120).astype(int)
    c32[[0, 1, 2, 3, 7, 31]] = [0, 1, 300, 0, 0, 2]  # empty experts, a one-row and a 300-row expert
    odd = [0, 1, 37, 0, 130, 5, 0, 17]
    return [("moe", [int(c) for c in c32], 512, 4, 2048, 512, 512, 2048, 192, (16, 32, 64, 128)),
            ("moe_odd", odd, 97, 4, 192, 200, 128, 72, 1000, (16, 32, 64, 128)),
            # an odd down width: the bf16 d rows are not 4-byte aligned (every GEMM's scalar tail of the bf16 store)
            ("moe_odd_n", odd, 97, 4, 192, 200, 128, 75, 1000, (16, 64, 128)),
            ("moe_q8", [3, 0, 66, 1, 0, 129], 50, 8, 128, 40, 64, 256, 1000, (16, 64, 128)),
            # 2,048 tokens x top-8 of 256 skewed experts, at the engine's tile (pick_expert_tile: 64 for 16,384 pairs)
            ("moe_real", "skewed", 2048, 4, 2048, 512, 512, 2048, 128, (64,))]


GROUPED = _grouped_cases()


@pytest.mark.parametrize("name,counts,S,nbits,H,I,Kd,D,sample,tiles", GROUPED, ids=[c[0] for c in GROUPED])
def test_gemm_grouped(cuda, rng, name, counts, S, nbits, H, I, Kd, D, sample, tiles):
    """gate/up: act[p] = bf16(silu(h[a_rows[p]] W0[e]^T) * (h[a_rows[p]] W1[e]^T)); down: d[y_rows[p]] =
    bf16(scale[p] (act_in[p] W2[e]^T)); every tile size on the dispatch, those <= 64 on the wmma fallback too."""
    if counts == "skewed":
        counts, a_rows, y_rows, scale = _routing_skewed(rng, S, 256, 8)
    else:
        a_rows, y_rows, scale = _routing_from_counts(rng, counts, S)
    E, P = len(counts), int(sum(counts))
    expert = np.repeat(np.arange(E), counts)
    W0, W1 = RawWeight(rng, nbits, I, H, experts=E), RawWeight(rng, nbits, I, H, experts=E)
    W2 = RawWeight(rng, nbits, D, Kd, experts=E)
    h, act_in = bits(rng.uniform(-1, 1, (S, H))), bits(rng.uniform(-1, 1, (P, Kd)))
    ps = sample_rows(rng, P, sample)
    ref_act, ref_d = np.empty((len(ps), I)), np.empty((len(ps), D))
    for e in np.unique(expert[ps]):  # one expert's weights at a time
        at = np.flatnonzero(expert[ps] == e)
        a = vals(h[a_rows[ps[at]]]).astype(np.float64)
        ref_act[at] = silu(_product(a, W0, e)) * _product(a, W1, e)
        ref_d[at] = scale[ps[at], None] * _product(vals(act_in[ps[at]]).astype(np.float64), W2, e)
    for tile in tiles:
        te, t0, tr, n = _tile_map(counts, tile)
        for impl in (AUTO, FALLBACK) if tile <= 64 else (AUTO,):
            act, d = cuda.grouped(h, act_in, W0.t, W1.t, W2.t, te, t0, tr, n, a_rows, y_rows, scale, tile, impl)
            tag = f"cuda grouped {('auto', 'wmma')[impl]}/{name} q{nbits} tile={tile} E={E} pairs={P}"
            assert np.all(np.isfinite(vals(act))) and np.all(np.isfinite(vals(d))), f"{tag}: unwritten (NaN) outputs"
            assert_close(tag + " gate_up", vals(act[ps]), ref_act, TOL_BF16)
            assert_close(tag + " down", vals(d[y_rows[ps]]), ref_d, TOL_BF16)

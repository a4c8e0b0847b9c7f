"""CUDA MoE routing, pair sort and combine (csrc/cuda/moe.cu), and the unfused decode experts (gemm.cu) one launch at a
time: the router's softmax top-k against lily.reference.moe.route (ties to the lower id, non-finite rows), the sort's
grouping and tile map checked structurally, the combine against its formula, at the real sizes (256 experts, top-8,
hidden 2,048, up to 16,384 pairs) and awkward ones (k == E, E past the block, one token, skewed loads).

Tolerances (KERNEL_CHECKS): routing ids, sort outputs, copied weights: exact; routing weights and the combine's fp32
sums: small_fp32_rel_rms 1e-5 (a few fp32 roundings); the decode experts' bf16 outputs: gemm_bf16_rel_rms (bf16 act
and d; the weights read in fp32: the one-row GEMV)."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from cuda_checks import KC, RawWeight, bits, silu, vals

from lily.reference.moe import route as ref_route
from lily.reference.ops import sigmoid


# S, E, k, renormalise: the model (256 experts, top-8), one token, no renormalisation, few experts both ways, E not a
# multiple of the warp (33), k == E
@pytest.mark.parametrize("S,E,k,norm", [(37, 256, 8, True), (1, 256, 8, True), (300, 256, 8, False), (37, 5, 3, True),
                                        (37, 5, 3, False), (7, 33, 4, True), (3, 8, 8, True)])
def test_route(cuda, rng, S, E, k, norm):
    # logits ~ N(0, 2) on multiples of 1/64: distinct logits differ by >= 1/64 (1.6% in probability, far above fp32
    # rounding) and equal ones give equal probabilities, so the set and order are exact in the kernel and the reference
    logits = (np.round(rng.standard_normal((S, E)) * 2 * 64) / 64).astype(np.float32)
    if S > 1:
        logits[1] = 1.25  # every expert tied: the lowest ids
    if S > 2:
        logits[2] = -20 + (np.arange(E) % 7) * 0.5  # large negative with many ties
        logits[2, E - 1] = 15  # one dominant expert at the last index
    ids, w = cuda.moe_route(logits, k, norm)
    ref_ids, ref_w = ref_route(logits, k, norm)
    tag = f"cuda moe_route S={S} E={E} k={k} norm={norm}"
    np.testing.assert_array_equal(ids, ref_ids, err_msg=tag + " ids")
    assert_close(tag + " weights", w, ref_w, KC["small_fp32_rel_rms"])


@pytest.mark.parametrize("E,k", [(256, 8), (5, 3)])
def test_route_nonfinite_rows(cuda, rng, E, k):
    """A NaN residual upstream makes a router row NaN: every slot of such a row goes to expert 0 with a NaN weight (so
    the NaN reaches the output) instead of an id past E; a finite row beside them routes as the reference."""
    logits = (rng.standard_normal((3, E)) * 2).astype(np.float32)
    logits[0] = np.nan
    logits[1, E // 2] = np.nan
    ids, w = cuda.moe_route(logits, k, True)
    np.testing.assert_array_equal(ids[:2], np.zeros((2, k), np.int32))
    assert np.all(np.isnan(w[:2]))
    ref_ids, ref_w = ref_route(logits[2:], k, True)
    np.testing.assert_array_equal(ids[2:], ref_ids)
    assert_close(f"cuda moe_route finite row beside NaN rows E={E}", w[2:], ref_w, KC["small_fp32_rel_rms"])


# S, E, k, tile rows, skewed (~70% of picks on 4 experts: several tiles an expert, most experts empty): the routing
# sizes of a prefill (up to 16,384 pairs: several sort blocks of 2,048, a partial last one), E = 5 and E past the
# block's 256 threads (1,000)
SORTS = [(37, 256, 8, 64, False), (37, 256, 8, 16, True), (1, 256, 8, 64, False), (2048, 256, 8, 64, False),
         (2048, 256, 8, 16, True), (37, 5, 3, 16, False), (300, 5, 3, 64, True), (1, 5, 3, 16, False),
         (4096, 256, 8, 128, False), (16384, 256, 8, 64, True), (2049, 256, 8, 128, True), (300, 1000, 8, 16, False)]


@pytest.mark.parametrize("S,E,k,tile,skew", SORTS)
def test_sort(cuda, rng, S, E, k, tile, skew):
    """n_tiles = sum_e ceil(count_e / tile); each tile 1..tile rows inside [0, P), the tiles cover every sorted position
    once, a position's pair belongs to its tile's expert; pair_id a permutation of 0..P-1, pair_row = pair_id / k,
    pair_w bit-equal to top_w[pair_id]."""
    P = S * k
    idx = np.empty((S, k), np.int32)
    for s in range(S):  # k distinct experts a row, as routing gives
        if skew:
            hot = rng.permutation(min(E, 4))[:min(E, 4, k)]
            pick = [e for e in hot if rng.random() < 0.7]
            rest = rng.permutation(np.setdiff1d(np.arange(E), pick))[:k - len(pick)]
            idx[s] = rng.permutation(np.concatenate([pick, rest]).astype(np.int32))
        else:
            idx[s] = rng.permutation(E)[:k]
    w = rng.uniform(0, 1, (S, k)).astype(np.float32)
    r = cuda.moe_sort(idx, w, E, tile)
    counts = np.bincount(idx.ravel(), minlength=E)
    n = int(r["n_tiles"][0])
    tag = f"cuda moe_sort S={S} E={E} k={k} tile={tile}{' skew' if skew else ''}"
    assert n == int(np.sum(-(-counts // tile))), f"{tag}: {n} tiles"
    te, t0, tr = r["tile_expert"][:n], r["tile_row0"][:n], r["tile_rows"][:n]
    assert np.all((tr >= 1) & (tr <= tile) & (t0 >= 0) & (t0 + tr <= P) & (te >= 0) & (te < E)), f"{tag}: tile bounds"
    cover = np.zeros(P, int)
    expert_at = np.full(P, -1)
    for e, a, m in zip(te, t0, tr):
        cover[a:a + m] += 1
        expert_at[a:a + m] = e
    assert np.all(cover == 1), f"{tag}: the tiles do not cover every sorted position once"
    pid = r["pair_id"]
    np.testing.assert_array_equal(np.sort(pid), np.arange(P), err_msg=tag + " pair_id is not a permutation")
    np.testing.assert_array_equal(expert_at, idx.ravel()[pid], err_msg=tag + " a pair outside its expert's tiles")
    np.testing.assert_array_equal(r["pair_row"], pid // k, err_msg=tag + " pair_row")
    np.testing.assert_array_equal(r["pair_w"].view(np.uint32), w.ravel()[pid].view(np.uint32), err_msg=tag + " pair_w")


# S, H, k: hidden 2,048 top-8 (600 and 4,096 rows: more blocks of work than the grid), awkward H (not a multiple of 4:
# the scalar path) and k
@pytest.mark.parametrize("S,H,k", [(1, 2048, 8), (37, 2048, 8), (600, 2048, 8), (5, 96, 3), (7, 33, 1),
                                   (4096, 2048, 8)])
def test_combine(cuda, rng, S, H, k):
    """x += sigmoid(gate) sh + sum_j d[s k + j]: x read, modified, written (it starts random, and every term is
    non-zero, so an element the kernel skips stays off)."""
    sh = rng.standard_normal((S, H)).astype(np.float32)
    gate = rng.uniform(-8, 8, S).astype(np.float32)
    d = bits(rng.standard_normal((S * k, H)) * 0.3)  # bf16, as grouped_down leaves it
    x0 = rng.standard_normal((S, H)).astype(np.float32)
    ref = x0 + sigmoid(gate.astype(np.float64))[:, None] * sh + vals(d).astype(np.float64).reshape(S, k, H).sum(1)
    assert_close(f"cuda moe_combine S={S} H={H} k={k}", cuda.moe_combine(x0, sh, gate, d), ref,
                 KC["small_fp32_rel_rms"])


# E, k, H, I, bits (16: dense bf16), group: the real experts, an 8-bit set of groups of 32, tiny_odd's dense experts
@pytest.mark.parametrize("E,k,H,I,nbits,group", [(256, 8, 2048, 512, 4, 64), (5, 3, 128, 96, 8, 32),
                                                 (3, 3, 128, 96, 16, 0)])
def test_decode_experts(cuda, rng, E, k, H, I, nbits, group):
    """The unfused decode experts of one token (the engine's path where the fused decode does not fit): act[j] =
    bf16(silu(x W0[e_j]^T) * (x W1[e_j]^T)), d[j] = bf16(w_j (act_in[j] W2[e_j]^T)), with the GEMV's fp32 weights."""
    W0, W1 = (RawWeight(rng, nbits, I, H, experts=E, group=group, kind="gemv") for _ in range(2))
    W2 = RawWeight(rng, nbits, H, I, experts=E, group=group, kind="gemv")
    ids = rng.permutation(E)[:k].astype(np.int32)
    wts = rng.uniform(0, 1, k).astype(np.float32)
    x = bits(rng.standard_normal(H))
    act_in = bits(rng.standard_normal((k, I)))
    xf = vals(x).astype(np.float64)
    ref_act = np.stack([silu(W0.dense(e) @ xf) * (W1.dense(e) @ xf) for e in ids])
    ref_d = np.stack([wts[j] * (W2.dense(e) @ vals(act_in[j]).astype(np.float64)) for j, e in enumerate(ids)])
    tag = f"cuda decode experts E={E} k={k} H={H} I={I} bits={nbits}"
    assert_close(tag + " gate_up", vals(cuda.experts_gate_up(x, W0.t, W1.t, ids)), ref_act, KC["gemm_bf16_rel_rms"])
    assert_close(tag + " down", vals(cuda.experts_down(act_in, W2.t, ids, wts)), ref_d, KC["gemm_bf16_rel_rms"])

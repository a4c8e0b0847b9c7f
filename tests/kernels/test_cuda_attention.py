"""CUDA attention (csrc/cuda/attention*.cu) one launch at a time: the q/k prep (RMSNorm, partial RoPE, the bf16 KV
append), then attention over the bf16 cache: prefill on the tensor-core flash attention (Hopper's wgmma kernel and its
mma.sync twin on the same inputs), one row on the CUDA-core kernel or the tensor-core decode kernel, and the decode
step's form (position on the device, the split plan of the cache's capacity) over 1 to 8 query rows; real shapes (Hq 16, Hkv 2, D 256, up to
128K keys) and awkward ones (odd GQA groups, D 32 / 64 / 128, contexts off every tile).

prep: q fp32 against lily.reference's rms_norm + rope (small_fp32_rel_rms 1e-5); the k cache bf16 (one rounding:
rel RMS 2^-8, per element); the v cache bf16(v) exactly; every other cache row untouched (bit for bit).
attention: against softmax(q K^T / sqrt(D)) V * sigmoid(gate) in fp64 on the operands the kernels read (the bf16
cache, q rounded to bf16 as the mma kernels round it), on sampled rows: attention_rel_rms 5e-3 (o rounded to bf16,
~1.1e-3; P rounded to bf16 before P V, ~1e-3; one key wrongly in or out of the causal window moves o by >= 8e-3 up to
16K keys). Cache rows past the window are NaN, so a kernel that reads an unmasked key there fails."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from cuda_checks import KC, assert_bf16_close, bits, vals

from lily.quant import round_bf16
from lily.reference.ops import rms_norm, rope

THETA = 1e7
NAN_BF16 = 0xFFFF


# Hq, Hkv, D, rotary, S, pos0, dpos: real prefill / decode / long position / the device's position; odd heads, D,
# rotary dims (the whole head; not a multiple of 64)
@pytest.mark.parametrize("Hq,Hkv,D,rd,S,pos0,dpos", [
    (16, 2, 256, 64, 1, 0, False), (16, 2, 256, 64, 37, 1000, False), (16, 2, 256, 64, 300, 0, False),
    (16, 2, 256, 64, 1, 200000, False), (16, 2, 256, 64, 1, 4095, True), (5, 1, 64, 32, 37, 7, False),
    (3, 3, 96, 96, 2, 11, False), (6, 2, 80, 20, 5, 33, False), (2, 1, 256, 256, 3, 5, False)])
def test_prep(cuda, rng, Hq, Hkv, D, rd, S, pos0, dpos):
    kvr, cap = Hkv * D, pos0 + S + 3
    qg = (rng.standard_normal((S, Hq * 2 * D)) * 2).astype(np.float32)
    k = (rng.standard_normal((S, kvr)) * 2).astype(np.float32)
    v = rng.standard_normal((S, kvr)).astype(np.float32)
    qn, kn = rng.uniform(0.5, 1.5, (2, D)).astype(np.float32)
    cache = np.full((cap, kvr), NAN_BF16, np.uint16)  # every row poisoned: only rows pos0 .. pos0+S-1 may change
    q, kc, vc = cuda.attention_prep(qg, k, v, qn, kn, cache, cache, pos0, Hq, Hkv, D, rd, THETA, 1e-6, dpos=dpos)
    pos = np.arange(pos0, pos0 + S)
    ref_q = rope(rms_norm(qg.reshape(S, Hq, 2 * D)[..., :D], qn, 1e-6), pos, rd, THETA)
    ref_k = rope(rms_norm(k.reshape(S, Hkv, D), kn, 1e-6), pos, rd, THETA)
    tag = f"cuda attention_prep Hq={Hq} Hkv={Hkv} D={D} rd={rd} S={S} pos0={pos0}{' dpos' if dpos else ''}"
    assert_close(tag + " q", q, ref_q.reshape(S, -1), KC["small_fp32_rel_rms"])
    assert_bf16_close(tag + " k cache", kc[pos0:pos0 + S], ref_k.reshape(S, -1))
    np.testing.assert_array_equal(vc[pos0:pos0 + S], bits(v), err_msg=tag + " v cache")
    for c in (kc, vc):
        changed = np.count_nonzero(c[:pos0] != NAN_BF16) + np.count_nonzero(c[pos0 + S:] != NAN_BF16)
        assert changed == 0, f"{tag}: {changed} cache entries outside the new rows changed"


def _inputs(rng, S, Hq, Hkv, D, pos0, slack=37):
    """q fp32 [S, Hq*D] in +-4, qg [S, Hq*2D] in +-3, caches bf16 [pos0 + S + slack, Hkv*D]: k in +-sqrt(3), v in +-1
    (scores ~ N(0, 2.3): softmax neither flat nor one-hot), rows past pos0 + S NaN."""
    T, cap = pos0 + S, pos0 + S + slack

    def uniform(shape, amp):  # float32 draws: the 128K-key caches hold 67M values each
        return (rng.random(shape, dtype=np.float32) * 2 - 1) * np.float32(amp)

    q, qg = uniform((S, Hq * D), 4), uniform((S, Hq * 2 * D), 3)
    kc, vc = np.full((cap, Hkv * D), NAN_BF16, np.uint16), np.full((cap, Hkv * D), NAN_BF16, np.uint16)
    kc[:T], vc[:T] = bits(uniform((T, Hkv * D), np.sqrt(3))), bits(uniform((T, Hkv * D), 1))
    return q, qg, kc, vc


def _reference(q, qg, kc, vc, rows, Hq, Hkv, D, pos0):
    """o fp64 [len(rows), Hq*D] of the given rows: row t attends to keys 0 .. pos0 + t (a causal mask over the
    scores of a block of rows at a time)."""
    rows = np.asarray(rows)
    G, T = Hq // Hkv, pos0 + int(rows.max()) + 1
    qb = round_bf16(q[rows]).astype(np.float64).reshape(len(rows), Hq, D)
    out = np.empty((len(rows), Hq, D))
    step = max(1, (1 << 24) // (G * T))  # rows a block: scores of at most 16M entries
    for g in range(Hkv):
        K = vals(kc[:T, g * D:(g + 1) * D]).astype(np.float64)
        V = vals(vc[:T, g * D:(g + 1) * D]).astype(np.float64)
        for r0 in range(0, len(rows), step):
            r = slice(r0, r0 + step)
            n = len(rows[r])
            s = qb[r, g * G:(g + 1) * G].reshape(n * G, D) @ K.T / np.sqrt(D)  # [rows * G, T]
            s[np.arange(T)[None, :] > pos0 + np.repeat(rows[r], G)[:, None]] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            out[r, g * G:(g + 1) * G] = ((p / p.sum(-1, keepdims=True)) @ V).reshape(n, G, D)
    gate = qg.reshape(len(q), Hq, 2 * D)[rows, :, D:].astype(np.float64)
    return (out / (1 + np.exp(-gate))).reshape(len(rows), -1)


def _rows(rng, S, sample):
    """All rows, or the ends, the tile edges and random ones up to `sample`."""
    if sample == 0 or sample >= S:
        return np.arange(S)
    rows = {t for t in (0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, S // 2, S - 2, S - 1) if 0 <= t < S}
    while len(rows) < sample:
        rows.add(int(rng.integers(0, S)))
    return np.array(sorted(rows))


# name, D, Hq, Hkv, S, pos0, tc_decode, rows checked (0: all). Real shapes on sampled rows (the reference of a 128K
# row is ~1 GFLOP per KV head); one row on the CUDA-core kernel; the tensor-core decode kernel (shapes it does not take
# fall back to the CUDA-core kernel); prefill at odd sizes and the split path (a short chunk at a long position).
CASES = [
    ("real_S2048_pos0", 256, 16, 2, 2048, 0, False, 64), ("real_S4096_pos0", 256, 16, 2, 4096, 0, False, 24),
    ("real_S2048_pos14336", 256, 16, 2, 2048, 14336, False, 24),
    ("real_S2048_pos129024", 256, 16, 2, 2048, 129024, False, 8),
    ("real_S5_pos129024_split", 256, 16, 2, 5, 129024, False, 0),
    ("real_S64_pos4000_split", 256, 16, 2, 64, 4000, False, 0),
    ("S1_pos0", 256, 16, 2, 1, 0, False, 0), ("S1_pos777", 256, 16, 2, 1, 777, False, 0),
    ("S1_pos131071", 256, 16, 2, 1, 131071, False, 0), ("S1_pos33_D64", 64, 6, 2, 1, 33, False, 0),
    ("tc_S1_pos0", 256, 16, 2, 1, 0, True, 0), ("tc_S1_pos63", 256, 16, 2, 1, 63, True, 0),
    ("tc_S1_pos64", 256, 16, 2, 1, 64, True, 0), ("tc_S1_pos777", 256, 16, 2, 1, 777, True, 0),
    ("tc_S1_pos4100", 256, 16, 2, 1, 4100, True, 0), ("tc_S1_pos131071", 256, 16, 2, 1, 131071, True, 0),
    ("tc_D128_S1_pos1000", 128, 16, 2, 1, 1000, True, 0), ("tc_D256_Hkv1_S1_pos5000", 256, 8, 1, 1, 5000, True, 0),
    ("tc_fallback_D64_G3_S1_pos40", 64, 6, 2, 1, 40, True, 0),
    ("S2_pos0", 256, 16, 2, 2, 0, False, 0), ("S37_pos0", 256, 16, 2, 37, 0, False, 0),
    ("S300_pos129", 256, 16, 2, 300, 129, False, 0), ("S17_pos3000_split", 256, 16, 2, 17, 3000, False, 0),
    ("D256_G1_S77", 256, 2, 2, 77, 0, False, 0), ("D256_G8_S333_pos5000", 256, 8, 1, 333, 5000, False, 0),
    ("D128_G1_S129_pos64", 128, 8, 8, 129, 64, False, 0), ("D128_G1_S1000", 128, 4, 4, 1000, 0, False, 0),
    ("D128_G8_S200", 128, 16, 2, 200, 0, False, 0), ("D64_G2_S300_pos1000", 64, 4, 2, 300, 1000, False, 0),
    ("D64_G2_S65_pos31", 64, 2, 1, 65, 31, False, 0), ("D64_G3_S101_pos17", 64, 6, 2, 101, 17, False, 0),
    ("D128_G5_S70_pos200", 128, 10, 2, 70, 200, False, 0), ("D32_G4_S50_pos10", 32, 4, 1, 50, 10, False, 0)]


@pytest.mark.parametrize("name,D,Hq,Hkv,S,pos0,tc,sample", CASES, ids=[c[0] for c in CASES])
def test_attention(cuda, rng, name, D, Hq, Hkv, S, pos0, tc, sample):
    q, qg, kc, vc = _inputs(rng, S, Hq, Hkv, D, pos0)
    rows = _rows(rng, S, sample)
    ref = _reference(q, qg, kc, vc, rows, Hq, Hkv, D, pos0)
    # prefill chunks with a wgmma kernel here: it and the mma.sync twin on the same inputs
    both = S > 1 and cuda.attention_wgmma_supported(S, Hq, Hkv, D)
    for wgmma in (True, False) if both else (True,):
        o = vals(cuda.attention(q, qg, kc, vc, pos0, Hq, Hkv, D, tc_decode=tc, wgmma=wgmma))
        impl = "tc_decode" if tc else "cuda_cores" if S == 1 else "wgmma" if both and wgmma else "mma"
        splits = cuda.attention_splits(S, pos0, Hq, Hkv, D)
        tag = f"cuda attention {name} impl={impl} splits={splits} rows={len(rows)}"
        assert np.all(np.isfinite(o)), f"{tag}: unwritten (NaN) outputs or a NaN key read"
        assert_close(tag, o[rows], ref, KC["attention_rel_rms"])


# The decode step's launches (decode_layers.cu): the position read from the device (the launch's pos0 is 0) and the
# split plan of the cache's capacity (a step is recorded once per capacity); the tensor-core kernel (8 query heads per
# KV head) and the CUDA-core one (other groups). D, Hq, Hkv, position, capacity.
@pytest.mark.parametrize("D,Hq,Hkv,pos0,cap,tc", [(256, 16, 2, 777, 4096, True), (256, 16, 2, 4095, 4096, True),
                                                   (128, 16, 2, 1000, 2048, True), (256, 8, 1, 0, 300, True),
                                                   (64, 6, 2, 40, 512, False), (256, 16, 2, 130, 1024, False)])
def test_attention_decode_step(cuda, rng, D, Hq, Hkv, pos0, cap, tc):
    q, qg, kc, vc = _inputs(rng, 1, Hq, Hkv, D, pos0, slack=cap - pos0 - 1)
    o = vals(cuda.attention(q, qg, kc, vc, pos0, Hq, Hkv, D, plan_pos0=cap - 1, tc_decode=tc, dpos=True))
    splits = cuda.attention_splits(1, pos0, Hq, Hkv, D, plan_pos0=cap - 1)
    tag = f"cuda attention decode step D={D} Hq={Hq} Hkv={Hkv} pos={pos0} cap={cap} tc={tc} splits={splits}"
    assert np.all(np.isfinite(o)), f"{tag}: unwritten (NaN) outputs or a NaN key read"
    assert_close(tag, o, _reference(q, qg, kc, vc, [0], Hq, Hkv, D, pos0), KC["attention_rel_rms"])



# M query rows of the decode step (issue 43: a speculative verify's rows, streams decoded together) at positions pos0 ..
# pos0 + M - 1 on the tensor-core kernel, each with its own key count and split length: rows across a tile edge (60 ..
# 67), a split length that grows inside the rows, the first positions, D 128. M, pos0, capacity, D.
@pytest.mark.parametrize("M,pos0,cap,D", [(2, 63, 1024, 256), (8, 60, 300, 256), (5, 777, 4096, 256),
                                          (8, 4088, 8192, 256), (3, 0, 64, 256), (4, 1000, 2048, 128)])
def test_attention_decode_rows(cuda, rng, M, pos0, cap, D):
    """Row t attends to keys 0 .. pos0 + t (against fp64), and equals the one-row decode launch at its position bit
    for bit."""
    Hq, Hkv = 16, 2
    q, qg, kc, vc = _inputs(rng, M, Hq, Hkv, D, pos0, slack=cap - pos0 - M)
    o = cuda.attention(q, qg, kc, vc, pos0, Hq, Hkv, D, plan_pos0=cap - 1, tc_decode=True, dpos=True)
    tag = f"cuda attention decode rows M={M} pos={pos0} cap={cap} D={D}"
    assert np.all(np.isfinite(vals(o))), f"{tag}: unwritten (NaN) outputs or a NaN key read"
    assert_close(tag, vals(o), _reference(q, qg, kc, vc, np.arange(M), Hq, Hkv, D, pos0), KC["attention_rel_rms"])
    for t in range(M):
        one = cuda.attention(q[t:t + 1], qg[t:t + 1], kc, vc, pos0 + t, Hq, Hkv, D, plan_pos0=cap - 1, tc_decode=True,
                             dpos=True)
        bad = np.flatnonzero(np.asarray(o[t:t + 1]).view(np.uint16) != np.asarray(one).view(np.uint16))
        assert bad.size == 0, f"{tag}: row {t} differs from its one-row launch in {bad.size} of {one.size} elements"

def test_attention_prep_then_attention_equals_the_decode_step(cuda, rng):
    """The decode step's pair on one cache: prep at the device's position appends row pos0, then attention over the
    capacity's plan reads it; the same as prep and attention given pos0 on the host (the prefill sub-block's form)."""
    Hq, Hkv, D, rd, pos0, cap = 16, 2, 256, 64, 500, 1024
    qg = rng.standard_normal((1, Hq * 2 * D)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, Hkv * D)).astype(np.float32)
    qn, kn = rng.uniform(0.5, 1.5, (2, D)).astype(np.float32)
    cache = np.zeros((cap, Hkv * D), np.uint16)
    cache[:pos0] = bits(rng.uniform(-1, 1, (pos0, Hkv * D)))
    outs = []
    for dpos in (True, False):
        q, kc, vc = cuda.attention_prep(qg, k, v, qn, kn, cache, cache, pos0, Hq, Hkv, D, rd, THETA, 1e-6, dpos=dpos)
        outs.append(vals(cuda.attention(q, qg, kc, vc, pos0, Hq, Hkv, D, plan_pos0=cap - 1 if dpos else -1,
                                        tc_decode=dpos, dpos=dpos)))
    assert_close("cuda decode step attention vs the host-position launches", outs[0], outs[1],
                 KC["attention_rel_rms"])

"""Linear family: y = x W^T on every backend against x @ dequantize(W).T, for every weight format, on awkward
shapes (one row, odd row counts, tails); then the Metal kernels one by one: metal/gemv.metal (decode GEMV) and
metal/gemm.metal (prefill GEMM on simdgroup matrices: accumulate, GLU, grouped experts over the block map)."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from kernel_inputs import Weight, block_map, rel_tol
from ops_metal import gemm, gemv
from lily.testing.tolerances import tol

TOL = tol("op_vs_reference")["rel_rms"]


@pytest.mark.parametrize("S", [1, 2, 63, 64, 65])
@pytest.mark.parametrize("fmt,group", [("q4", 32), ("q4", 64), ("q8", 64), ("bf16", 0), ("f32", 0)])
def test_linear(backend, rng, fmt, group, S):
    # 37 outputs: no multiple of any row tile; 192 inputs: three groups of 64, six of 32
    w = Weight(rng, 37, 192, fmt, group or 64)
    x = rng.standard_normal((S, 192)).astype(np.float32)
    assert_close(f"{backend.NAME} linear_{fmt} g{group} 37x192 S={S}", backend.linear(w, x),
                 x.astype(np.float64) @ w.dense.T, rel_tol(backend, "linear"))


# ---- Metal: the GEMV and the GEMM kernels one by one, with their epilogues and tile rows ----


@pytest.mark.parametrize("fmt,out,inp,group,S", [
    ("q4", 130, 256, 64, 1), ("q4", 7, 128, 32, 3), ("q8", 33, 192, 64, 1),
    ("bf16", 21, 96, 0, 2), ("f32", 9, 160, 0, 1)])
def test_gemv(rng, fmt, out, inp, group, S):
    w = Weight(rng, out, inp, fmt, group or 64)
    x = rng.standard_normal((S, inp)).astype(np.float32)
    assert_close(f"gemv_{fmt} {out}x{inp} S={S}", gemv(w, x), x.astype(np.float64) @ w.dense.T, TOL)


def test_gemv_accumulate(rng):
    w = Weight(rng, 40, 128, "q4")
    x = rng.standard_normal((1, 128)).astype(np.float32)
    y0 = rng.standard_normal((1, 40)).astype(np.float32)
    assert_close("gemv_q4 accumulate", gemv(w, x, y0), y0 + x.astype(np.float64) @ w.dense.T, TOL)


@pytest.mark.parametrize("fmt,t,bm,M,out,inp", [
    ("q4", "f32", 32, 37, 70, 128), ("q4", "f32", 16, 1, 33, 64), ("q8", "f32", 32, 5, 40, 192),
    ("bf16", "f32", 32, 9, 24, 96), ("bf16", "f32", 16, 17, 8, 160), ("f32", "f32", 32, 3, 5, 40),
    ("q4", "f16", 32, 40, 64, 256)])
def test_gemm_plain(rng, fmt, t, bm, M, out, inp):
    w = Weight(rng, out, inp, fmt)
    a = rng.standard_normal((M, inp)).astype(np.float32)
    got = gemm(w, a, t=t, bm=bm)
    assert_close(f"gemm_{fmt}_{t}_bm{bm} M={M} {out}x{inp}", got, a.astype(np.float64) @ w.dense.T,
                 TOL if t == "f32" else tol("op_vs_reference", "f16_tiles")["rel_rms"])


def test_gemm_accumulate(rng):
    w = Weight(rng, 40, 128, "q4")
    a = rng.standard_normal((9, 128)).astype(np.float32)
    y0 = rng.standard_normal((9, 40)).astype(np.float32)
    assert_close("gemm_q4 accumulate", gemm(w, a, y0=y0), y0 + a.astype(np.float64) @ w.dense.T, TOL)


@pytest.mark.parametrize("fmt,t", [("q4", "f32"), ("bf16", "f32"), ("q4", "f16")])
def test_gemm_glu(rng, fmt, t):
    g, u = Weight(rng, 48, 128, fmt), Weight(rng, 48, 128, fmt)
    a = rng.standard_normal((13, 128)).astype(np.float64).astype(np.float32)
    gd, ud = a.astype(np.float64) @ g.dense.T, a.astype(np.float64) @ u.dense.T
    assert_close(f"gemm_glu_{fmt}_{t}", gemm(g, a, t=t, up=u), gd / (1 + np.exp(-gd)) * ud,
                 TOL if t == "f32" else tol("op_vs_reference", "f16_tiles")["rel_rms"])


@pytest.mark.parametrize("bm", [16, 32])
def test_gemm_grouped_experts(rng, bm):
    # 5 experts: one empty, one with a single row, one with more than a tile of rows
    E, S, inp, out = 5, 23, 128, 40
    counts = [0, 1, 2 * bm + 3, 4, 7]
    M = sum(counts)
    w = Weight(rng, out, inp, "q4", experts=E)
    a = rng.standard_normal((S, inp)).astype(np.float32)
    row_index = rng.integers(0, S, M).astype(np.int32)
    expert_of_pair = np.repeat(np.arange(E), counts)
    bmap = block_map(counts, bm, max_tiles=M // bm + E + 2)
    got = gemm(w, a, bm=bm, block_map=bmap, row_index=row_index, M=M)
    ref = np.stack([w.dense[expert_of_pair[p]] @ a[row_index[p]] for p in range(M)])
    assert_close(f"gemm_q4 grouped bm{bm} (gather)", got, ref, TOL)
    # down-projection form: A already in pair order, GLU variant for gate/up
    u = Weight(rng, out, inp, "q4", experts=E)
    act = rng.standard_normal((M, inp)).astype(np.float32)
    got = gemm(w, act, bm=bm, up=u, block_map=bmap, M=M)
    g = np.stack([w.dense[expert_of_pair[p]] @ act[p] for p in range(M)])
    up = np.stack([u.dense[expert_of_pair[p]] @ act[p] for p in range(M)])
    assert_close(f"gemm_glu_q4 grouped bm{bm} (pair order)", got, g / (1 + np.exp(-g)) * up, TOL)

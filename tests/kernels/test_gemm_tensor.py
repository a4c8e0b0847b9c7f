"""Metal only (no twin on the other backends): metal/gemm_tensor.metal, the Metal 4 tensor-op prefill GEMM (MetalPerformancePrimitives matmul2d on
half / bfloat threadgroup tiles, fp32 cooperative accumulator), run in the emulator through the shim's
matmul2d (tools/msl/include/MetalPerformancePrimitives) against x @ dequantize(W).T: plain, accumulate, GLU,
grouped experts over the block map (gather and pair order), awkward shapes, three schedules per dispatch.
Plus: the file compiles to nothing under a Metal 3 compiler, the emulated half-tile result equals the
simdgroup-matrix path's half-tile result bit for bit (same roundings, same k order), and the shim rejects
misuse of the tensor API that Apple's compiler would reject."""
from __future__ import annotations

import os

import numpy as np
from lily.testing.tolerances import tol
import pytest
from lily.testing.metrics import assert_close
from kernel_inputs import Weight, block_map
from metal_env import METAL_DIR, mslc
from ops_metal import gemm

PATH = os.path.join(METAL_DIR, "gemm_tensor.metal")
TOL = {"f16": tol("op_vs_reference", "f16_tiles")["rel_rms"], "bf16": tol("op_vs_reference", "bf16_tiles")["rel_rms"]}


@pytest.mark.parametrize("fmt,t,bm,M,out,inp", [
    ("q4", "f16", 32, 37, 70, 128), ("q4", "f16", 16, 1, 33, 64), ("q8", "f16", 32, 5, 40, 192),
    ("q8", "f16", 16, 19, 31, 64), ("bf16", "f16", 16, 17, 8, 160), ("bf16", "f16", 32, 33, 65, 96),
    ("q4", "bf16", 32, 40, 64, 256)])
def test_gemm_tensor_plain(rng, fmt, t, bm, M, out, inp):
    w = Weight(rng, out, inp, fmt)
    a = rng.standard_normal((M, inp)).astype(np.float32)
    got = gemm(w, a, t=t, bm=bm, tensor=True)
    assert_close(f"gemm_tensor_{fmt}_{t}_bm{bm} M={M} {out}x{inp}", got, a.astype(np.float64) @ w.dense.T, TOL[t])


def test_gemm_tensor_accumulate(rng):
    w = Weight(rng, 40, 128, "q4")
    a = rng.standard_normal((9, 128)).astype(np.float32)
    y0 = rng.standard_normal((9, 40)).astype(np.float32)
    assert_close("gemm_tensor_q4 accumulate", gemm(w, a, t="f16", y0=y0, tensor=True),
                 y0 + a.astype(np.float64) @ w.dense.T, TOL["f16"])


@pytest.mark.parametrize("fmt,t,bm", [("q4", "f16", 32), ("bf16", "f16", 16), ("q4", "bf16", 32)])
def test_gemm_tensor_glu(rng, fmt, t, bm):
    g, u = Weight(rng, 48, 128, fmt), Weight(rng, 48, 128, fmt)
    a = rng.standard_normal((13, 128)).astype(np.float32)
    gd, ud = a.astype(np.float64) @ g.dense.T, a.astype(np.float64) @ u.dense.T
    assert_close(f"gemm_tensor_glu_{fmt}_{t}_bm{bm}", gemm(g, a, t=t, bm=bm, up=u, tensor=True),
                 gd / (1 + np.exp(-gd)) * ud, TOL[t])


@pytest.mark.parametrize("bm", [16, 32])
def test_gemm_tensor_grouped_experts(rng, bm):
    # 5 experts: one empty, one with a single row, one with more than a tile of rows
    E, S, inp, out = 5, 23, 128, 40
    counts = [0, 1, 2 * bm + 3, 4, 7]
    M = sum(counts)
    w = Weight(rng, out, inp, "q4", experts=E)
    a = rng.standard_normal((S, inp)).astype(np.float32)
    row_index = rng.integers(0, S, M).astype(np.int32)
    expert_of_pair = np.repeat(np.arange(E), counts)
    bmap = block_map(counts, bm, max_tiles=M // bm + E + 2)
    got = gemm(w, a, t="f16", bm=bm, block_map=bmap, row_index=row_index, M=M, tensor=True)
    ref = np.stack([w.dense[expert_of_pair[p]] @ a[row_index[p]] for p in range(M)])
    assert_close(f"gemm_tensor_q4 grouped bm{bm} (gather)", got, ref, TOL["f16"])
    u = Weight(rng, out, inp, "q4", experts=E)
    act = rng.standard_normal((M, inp)).astype(np.float32)
    got = gemm(w, act, t="f16", bm=bm, up=u, block_map=bmap, M=M, tensor=True)
    g = np.stack([w.dense[expert_of_pair[p]] @ act[p] for p in range(M)])
    up = np.stack([u.dense[expert_of_pair[p]] @ act[p] for p in range(M)])
    assert_close(f"gemm_tensor_glu_q4 grouped bm{bm} (pair order)", got, g / (1 + np.exp(-g)) * up, TOL["f16"])


def test_tensor_path_equals_simdgroup_half_path_in_emulation(rng):
    """Both paths round A and W to half and accumulate in fp32 in k order in the emulator, so they agree
    bit for bit there: the tensor-op kernel adds no error of its own beyond the tile rounding. (On Apple
    hardware the two summation orders differ; this pins the kernel logic, not the hardware.)"""
    w = Weight(rng, 64, 256, "q4")
    a = rng.standard_normal((40, 256)).astype(np.float32)
    np.testing.assert_array_equal(gemm(w, a, t="f16", bm=32, tensor=True), gemm(w, a, t="f16", bm=32))


def test_compiles_to_nothing_without_metal4():
    """A Metal 3 compiler (no __HAVE_TENSOR__, no <metal_tensor>) sees an empty file: metal.cmake can build it
    with any SDK, and older machines keep the simdgroup path."""
    rc, out = mslc.check(PATH, metal3=True)
    assert rc == 0, out
    text = mslc.generate(PATH, "check")[0]
    assert "#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400 && defined(__HAVE_TENSOR__)" in text


_MISUSE = {  # the shim must reject what Apple's compiler rejects (the check layer's teeth for this API)
    "unguarded tensor header under Metal 3": (
        "#include <metal_stdlib>\n#include <metal_tensor>\nkernel void k(device float* y [[buffer(0)]]) { y[0] = 0.0f; }\n",
        True, "needs Metal 4"),
    "unsupported element types (half x half -> bfloat)": (
        "MM_PRELUDE auto c = mm.get_destination_cooperative_tensor<tile_t, tile_t, bfloat>(); mm.run(ta, tb, c); }\n",
        False, "element-type combination"),
    "destination of another op": (
        "MM_PRELUDE mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(16, 32, 32), execution_simdgroups<4>> o;\n"
        "auto c = o.get_destination_cooperative_tensor<tile_t, tile_t, float>(); mm.run(ta, tb, c); }\n",
        False, "get_destination_cooperative_tensor"),
}
_PRELUDE = ("#include <metal_stdlib>\n#include <metal_tensor>\n#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>\n"
            "using namespace metal;\n"
            "kernel void k(uint tid [[thread_index_in_threadgroup]]) {\n"
            "threadgroup half tg_a[32 * 32];\nthreadgroup half tg_b[32 * 32];\n"
            "typedef tensor<threadgroup half, dextents<int32_t, 2>, tensor_inline> tile_t;\n"
            "tile_t ta(tg_a, dextents<int32_t, 2>(32, 32)); tile_t tb(tg_b, dextents<int32_t, 2>(32, 32));\n"
            "mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(32, 32, 32, false, true), "
            "execution_simdgroups<4>> mm;\n")


@pytest.mark.parametrize("case", list(_MISUSE))
def test_shim_rejects_tensor_api_misuse(case, tmp_path):
    src, metal3, msg = _MISUSE[case]
    p = tmp_path / "misuse.metal"
    p.write_text(src.replace("MM_PRELUDE ", _PRELUDE))
    rc, out = mslc.check(str(p), metal3=metal3)
    assert rc != 0 and msg in out, out


def test_shim_accepts_the_correct_snippet(tmp_path):
    p = tmp_path / "ok.metal"
    p.write_text(_PRELUDE + "auto c = mm.get_destination_cooperative_tensor<tile_t, tile_t, float>(); mm.run(ta, tb, c); }\n")
    rc, out = mslc.check(str(p))
    assert rc == 0, out

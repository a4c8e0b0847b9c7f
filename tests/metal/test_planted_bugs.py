"""The checks can fail: known bugs are planted, one at a time, in copies of real lily kernels, and the layer
meant to catch each one must report it (lint, g++ shim check, clang address-space check, or the emulator
run against the reference in three schedules). An unmodified copy must pass every layer."""
from __future__ import annotations

import os
import shutil

import sys

import numpy as np
import pytest
from metal_env import METAL_DIR, OVERRIDE, emu, mslc

# the per-kernel runs against the reference are the kernel suite's Metal cases (tests/kernels)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
import test_attention as t_attn  # noqa: E402
import test_deltanet as t_dn  # noqa: E402
import test_gemm_tensor as t_gt  # noqa: E402
import test_linear as t_lin  # noqa: E402
import test_moe as t_moe  # noqa: E402
import test_norm as t_norm  # noqa: E402


def _rng():
    return np.random.default_rng(1234)


VERDICTS = {  # family -> a run of that family's kernels against the reference (raises on a mismatch)
    "gemv": lambda: t_lin.test_gemv(_rng(), "q4", 130, 256, 64, 1),
    "gemm": lambda: t_lin.test_gemm_plain(_rng(), "q4", "f32", 32, 37, 70, 128),
    "gemm_tensor": lambda: t_gt.test_gemm_tensor_plain(_rng(), "q4", "f16", 32, 37, 70, 128),
    "norm": lambda: t_norm.test_rms_norm(_rng(), 3, 192, 128),
    "moe": lambda: t_moe.test_route(_rng(), 37, 8, 2, 32),
    "deltanet": lambda: t_dn.test_conv(_rng(), 2, 4, 2, 6, 48, 32),
    "attention": lambda: t_attn.test_prep(_rng(), 3, 4, 2, 64, 9, "f32"),
}

# name -> (family, file edited, [(old, new)], layer that must catch it)
CASES = {
    "unmodified copy": ("gemv", "gemv.metal", [], None),
    "missing barrier before threadgroup tile reuse": (
        "gemm", "gemm.metal",
        [("        threadgroup_barrier(mem_flags::mem_threadgroup);\n    }\n    for (uint i = 0; i < RT; i++) {",
          "    }\n    for (uint i = 0; i < RT; i++) {")], "run"),
    "missing barrier after threadgroup tile load": (
        "gemm", "gemm.metal",
        [("        if (GLU) load_w_tile<WF, T>(tg_w2, r2, n0, k0, la, tid);\n        threadgroup_barrier(mem_flags::mem_threadgroup);",
          "        if (GLU) load_w_tile<WF, T>(tg_w2, r2, n0, k0, la, tid);")], "run"),
    "tensor op reads the tiles before the barrier": (
        "gemm_tensor", "gemm_tensor.metal",
        [("        threadgroup_barrier(mem_flags::mem_threadgroup);   // tiles written by all simdgroups, read by the op\n", "")],
        "run"),
    "tiles reloaded before the tensor op has read them": (
        "gemm_tensor", "gemm_tensor.metal",
        [("        threadgroup_barrier(mem_flags::mem_threadgroup);   // the op has read the tiles before they are reused\n",
          "")], "run"),
    "tensor op scope is not the threadgroup's simdgroups": (
        "gemm_tensor", "gemm_tensor.metal",
        [("constant constexpr int TENSOR_SIMDGROUPS = 4;", "constant constexpr int TENSOR_SIMDGROUPS = 2;")], "run"),
    "threadgroup tile viewed as a device tensor": (
        "gemm_tensor", "gemm_tensor.metal",
        [("typedef tensor<threadgroup T, dextents<int32_t, 2>, tensor_inline> tile_t;",
          "typedef tensor<device T, dextents<int32_t, 2>, tensor_inline> tile_t;")], "check-as"),
    "missing barrier before a cross-simdgroup sum": (
        "norm", "norm.metal",
        [("    if (lane == 0) tg_part[sg] = ss;\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
          "    if (lane == 0) tg_part[sg] = ss;")], "run"),
    "barrier inside a lane-dependent branch": (
        "norm", "norm.metal",
        [("    if (lane == 0) tg_part[sg] = ss;\n    threadgroup_barrier(mem_flags::mem_threadgroup);",
          "    if (lane == 0) tg_part[sg] = ss;\n    if (tid < 32) threadgroup_barrier(mem_flags::mem_threadgroup);")], "run"),
    "simd_sum in a divergent branch": (
        "gemv", "gemv.metal",
        [("const float v = simd_sum(acc[i]);", "const float v = lane < 16 ? simd_sum(acc[i]) : acc[i];")], "run"),
    "collective after an early exit of some lanes": (
        "moe", "moe.metal",
        [("    const uint E = uint(ra.n_experts), k = uint(ra.top_k);\n    float p[MAXJ];",
          "    const uint E = uint(ra.n_experts), k = uint(ra.top_k);\n    if (lane >= E) return;\n    float p[MAXJ];")],
        "run"),
    "out-of-bounds read past a weight row": (
        "gemv", "gemv.metal", [("for (uint c = lane; c < nchunks; c += 32)", "for (uint c = lane; c <= nchunks; c += 32)")],
        "run"),
    "out-of-bounds conv state update": (
        "deltanet", "deltanet.metal", [("for (uint r = 0; r + 1 < K; r++)", "for (uint r = 0; r < K; r++)")], "run"),
    "wrong RoPE pairing (logic)": (
        "attention", "attention.metal",
        [("pd = d < half_rd ? d + half_rd : d - half_rd;", "pd = d ^ 1u;")], "run"),
    "threadgroup pointer passed as device": (
        "norm", "norm.metal",
        [("// y[s, :] = x[s, :] * rsqrt", "inline void put(device float* p, uint i, float v) { p[i] = v; }\n// y[s, :] = x[s, :] * rsqrt"),
         ("    if (lane == 0) tg_part[sg] = ss;", "    if (lane == 0) put(tg_part, sg, ss);")], "check-as"),
    "implicit half4 -> float4 conversion": (
        "gemv", "common.h",
        [("const float4 v = *(device const float4*)(x + c * VPC + i);",
          "const float4 v = *(device const half4*)(x + c * VPC + i);")], "check"),
    "write through a const buffer": (
        "norm", "norm.metal", [("    for (uint i = tid; i < H; i += nt) x[ulong(s) * H + i]",
                                "    ((device const float*)x)[0] = 0.0f;\n    for (uint i = tid; i < H; i += nt) x[ulong(s) * H + i]")],
        "check"),
    "pointer argument without address space": (
        "gemv", "gemv.metal",
        [("device const float*          x   [[buffer(3)]]", "const float*          x   [[buffer(3)]]")], "lint"),
    "duplicate buffer index": ("gemv", "gemv.metal", [("[[buffer(6)]]", "[[buffer(5)]]")], "lint"),
    "double precision arithmetic": (
        "norm", "norm.metal", [("const float inv = 1.0f / sqrt(tot / float(n) + na.eps);",
                                "const float inv = float(1.0 / double(tot / float(n) + na.eps));")], "lint"),
}


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if "error" in line.lower():
            return line.strip()[:160]
    return text.strip().splitlines()[0][:160] if text.strip() else ""


def run_layers(name: str, tmp: str) -> dict[str, tuple[bool, str]]:
    """Plants case `name` in a copy under tmp; -> layer -> (caught, first line of the report)."""
    family, fname, edits, _ = CASES[name]
    os.makedirs(tmp, exist_ok=True)
    shutil.copy(os.path.join(METAL_DIR, family + ".metal"), tmp)
    if fname != family + ".metal":
        shutil.copy(os.path.join(METAL_DIR, fname), tmp)
    target = os.path.join(tmp, fname)
    src = open(target).read()
    for old, new in edits:
        assert old in src, (name, old)
        src = src.replace(old, new, 1)
    open(target, "w").write(src)
    path = os.path.join(tmp, family + ".metal")
    res = {}
    errs = mslc.lint(mslc.inline_includes(path)[0], path)
    res["lint"] = (bool(errs), errs[0] if errs else "")
    rc, out = mslc.check(path)
    res["check"] = (rc != 0, _first_line(out))
    rc2, out2 = mslc.check_as(path)
    res["check-as"] = (rc2 != 0, _first_line(out2))
    if rc:
        res["run"] = (False, "not built (g++ check failed)")
        return res
    OVERRIDE[family] = path
    try:
        VERDICTS[family]()
        res["run"] = (False, "")
    except (AssertionError, emu.EmulatorError) as ex:
        res["run"] = (True, str(ex).strip().splitlines()[0][:160])
    finally:
        OVERRIDE.pop(family, None)
    return res


@pytest.mark.parametrize("name", list(CASES))
def test_planted_bug_is_reported(name, tmp_path, have_clang):
    res = run_layers(name, str(tmp_path))
    print(f"\n{name}: " + "  ".join(f"{k}={'CAUGHT' if v[0] else 'ok'}" for k, v in res.items()))
    for k, (caught, why) in res.items():
        if caught:
            print(f"   {k}: {why}")
    expected = CASES[name][3]
    if expected is None:
        assert not any(c for c, _ in res.values()), f"false positive on an unmodified copy: {res}"
    else:
        assert res[expected][0], f"{name}: the {expected} layer did not report it ({res})"


def test_planted_missing_encoder_barrier_in_host_code():
    """The emulated device checks the backend's barrier placement: drop the barrier between the q/k/v
    projections and the q/k prep of attention (the emulator ignores the backend's barrier before attn_prep,
    exactly what the backend would issue without it), and the run must report a missing barrier."""
    import test_metal_backend as t_be

    from lily.testing import random_weights, tiny_configs
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)

    def run():
        eng = t_be.metal_engine(cfg, tensors, quant, drop_barrier_before="attn_prep")
        try:
            eng.forward(eng.new_state(), np.arange(6, dtype=np.int32), logits="last", chunk_size=6)
        except RuntimeError as ex:
            return str(ex)
        return ""

    msg = t_be._in_child(run)
    print("\nhost planted bug:", msg.strip().splitlines()[0] if msg else "(not reported)")
    assert "missing barrier: attn_prep" in msg

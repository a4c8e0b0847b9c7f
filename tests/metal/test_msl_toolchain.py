"""The project's Metal toolchain (tools/msl) tested on its own kernels (tests/metal/kernels/selftest.metal):
simdgroup collectives, simdgroup matrices, barriers, function constants, params.h structs, and that each
check reports what it must (out-of-bounds access, writes to inputs, divergent collectives, races,
unwritten threadgroup memory, threadgroup memory over the limit, unset function constants)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from metal_env import ROOT, emu, mslc

SELFTEST = os.path.join(ROOT, "tests", "metal", "kernels", "selftest.metal")


@pytest.fixture(scope="module")
def st():
    return emu.library(SELFTEST)


def test_selftest_passes_all_checks(have_clang):
    for layer, rc, text in mslc.check_all(SELFTEST):
        assert rc == 0, f"{layer}: {text}"


def test_simd_collectives(st, rng):
    x = rng.standard_normal(128).astype(np.float32)
    o, = emu.run3(st, "simd_ops", (2, 1, 1), (64, 1, 1), [x, np.zeros(128 * 8, np.float32)], outputs=[1])
    o, g = o.reshape(128, 8), x.reshape(4, 32)
    exp = np.stack([np.repeat(g.sum(1), 32), (np.cumsum(g, 1) - g).ravel(), np.repeat(g[:, 5], 32),
                    np.repeat(g.max(1), 32), np.concatenate([np.append(r[1:], r[31]) for r in g]),
                    g[:, ::-1].ravel(), np.repeat(g.min(1), 32), np.cumsum(g, 1).ravel()], 1)
    np.testing.assert_allclose(o, exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,tol", [("sg_matmul_f32", 1e-5), ("sg_matmul_f16", 3e-3)])
def test_simdgroup_matrix(st, rng, name, tol):
    M, N, K = 32, 48, 24
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    C, = emu.run3(st, name, (N // 16, M // 16, 1), (128, 1, 1),
                  [A, B, np.zeros((M, N), np.float32), np.array([M, N, K, 0], np.uint32)], outputs=[2])
    assert np.abs(C - A @ B).max() / np.abs(A @ B).max() < tol


def test_function_constants_and_params(st, rng):
    x = rng.standard_normal(256).astype(np.float32)
    p = emu.params("AttentionParams", n_heads=3, pos0=100)
    o, = emu.run3(st, "tg_reverse", (4, 1, 1), (64, 1, 1), [x, np.zeros(256, np.float32), p], outputs=[1],
                  fc={0: True, 1: 5})
    np.testing.assert_allclose(o, x.reshape(4, 64)[:, ::-1].ravel() * 2 + 5 + 3 + 100, rtol=1e-6)
    o, = emu.run3(st, "tg_reverse", (4, 1, 1), (64, 1, 1), [x, np.zeros(256, np.float32), p], outputs=[1],
                  fc={0: False, 1: 0})
    np.testing.assert_allclose(o, x.reshape(4, 64)[:, ::-1].ravel() + 103, rtol=1e-6)


def test_params_layout_matches_compiler():
    # the layout check runs at library load; every struct of params.h must map to a numpy dtype
    for name in mslc.parse_structs():
        assert emu.struct_dtype(name).itemsize > 0


def _fails(r, *words):
    assert not r.ok, "expected a reported failure"
    assert all(w in r.msg for w in words), r.msg


def test_reports_unset_function_constant(st):
    x = np.zeros(64, np.float32)
    r = st.dispatch("tg_reverse", (1, 1, 1), (64, 1, 1), [x, x, emu.params("AttentionParams")], fc={0: True})
    _fails(r, "function constant")


@pytest.mark.parametrize("n,shift", [(64, 1), (60, 1), (64, -1), (64, -512)])
def test_reports_out_of_bounds(st, n, shift):
    x = np.ones(n, np.float32)
    r = st.dispatch("shifted_copy", (1, 1, 1), (64, 1, 1), [x, np.zeros(64, np.float32), np.array(shift, np.int32)])
    if r.ok:  # a read into the alignment slack returns the NaN fill instead of faulting
        assert not np.all(np.isfinite(r.out[1])), "out-of-bounds read went unnoticed"
    else:
        _fails(r, "signal 11")


def test_reports_write_to_const_bound_buffer(st):
    # buffer(1) is `device const`: the emulator maps it read-only, so a write through a cast faults
    assert st.buffer_params("write_input")[1][1] and not st.buffer_params("write_input")[0][1]
    _fails(st.dispatch("write_input", (1, 1, 1), (64, 1, 1), [np.zeros(64, np.float32), np.ones(64, np.float32)]),
           "signal 11")


def test_reports_divergent_collective(st):
    x = np.ones(64, np.float32)
    _fails(st.dispatch("divergent_sum", (1, 1, 1), (64, 1, 1), [x, np.zeros(64, np.float32)]), "divergent")


def test_reports_threadgroup_memory_limit(st):
    _fails(st.dispatch("tg_too_big", (1, 1, 1), (64, 1, 1), [np.zeros(64, np.float32)]), "limit")


def test_unwritten_threadgroup_memory_is_nan(st):
    r = st.dispatch("read_unwritten_tg", (1, 1, 1), (64, 1, 1), [np.zeros(64, np.float32)])
    assert r.ok
    assert np.all(np.isnan(r.out[0][:32])) and np.all(r.out[0][32:] == 1)


def test_lint_rules():
    bad = """
kernel void k(device float* a [[buffer(0)]], float* b [[buffer(1)]], device float* c [[buffer(1)]],
              float lane [[thread_index_in_simdgroup]], device float* d) {
    double x = 0; std::min(1, 2);
}
template <int N> kernel void t(device float* a [[buffer(0)]]) {}
"""
    errs = "\n".join(mslc.lint(bad, "bad.metal"))
    for w in ["address space", "buffer(1) already used", "must be uint/ushort", "without attribute", "'double'",
              "standard library", "no [[host_name]] instantiation"]:
        assert w in errs, (w, errs)

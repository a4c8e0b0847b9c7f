"""Norm family: RMSNorm, the gated RMSNorm of the DeltaNet output, the embedding lookup (every weight format),
on every backend against lily.reference; then the Metal RMSNorm kernel in its thread-count schedules."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from kernel_inputs import FORMATS, Weight, rel_tol
from ops_metal import rms_norm
from lily.testing.tolerances import tol

from lily.reference import gated_rms_norm, ops

TOL = tol("op_vs_reference")["rel_rms"]


@pytest.mark.parametrize("n", [33, 2048])
@pytest.mark.parametrize("S", [1, 2, 63, 64, 65])
def test_rms_norm_rows(backend, rng, S, n):
    x = rng.standard_normal((S, n)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    assert_close(f"{backend.NAME} rms_norm S={S} n={n}", backend.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6),
                 rel_tol(backend, "norm"))


@pytest.mark.parametrize("S,Hv,Dv", [(1, 3, 32), (2, 5, 40), (63, 2, 128), (65, 1, 48)])
def test_gated_rms_norm(backend, rng, S, Hv, Dv):
    o = rng.standard_normal((S, Hv * Dv)).astype(np.float32)
    z = rng.standard_normal((S, Hv * Dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(Dv)).astype(np.float32)
    ref = gated_rms_norm(o.reshape(S, Hv, Dv), z.reshape(S, Hv, Dv), w, 1e-6).reshape(S, -1)
    assert_close(f"{backend.NAME} gated_rms_norm S={S} Hv={Hv} Dv={Dv}", backend.gated_rms_norm(o, z, w, 1e-6), ref,
                 rel_tol(backend, "norm"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_embed(backend, rng, fmt):
    w = Weight(rng, 301, 128, fmt)
    ids = np.array([0, 300, 17, 17, 5])
    np.testing.assert_allclose(backend.embed(w, ids), w.dense[ids], rtol=1e-6, atol=1e-7)


# ---- Metal: the RMSNorm kernel in the thread counts the host may pick ----

@pytest.mark.parametrize("S,n,nt", [(1, 128, 64), (3, 192, 128), (2, 2048, 256), (4, 33, 32)])
def test_rms_norm(rng, S, n, nt):
    x = rng.standard_normal((S, n)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    assert_close(f"rms_norm S={S} n={n}", rms_norm(x, w, nt=nt), ops.rms_norm(x, w, 1e-6), TOL)

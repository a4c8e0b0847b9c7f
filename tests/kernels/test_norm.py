"""metal/norm.metal: RMSNorm, embedding lookup (every weight format), greedy argmax."""
from __future__ import annotations

import numpy as np
import pytest
from _metrics import assert_close
from metal_ops import Weight, argmax, embed, rms_norm
from tolerances import tol

from lily.reference import ops

TOL = tol("op_vs_reference")["rel_rms"]


@pytest.mark.parametrize("S,n,nt", [(1, 128, 64), (3, 192, 128), (2, 2048, 256), (4, 33, 32)])
def test_rms_norm(rng, S, n, nt):
    x = rng.standard_normal((S, n)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    assert_close(f"rms_norm S={S} n={n}", rms_norm(x, w, nt=nt), ops.rms_norm(x, w, 1e-6), TOL)


@pytest.mark.parametrize("fmt", ["q4", "q8", "bf16", "f32"])
def test_embed(rng, fmt):
    w = Weight(rng, 301, 128, fmt)
    ids = np.array([0, 300, 17, 17, 5])
    np.testing.assert_allclose(embed(w, ids), w.dense[ids], rtol=1e-6, atol=1e-7)


def test_argmax(rng):
    V = 5003
    logits = rng.standard_normal(V).astype(np.float32)
    assert argmax(logits) == int(np.argmax(logits))
    logits[[7, 4000]] = 100.0   # tie: the lower index wins, as np.argmax
    assert argmax(logits, slot=0) == 7

"""The CPU per-op entry points (lily._lily.ops) check shapes, dtypes and formats at the front door with
"[ops.X]" errors, and never write into their inputs (state arrays come back as new arrays)."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_inputs import Weight

_lily = pytest.importorskip("lily._lily")
ops = _lily.ops
f32 = np.float32


@pytest.mark.parametrize("call,match", [
    (lambda: ops.rms_norm(np.ones((2, 8), f32), np.ones(7, f32), 1e-6), r"\[ops.rms_norm\] x must be \[\*, 7\]"),
    (lambda: ops.gated_rms_norm(np.ones((2, 8), f32), np.ones((2, 8), f32), np.ones(3, f32), 1e-6), "multiple"),
    (lambda: ops.linear(np.ones((2, 64), f32), np.zeros((4, 8), np.uint32), bits=4, group=64), "scales and biases"),
    (lambda: ops.linear(np.ones((2, 64), f32), np.zeros((4, 64), np.int32)), "bf16 .uint16. or float32"),
    (lambda: ops.linear(np.ones((2, 65), f32), np.zeros((4, 64), f32)), r"\[ops.linear\] x must be \[\*, 64\]"),
    (lambda: ops.embed(np.array([0, 4], np.int32), np.zeros((4, 8), f32)), "id out of range"),
    (lambda: ops.moe_route(np.ones((2, 4), f32), 5, True), "top_k"),
    (lambda: ops.moe(np.ones((1, 8), f32), {}, {}, "m.", 1, True), "missing tensor 'm.gate.weight'"),
], ids=["norm", "gated_norm", "quant_no_scales", "dtype", "in_dim", "embed_id", "top_k", "moe_missing"])
def test_bad_arguments_are_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_attention_cache_too_small_and_state_inputs_untouched(rng):
    S, Hq, Hkv, D = 2, 2, 1, 32
    qg, k, v = (rng.standard_normal((S, n)).astype(f32) for n in (Hq * 2 * D, Hkv * D, Hkv * D))
    norm = np.ones(D, f32)
    cache = np.zeros((S + 3, Hkv * D), f32)
    with pytest.raises(ValueError, match=r"\[ops.attention\] the cache must hold rows"):
        ops.attention(qg, k, v, norm, norm, cache, cache, 4, Hq, Hkv, D, 8, 1e7, 1e-6)
    before = [a.copy() for a in (qg, k, cache)]
    ops.attention(qg, k, v, norm, norm, cache, cache, 1, Hq, Hkv, D, 8, 1e7, 1e-6)
    for a, b in zip((qg, k, cache), before):
        np.testing.assert_array_equal(a, b)


def test_quantized_linear_checks_the_scales_shape(rng):
    w = Weight(rng, 4, 64, "q4", 32)
    with pytest.raises(ValueError, match=r"scales and biases must be bf16 \(uint16\) \[4, 2\]"):
        ops.linear(np.ones((1, 64), f32), w.codes, w.scales[:, :1].copy(), w.biases, bits=4, group=32)

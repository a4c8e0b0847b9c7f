"""lily.quant vs MLX (mx.quantize / mx.dequantize on CPU): bit-identical codes, scales and biases."""
from __future__ import annotations

import numpy as np
import pytest

from lily.quant import (bf16_to_f32, dequantize, f32_to_bf16, pack_codes, quantize, round_bf16,
                        unpack_codes)

mx = pytest.importorskip("mlx.core")


def _mx_quantize(w_f32: np.ndarray, bits: int, group: int):
    """mx.quantize on the bf16 version of w -> (codes, scales bits, biases bits) as NumPy."""
    m = mx.array(w_f32).astype(mx.bfloat16)
    wq, s, b = mx.quantize(m, group_size=group, bits=bits)
    return np.array(wq), np.array(s.view(mx.uint16)), np.array(b.view(mx.uint16))


def _bf16_random(rng, shape, scale=0.05):
    return round_bf16(rng.standard_normal(shape).astype(np.float32) * scale)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_matches_mlx(bits, group):
    rng = np.random.default_rng(1000 * bits + group)
    # odd out dims, stacked experts, a wide row, several value scales
    for shape, sc in [((37, 2 * group), 0.05), ((3, 5, 4 * group), 1.0), ((129, 8 * group), 0.002),
                      ((1, group), 30.0)]:
        w = _bf16_random(rng, shape, sc)
        want = _mx_quantize(w, bits, group)
        got = quantize(w, bits, group)
        for name, a, b in zip(("codes", "scales", "biases"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
            np.testing.assert_array_equal(a, b, err_msg=f"{name} bits={bits} group={group} shape={shape}")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_edge_groups_match_mlx(bits):
    """Constant, zero, all-positive, all-negative, tiny and tied groups (the q0 == 0 branch)."""
    g = 64
    rows = [np.zeros(g), np.full(g, 0.5), np.full(g, -3.0), np.linspace(1, 2, g), np.linspace(-2, -1, g),
            np.linspace(-1, 1, g), np.full(g, 1e-9), np.r_[np.full(g - 1, 0.25), -0.25],
            np.r_[np.zeros(g - 1), 1e-8], np.tile([-1.0, 1.0], g // 2)]
    w = round_bf16(np.stack(rows).astype(np.float32))
    want = _mx_quantize(w, bits, g)
    got = quantize(w, bits, g)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_dequantize_matches_mlx():
    rng = np.random.default_rng(7)
    for bits in (4, 8):
        w = _bf16_random(rng, (2, 24, 256))
        wq, s, b = quantize(w, bits, 64)
        # with float32 scales/biases MLX dequantizes in float32: s*q + b, same as ours exactly
        m = mx.dequantize(mx.array(wq), mx.array(bf16_to_f32(s)), mx.array(bf16_to_f32(b)),
                          group_size=64, bits=bits)
        got = dequantize(wq, s, b, bits, 64)
        np.testing.assert_array_equal(got, np.array(m))
        # with bf16 scales MLX rounds twice in bf16: round(round(s*q) + b)
        m16 = mx.dequantize(mx.array(wq), mx.array(s).view(mx.bfloat16), mx.array(b).view(mx.bfloat16),
                            group_size=64, bits=bits)
        q = unpack_codes(wq, bits).astype(np.float32).reshape(*s.shape, 64)
        want16 = round_bf16(round_bf16(bf16_to_f32(s)[..., None] * q) + bf16_to_f32(b)[..., None])
        np.testing.assert_array_equal(want16.reshape(w.shape), np.array(m16.astype(mx.float32)))
        # reconstruction error stays within two steps of its group (MLX anchors the larger-magnitude
        # edge exactly, so the far edge may clip; the bf16 scale is off by up to 2^-9 x 255 codes)
        err = np.abs(got - w).reshape(*s.shape, 64).max(-1)
        assert (err <= 2 * np.abs(bf16_to_f32(s)) + 1e-7).all()


def test_f32_scales_match_mlx_float32_input():
    rng = np.random.default_rng(3)
    w = _bf16_random(rng, (16, 128))
    wq, s, b = mx.quantize(mx.array(w), group_size=64, bits=4)
    got = quantize(w, 4, 64, scales_dtype="f32")
    np.testing.assert_array_equal(got[0], np.array(wq))
    np.testing.assert_array_equal(got[1], np.array(s))
    np.testing.assert_array_equal(got[2], np.array(b))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, size=(3, 7, 64), dtype=np.uint32)
    packed = pack_codes(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 7, 64 * bits // 32)
    np.testing.assert_array_equal(unpack_codes(packed, bits), q)
    # LSB first: column 0 sits in the low bits of word 0
    assert (packed[..., 0] & ((1 << bits) - 1) == q[..., 0]).all()


def test_quantize_rejects_bad_group():
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize(np.zeros((4, 96), np.float32), 4, 64)


def test_bf16_roundtrip_and_rounding():
    # exact values survive
    x = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, np.inf, -np.inf, 1e-40], np.float32)
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(x)).view(np.uint32) >> 16,
                                  x.view(np.uint32) >> 16)
    # round to nearest even at the tie: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1 (even)
    one_ulp = np.float32(2.0 ** -7)
    ties = np.array([1 + one_ulp / 2, 1 + 3 * one_ulp / 2], np.float32)
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(ties)), [1.0, 1 + 2 * one_ulp])
    # just above the tie rounds up
    above = np.nextafter(np.float32(1 + one_ulp / 2), np.float32(2))
    assert bf16_to_f32(f32_to_bf16(np.array([above])))[0] == 1 + one_ulp
    # NaN stays NaN (also NaNs whose payload would round to inf)
    nans = np.array([np.nan, -np.nan], np.float32)
    nans = np.concatenate([nans, np.array([0x7F80_0001, 0xFFFF_FFFF], np.uint32).view(np.float32)])
    assert np.isnan(bf16_to_f32(f32_to_bf16(nans))).all()
    # overflow past the largest bf16 rounds to inf
    assert bf16_to_f32(f32_to_bf16(np.array([3.4e38], np.float32)))[0] == np.inf


def test_bf16_matches_mlx_conversion():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(10000) * np.exp(rng.uniform(-20, 20, 10000))).astype(np.float32)
    want = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(f32_to_bf16(x), want)

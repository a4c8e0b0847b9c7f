"""bf16 bit helpers and MLX affine quantization (model.md §2.2), in NumPy.

bf16 tensors are carried as np.uint16 bit patterns (NumPy has no bfloat16).
Quantized weight of logical shape [..., out, in]: codes uint32 [..., out, in*bits/32] (LSB first),
scales and biases bf16 [..., out, in/group]; w = scales * q + biases.
"""
from __future__ import annotations

import numpy as np


def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits [...] -> float32 [...]."""
    return (np.asarray(x, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 bf16 bits [...], round to nearest even (NaN stays NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 rounded to the nearest bf16 value."""
    return bf16_to_f32(f32_to_bf16(x))


def unpack_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [..., n_words] -> uint8 codes [..., n_words * 32/bits], LSB first."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return q.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.uint8)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """uint codes [..., n] (n a multiple of 32/bits) -> uint32 [..., n*bits/32], LSB first."""
    per = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def dequantize(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """codes uint32 [..., out, in*bits/32], scales/biases bf16 bits [..., out, in/group] -> float32 [..., out, in]."""
    q = unpack_codes(w, bits).astype(np.float32)
    s = bf16_to_f32(scales)
    b = bf16_to_f32(biases)
    shape = q.shape
    q = q.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    return (q * s[..., None] + b[..., None]).reshape(shape)


def quantize(w: np.ndarray, bits: int = 4, group_size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float [..., out, in] -> (codes uint32, scales bf16 bits, biases bf16 bits), MLX's affine rule.

    Mirrors mlx `affine_quantize`: the group edge with the larger magnitude is represented exactly
    (scale sign chosen so that edge maps to code 0 or n_bins), bias = that edge, scale and bias rounded
    to bf16 before the codes are computed from them.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % group_size:
        raise ValueError(f"quantize: input dim {w.shape[-1]} is not a multiple of group_size {group_size}")
    n_bins = float((1 << bits) - 1)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    w_max = g.max(-1)
    w_min = g.min(-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scales = np.maximum((w_max - w_min) / n_bins, 1e-7)
    scales = np.where(mask, scales, -scales)
    edge = np.where(mask, w_min, w_max)
    q0 = np.round(edge / scales)
    scales = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), scales)
    biases = np.where(q0 == 0, 0.0, edge).astype(np.float32)
    scales_b = round_bf16(scales.astype(np.float32))
    biases_b = round_bf16(biases)
    q = np.clip(np.round((g - biases_b[..., None]) / scales_b[..., None]), 0, n_bins)
    codes = pack_codes(q.reshape(w.shape).astype(np.uint32), bits)
    return codes, f32_to_bf16(scales_b), f32_to_bf16(biases_b)

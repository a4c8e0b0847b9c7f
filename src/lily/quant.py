"""bf16 bit helpers and MLX affine quantization (docs/model.md §2.2), in NumPy.

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
    if q.shape[-1] % per:
        raise ValueError(f"pack_codes: last dim {q.shape[-1]} is not a multiple of {per}")
    if bits in (4, 8):
        # fast path: build the little-endian bytes, then reinterpret 4 bytes as one uint32 word
        b = q.astype(np.uint8)
        if bits == 4:
            b = b[..., 0::2] | (b[..., 1::2] << np.uint8(4))
        return np.ascontiguousarray(b).view("<u4").astype(np.uint32, copy=False)
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


def quantize(w: np.ndarray, bits: int = 4, group_size: int = 64,
             scales_dtype: str = "bf16") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float [..., out, in] -> (codes uint32, scales, biases), bit-identical to `mx.quantize`.

    Mirrors MLX's affine quantizer (mlx/backend/cpu/quantized.cpp), all in float32:
      * the group edge with the larger magnitude (min if |min| > |max|, else max) is kept exact:
        scale = ±max((max - min) / n_bins, 1e-7), with the sign chosen so that edge maps to code 0;
        q0 = rint(edge / scale); if q0 != 0 the scale is refined to edge / q0 and bias = edge,
        otherwise bias = 0;
      * codes = clip(rint((w - bias) / scale), 0, n_bins) use the *unrounded* float32 scale/bias
        (MLX rounds them to the output dtype only when storing, after the codes are computed);
      * rint is round-half-to-even, as np.rint.
    `scales_dtype` "bf16" (default: what mx.quantize returns for bf16 inputs) gives uint16 bf16 bit
    patterns; "f32" returns float32 (what mx.quantize returns for float32 inputs).
    To match MLX on a bf16 model, pass the bf16 values (bf16_to_f32 of the stored bits).
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"quantize: bits must be 2, 4 or 8, got {bits}")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 1 or w.shape[-1] % group_size:
        raise ValueError(f"quantize: input dim {w.shape[-1] if w.ndim else None} is not a multiple "
                         f"of group_size {group_size}")
    n_bins = np.float32((1 << bits) - 1)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    w_max = g.max(-1)
    w_min = g.min(-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    # every operand is float32 so NumPy never promotes to float64 (which would change roundings)
    scale = np.where(nz, edge / np.where(nz, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
    q = np.subtract(g, bias[..., None])            # in-place passes: this runs over 35B weights
    np.divide(q, scale[..., None], out=q)
    np.rint(q, out=q)
    np.clip(q, 0, n_bins, out=q)
    codes = pack_codes(q.reshape(w.shape), bits)
    if scales_dtype == "f32":
        return codes, scale, bias
    if scales_dtype != "bf16":
        raise ValueError(f"quantize: scales_dtype must be 'bf16' or 'f32', got {scales_dtype!r}")
    return codes, f32_to_bf16(scale), f32_to_bf16(bias)

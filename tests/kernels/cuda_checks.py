"""Helpers of the CUDA kernel-by-kernel tests (test_cuda_*.py, over the `cuda` fixture: lily._lily.cuda_ops): random
weights in the ranges of a real checkpoint with the values the kernels read, the bf16 output check, row sampling for
references of big products. The references themselves are lily.reference / lily.quant on the kernel's operands."""
from __future__ import annotations

import numpy as np
from lily.testing.metrics import assert_close
from lily.testing.tolerances import KERNEL_CHECKS

from lily.quant import bf16_to_f32, dequantize, f32_to_bf16, round_bf16

KC = KERNEL_CHECKS


def bits(x) -> np.ndarray:
    """fp32 values -> bf16 bits (uint16), round to nearest even."""
    return f32_to_bf16(np.asarray(x, np.float32))


def vals(b) -> np.ndarray:
    """bf16 bits -> fp32 values."""
    return bf16_to_f32(np.asarray(b, np.uint16))


def assert_bf16_close(name: str, got_bits: np.ndarray, ref: np.ndarray) -> None:
    """A bf16 output of an fp32-exact computation: rel RMS <= 2^-8 and every element within one rounding,
    2^-8 |ref| + small_bf16_elem_slack rms(ref) (the slack: fp32 error on nearly cancelled elements)."""
    got = vals(got_bits).astype(np.float64)
    ref = np.asarray(ref, np.float64)
    assert_close(name, got, ref, KC["small_bf16_rel_rms"])
    slack = KC["small_bf16_elem_slack"] * np.sqrt(np.mean(ref ** 2))
    over = np.abs(got - ref) > np.ldexp(np.abs(ref), -8) + slack
    assert not over.any(), f"{name}: {int(over.sum())} elements off by more than one bf16 rounding"


def random_codes(rng, shape) -> np.ndarray:
    """uint32 words with every bit pattern equally likely (every code of every group)."""
    return rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32)


class RawWeight:
    """A weight [E?, out, in] with random codes (not quantized from values). kind "gemm": MLX affine bits 4/8, group 64,
    scales s = U(0.08, 0.2) / (2^bits - 1) and biases -s (2^bits - 1)/2 U(0.7, 1.3) (weights ~ +-0.1, centred: the
    check programs' prefill weights); kind "gemv": s = U(0.5, 1.5) 16 / ((2^bits - 1) 8 sqrt(in)), b = -s (2^bits - 1)
    U(0.5, 1.5) / 2; bits 16: dense bf16 N(0, 1/in). .t: the op table's tuple; .dense(e): expert e's fp32 values as
    lily.quant dequantizes them; .tiles(e): as the tensor-core GEMMs read them (one bf16 rounding)."""

    def __init__(self, rng, bits: int, out: int, inp: int, experts: int = 0, group: int = 64, kind: str = "gemm"):
        lead = (experts,) if experts else ()
        self.bits, self.group, self.out, self.inp, self.experts = bits, group, out, inp, experts
        if bits == 16:
            self.codes = bits_of(rng.standard_normal(lead + (out, inp)) * inp ** -0.5)
            self.t = (self.codes, None, None, 0, 0)
            return
        qmax = (1 << bits) - 1
        self.codes = random_codes(rng, lead + (out, inp * bits // 32))
        g = lead + (out, inp // group)
        if kind == "gemm":
            s = rng.uniform(0.08, 0.2, g) / qmax
            b = -s * qmax / 2 * rng.uniform(0.7, 1.3, g)
        else:
            s = rng.uniform(0.5, 1.5, g) * 16 / (qmax * 8 * np.sqrt(inp))
            b = -0.5 * qmax * s * rng.uniform(0.5, 1.5, g)
        self.scales, self.biases = bits_of(s), bits_of(b)
        self.t = (self.codes, self.scales, self.biases, bits, group)

    def dense(self, e: int | None = None) -> np.ndarray:
        """fp32 [out, in] of expert e (None: the one matrix)."""
        if self.bits == 16:
            return vals(self.codes if e is None else self.codes[e])
        sl = (lambda a: a) if e is None else (lambda a: a[e])
        return dequantize(sl(self.codes), sl(self.scales), sl(self.biases), self.bits, self.group)

    def tiles(self, e: int | None = None) -> np.ndarray:
        return round_bf16(self.dense(e))

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """fp32 rows [r0, r1) of the one matrix (a big weight's reference, a slice at a time)."""
        if self.bits == 16:
            return vals(self.codes[r0:r1])
        return dequantize(self.codes[r0:r1], self.scales[r0:r1], self.biases[r0:r1], self.bits, self.group)


def bits_of(x) -> np.ndarray:
    return bits(np.asarray(x, np.float32))


def sample_rows(rng, M: int, n: int, edges=()) -> np.ndarray:
    """Row indices for a reference of M rows: all of them when M <= n, else the first, the last, `edges` (tile edges)
    and random ones up to n, sorted."""
    if M <= n:
        return np.arange(M)
    rows = {0, M - 1} | {e for e in edges if 0 <= e < M}
    while len(rows) < n:
        rows.add(int(rng.integers(0, M)))
    return np.array(sorted(rows))


def silu(x):
    return x / (1.0 + np.exp(-x))

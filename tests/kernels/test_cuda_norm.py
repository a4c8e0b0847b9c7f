"""CUDA embed and RMSNorm (csrc/cuda/embed_norm.cu) one launch at a time against lily.reference / lily.quant, on the
real shapes (vocab 248,320, hidden 2,048) and awkward ones; outputs poisoned with NaN before the launch (cuda_ops).

Tolerances (KERNEL_CHECKS): embed fp32 rows, a fma of bf16 scale and bias per element: small_fp32_rel_rms (1e-5,
expected ~1e-7); RMSNorm's bf16 output of an fp32 norm: rel RMS <= 2^-8 and every element within one rounding."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from cuda_checks import KC, assert_bf16_close, bits_of, random_codes

from lily.quant import dequantize
from lily.reference import ops


# V, in, bits, S: the real table (one row and a prefill chunk), one group per row, rows past one 1,024-wide pass
@pytest.mark.parametrize("V,inp,nbits,S", [(248320, 2048, 4, 37), (248320, 2048, 4, 1), (1000, 64, 4, 5),
                                            (517, 2112, 4, 37), (300, 192, 8, 7)])
def test_embed(cuda, rng, V, inp, nbits, S):
    # scales 0.01-0.03 (8-bit: / 16), biases near -2^(bits-1) s: zero-mean rows, as MLX quantizes an embedding
    codes = random_codes(rng, (V, inp * nbits // 32))
    s = rng.uniform(0.01, 0.03, (V, inp // 64)) / (16 if nbits == 8 else 1)
    b = -(1 << (nbits - 1)) * s * rng.uniform(0.8, 1.2, s.shape)
    sc, bi = bits_of(s), bits_of(b)
    ids = rng.integers(0, V, S).astype(np.int32)
    ids[0] = V - 1  # the last row: the largest offsets
    if S > 2:
        ids[1], ids[2] = 0, ids[S - 1]  # the first row, a repeated id
    got = cuda.embed(ids, (codes, sc, bi, nbits, 64))
    ref = dequantize(codes[ids], sc[ids], bi[ids], nbits, 64)
    assert_close(f"cuda embed bits={nbits} V={V} in={inp} S={S}", got, ref, KC["small_fp32_rel_rms"])


# rows, n, x_offset. Register path (n % 4 == 0, n <= 2048, x 16-byte aligned): n = 2048 (two float4s a thread), 100
# (a partial warp), 1028 (one thread holds a second float4). Loop path: n = 2049 (odd), 2052 and 5000 (past 2048), x
# one float past an aligned start.
@pytest.mark.parametrize("rows,n,off", [(1, 2048, 0), (37, 2048, 0), (300, 2048, 0), (4096, 2048, 0), (5, 100, 0),
                                        (7, 1028, 0), (37, 2049, 0), (3, 2052, 0), (3, 5000, 0), (37, 2048, 1)])
def test_rms_norm(cuda, rng, rows, n, off):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0] *= 50  # a row of large residual values (outlier channels)
    if rows > 1:
        x[1] *= 1e-3  # a row of small values (eps matters a little)
    w = rng.uniform(0.2, 2.0, n).astype(np.float32)
    assert_bf16_close(f"cuda rms_norm rows={rows} n={n} x+{off}", cuda.rms_norm(x, w, 1e-6, x_offset=off),
                      ops.rms_norm(x.astype(np.float64), w, 1e-6))
    if off == 0:  # the fp32 output (the MTP head's hidden rows), the rows' poison overwritten everywhere
        assert_close(f"cuda rms_norm fp32 rows={rows} n={n}", cuda.rms_norm(x, w, 1e-6, fp32=True),
                     ops.rms_norm(x.astype(np.float64), w, 1e-6), KC["small_fp32_rel_rms"])

"""Weight access for the reference: every linear module as a dense float32 matrix."""
from __future__ import annotations

import numpy as np

from ..quant import bf16_to_f32, dequantize, round_bf16


def as_f32(a: np.ndarray) -> np.ndarray:
    """float32 or bf16-bit (uint16) array -> float32."""
    return bf16_to_f32(a) if a.dtype == np.uint16 else np.asarray(a, dtype=np.float32)


class Weights:
    """Dense float32 views of the contract's tensors (dequantized lazily, cached)."""

    def __init__(self, tensors: dict[str, np.ndarray], quant: dict[str, tuple[int, int]]):
        self.tensors = tensors
        self.quant = quant
        self._cache: dict[str, np.ndarray] = {}

    def vec(self, name: str) -> np.ndarray:
        return as_f32(self.tensors[name])

    def linear(self, module: str) -> np.ndarray:
        """module "model.layers.0.mlp.gate" -> W float32 [out, in] (experts: [E, out, in])."""
        w = self._cache.get(module)
        if w is None:
            if module in self.quant:
                bits, group = self.quant[module]
                t = self.tensors
                w = dequantize(t[module + ".weight"], t[module + ".scales"], t[module + ".biases"], bits, group)
            else:
                w = as_f32(self.tensors[module + ".weight"])
            self._cache[module] = w
        return w

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        """ids int [S] -> float32 [S, hidden] (one dequantized row each)."""
        module = "model.embed_tokens"
        if module in self.quant:
            bits, group = self.quant[module]
            t = self.tensors
            return dequantize(t[module + ".weight"][ids], t[module + ".scales"][ids], t[module + ".biases"][ids],
                              bits, group)
        return as_f32(self.tensors[module + ".weight"][ids])


class Bf16Matrix:
    """A weight matrix whose products round the activation operand to bf16 first, as a bf16 engine does (the
    matrix itself is rounded by whoever builds it). numpy defers `x @ m` and `m @ x` to it (the rounding
    envelope of docs/numerics.md: lily.testing.cuda_checks and benchmarks/cuda_check_full.py)."""

    __array_ufunc__ = None

    def __init__(self, a):
        self.a = a

    @property
    def T(self):
        return Bf16Matrix(self.a.T)

    def __getitem__(self, i):
        return Bf16Matrix(self.a[i])

    def __rmatmul__(self, x):
        return round_bf16(np.asarray(x, np.float32)) @ self.a

    def __matmul__(self, x):
        return self.a @ round_bf16(np.asarray(x, np.float32))

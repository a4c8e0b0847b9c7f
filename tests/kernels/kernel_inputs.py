"""Inputs of the kernel tests that every backend shares: linear weights in the checkpoint formats (lily.quant)
with their dequantized float32 twins, one MoE layer's weights, the expert block map of the grouped GEMM; and each
backend's bounds for a family (rel_tol) and its KV cache's values (kv_values)."""
from __future__ import annotations

import numpy as np
from lily.testing.tolerances import tol

from lily.quant import bf16_to_f32, dequantize, f32_to_bf16, quantize, round_bf16


def rel_tol(backend, family: str) -> float:
    """The rel RMS bound of `family` on `backend`: its table's TOLERANCE entry (a backend with bf16 operands), else
    the fp32 one (op_vs_reference; "self": the backend run two ways, self_consistency)."""
    default = tol("self_consistency" if family == "self" else "op_vs_reference")["rel_rms"]
    return getattr(backend, "TOLERANCE", {}).get(family, default)


def kv_values(backend, a: np.ndarray) -> np.ndarray:
    """a [..] as the backend's KV cache holds it: rounded to bf16 where the cache is bf16, else as is."""
    return round_bf16(a) if getattr(backend, "KV_CACHE", "f32") == "bf16" else a

FORMATS = ("q4", "q8", "bf16", "f32")
BITS = {"q4": 4, "q8": 8}


class Weight:
    """One linear weight [E?, out, in] in a checkpoint format, with its dequantized float32 twin `dense`."""

    def __init__(self, rng, out: int, inp: int, fmt: str, group: int = 64, experts: int = 0, scale: float = 1.0,
                 w: np.ndarray | None = None):
        shape = (experts, out, inp) if experts else (out, inp)
        if w is None:
            w = (rng.standard_normal(shape) * scale * inp ** -0.5).astype(np.float32)
        self.fmt, self.out, self.inp, self.group, self.experts = fmt, out, inp, group, experts
        if fmt in ("q4", "q8"):
            self.codes, self.scales, self.biases = quantize(w, BITS[fmt], group)
            self.dense = dequantize(self.codes, self.scales, self.biases, BITS[fmt], group)
            self.bufs = [self.codes, self.scales, self.biases]
        elif fmt == "bf16":
            self.codes = f32_to_bf16(w)
            self.dense = bf16_to_f32(self.codes)
            self.bufs = [self.codes, self.codes, self.codes]  # scales/biases unused: bound to the weight
        else:
            self.codes = w
            self.dense = w
            self.bufs = [w, w, w]

    @classmethod
    def from_tensors(cls, tensors: dict, quant: dict, module: str) -> "Weight":
        """A weight of the engine contract (tensors + quant dicts of lily.testing.random_weights)."""
        self = cls.__new__(cls)
        codes = tensors[module + ".weight"]
        if module in quant:
            bits, self.group = quant[module]
            self.fmt = "q4" if bits == 4 else "q8"
            self.scales, self.biases = tensors[module + ".scales"], tensors[module + ".biases"]
            self.inp = codes.shape[-1] * 32 // bits
            self.dense = dequantize(codes, self.scales, self.biases, bits, self.group)
            self.bufs = [codes, self.scales, self.biases]
        else:
            self.fmt, self.group = ("bf16" if codes.dtype == np.uint16 else "f32"), 0
            self.inp = codes.shape[-1]
            self.dense = bf16_to_f32(codes) if codes.dtype == np.uint16 else codes
            self.bufs = [codes, codes, codes]
        self.codes, self.out = codes, codes.shape[-2]
        self.experts = codes.shape[0] if codes.ndim == 3 else 0
        return self

    def tensors(self, module: str) -> tuple[dict, dict]:
        """(tensors, quant) entries of this weight as module `module` of the engine contract."""
        if self.fmt in BITS:
            return ({module + ".weight": self.codes, module + ".scales": self.scales,
                     module + ".biases": self.biases}, {module: (BITS[self.fmt], self.group)})
        return {module + ".weight": self.codes}, {}


MOE_MODULES = {"router": "gate", "gate": "switch_mlp.gate_proj", "up": "switch_mlp.up_proj",
               "down": "switch_mlp.down_proj", "sh_gate": "shared_expert.gate_proj", "sh_up": "shared_expert.up_proj",
               "sh_down": "shared_expert.down_proj", "sh_expert_gate": "shared_expert_gate"}


def moe_weights(tensors: dict, quant: dict, layer: int) -> dict:
    p = f"model.layers.{layer}.mlp."
    return {k: Weight.from_tensors(tensors, quant, p + m) for k, m in MOE_MODULES.items()}


def moe_tensors(W: dict, prefix: str = "model.layers.0.mlp.") -> tuple[dict, dict]:
    """MoE weights {router, gate, ...: Weight} -> (tensors, quant) of the engine contract under prefix."""
    tensors, quant = {}, {}
    for k, m in MOE_MODULES.items():
        t, q = W[k].tensors(prefix + m)
        tensors.update(t)
        quant.update(q)
    return tensors, quant


def block_map(counts, bm, max_tiles):
    """Expert tiles of the grouped GEMM over sorted pairs (counts [E] pairs per expert) -> (tile_expert,
    tile_row0, tile_rows, n_tiles, max_tiles), padded with -1 to max_tiles."""
    te, tr0, trn, start = [], [], [], 0
    for e, c in enumerate(counts):
        for r in range(0, c, bm):
            te.append(e); tr0.append(start + r); trn.append(min(bm, c - r))
        start += c
    n = len(te)
    pad = max_tiles - n
    return te + [-1] * pad, tr0 + [-1] * pad, trn + [-1] * pad, n, max_tiles

"""numpy-in / numpy-out wrappers of lily's Metal kernels on the emulator (three schedules each), plus
weight builders in the engine-contract formats. Grid and threadgroup shapes are chosen here the way the
host backend chooses them, so the tests exercise the same launch geometry."""
from __future__ import annotations

import numpy as np
from conftest import emu, lib

from lily.quant import bf16_to_f32, dequantize, f32_to_bf16, quantize

FMT = {"q4": 0, "q8": 1, "bf16": 2, "f32": 3}
GEMV_ROWS, GEMV_NSG = 4, 2


class Weight:
    """One linear weight [E?, out, in] in a checkpoint format, with its dequantized float32 twin `dense`."""

    def __init__(self, rng, out: int, inp: int, fmt: str, group: int = 64, experts: int = 0, scale: float = 1.0):
        shape = (experts, out, inp) if experts else (out, inp)
        w = (rng.standard_normal(shape) * scale * inp ** -0.5).astype(np.float32)
        self.fmt, self.out, self.inp, self.group, self.experts = fmt, out, inp, group, experts
        if fmt in ("q4", "q8"):
            bits = 4 if fmt == "q4" else 8
            self.codes, self.scales, self.biases = quantize(w, bits, group)
            self.dense = dequantize(self.codes, self.scales, self.biases, bits, group)
            self.bufs = [self.codes, self.scales, self.biases]
        elif fmt == "bf16":
            self.codes = f32_to_bf16(w)
            self.dense = bf16_to_f32(self.codes)
            self.bufs = [self.codes, self.codes, self.codes]  # scales/biases unused: bound to the weight
        else:
            self.codes = w
            self.dense = w
            self.bufs = [w, w, w]

    def args(self):
        return emu.params("LinearArgs", fmt=FMT[self.fmt], in_dim=self.inp, out_dim=self.out,
                          group=self.group if self.fmt in ("q4", "q8") else 0)


def gemv(w: Weight, x: np.ndarray, y0: np.ndarray | None = None) -> np.ndarray:
    """x [S, in] -> y [S, out]; with y0 the result is added to it (residual add fused)."""
    S = x.shape[0]
    acc = y0 is not None
    y = y0.copy() if acc else np.zeros((S, w.out), np.float32)
    ga = emu.params("GemvArgs", x_stride=x.shape[1], y_stride=w.out, accumulate=int(acc))
    grid = (-(-w.out // (GEMV_ROWS * GEMV_NSG)), S, 1)
    out, = emu.run3(lib("gemv"), f"gemv_{w.fmt}", grid, (32 * GEMV_NSG, 1, 1),
                    [*w.bufs, np.ascontiguousarray(x, np.float32), y, w.args(), ga], outputs=[4], poison=not acc)
    return out


GEMM_BN = 32
_I32 = np.zeros(1, np.int32)


def gemm(w: Weight, a: np.ndarray, *, t: str = "f32", bm: int = 32, y0: np.ndarray | None = None,
         up: Weight | None = None, block_map=None, row_index=None, M: int | None = None) -> np.ndarray:
    """Y = A W^T (plain), Y += ... (y0 given), silu(A Wg^T) * (A Wu^T) (up given).
    block_map = (tile_expert, tile_row0, tile_rows, n_tiles, max_tiles) for the grouped (MoE) form, with
    row_index (gather of A rows per sorted pair) or None (A read in pair order); M = number of pairs."""
    M = a.shape[0] if M is None else M
    n_out = w.out
    y = y0.copy() if y0 is not None else np.zeros((M, n_out), np.float32)
    grouped = block_map is not None
    if grouped:
        te, tr0, trn, nt, max_tiles = block_map
        maps = [np.asarray(x, np.int32) for x in (row_index if row_index is not None else _I32, te, tr0, trn, [nt])]
        tiles = max_tiles
    else:
        maps, tiles = [_I32] * 5, -(-M // bm)
    ga = emu.params("GemmArgs", M=M, grouped=int(grouped), gather=int(row_index is not None),
                    epilogue=1 if y0 is not None else (2 if up else 0), lda=a.shape[1], ldy=n_out,
                    max_tiles=tiles)
    name = f"gemm_{'glu_' if up else ''}{w.fmt}_{t}_bm{bm}"
    w2 = up.bufs if up else w.bufs
    out, = emu.run3(lib("gemm"), name, (-(-n_out // GEMM_BN), tiles, 1), (128, 1, 1),
                    [np.ascontiguousarray(a, np.float32), *w.bufs, *w2, y, w.args(), ga, *maps],
                    outputs=[7], poison=y0 is None)
    return out

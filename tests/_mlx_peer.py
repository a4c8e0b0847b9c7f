"""mlx-lm as an independent peer: teacher-forced logits of a checkpoint folder, fp32 or bf16."""
from __future__ import annotations

import numpy as np
import pytest


def mlx_teacher_forced_logits(folder: str, tokens: np.ndarray, dtype: str) -> np.ndarray:
    """Load `folder` with mlx_lm.load (the same bytes lily loads) -> float32 logits [S, vocab].

    dtype "fp32": every float parameter upcast to fp32 (same quantized codes, fp32 activations);
    dtype "bf16": as stored (bf16 scales/activations, fp32 A_log), the way MLX runs the model.
    """
    mx = pytest.importorskip("mlx.core")
    mlx_lm = pytest.importorskip("mlx_lm")
    model, _ = mlx_lm.load(folder)
    if dtype == "fp32":
        model.set_dtype(mx.float32)
    elif dtype != "bf16":
        raise ValueError(dtype)
    out = model(mx.array(np.asarray(tokens, np.int32))[None])
    return np.array(out.astype(mx.float32))[0]

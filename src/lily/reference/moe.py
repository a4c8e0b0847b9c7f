"""Sparse MoE with shared expert (docs/model.md §4.4)."""
from __future__ import annotations

import numpy as np

from .ops import sigmoid, silu, softmax


def route(logits: np.ndarray, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [S, E] -> (expert ids int [S, k], weights [S, k]); ties broken by lower id."""
    p = softmax(logits.astype(np.float32), axis=-1)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    wts = np.take_along_axis(p, idx, axis=-1)
    if renormalize:
        wts = wts / wts.sum(-1, keepdims=True)
    return idx, wts


def moe_ffn(h: np.ndarray, w, layer: int, cfg, prefix: str | None = None) -> np.ndarray:
    """h [S, hidden] normalised rows -> [S, hidden]; prefix names another layer's weights ("mtp.layers.0")."""
    p = f"{prefix or f'model.layers.{layer}'}.mlp"
    idx, wts = route(h @ w.linear(p + ".gate").T, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    Wg = w.linear(p + ".switch_mlp.gate_proj")  # [E, I, hidden]
    Wu = w.linear(p + ".switch_mlp.up_proj")
    Wd = w.linear(p + ".switch_mlp.down_proj")  # [E, hidden, I]
    out = np.zeros_like(h, dtype=np.float32)
    for s in range(h.shape[0]):
        for e, wt in zip(idx[s], wts[s]):
            act = silu(Wg[e] @ h[s]) * (Wu[e] @ h[s])
            out[s] += wt * (Wd[e] @ act)
    sh = silu(h @ w.linear(p + ".shared_expert.gate_proj").T) * (h @ w.linear(p + ".shared_expert.up_proj").T)
    shared = sh @ w.linear(p + ".shared_expert.down_proj").T
    sgate = sigmoid(h @ w.linear(p + ".shared_expert_gate").T)  # [S, 1]
    return (out + sgate * shared).astype(np.float32)

"""Gated full attention (model.md §4.2): q/gate split per head, q/k norm, partial RoPE, GQA, sigmoid gate."""
from __future__ import annotations

import numpy as np

from .ops import rms_norm, rope, sigmoid, softmax


def attention_mixer(h: np.ndarray, w, layer: int, cfg, k_cache: np.ndarray, v_cache: np.ndarray,
                    positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One attention layer on normalised rows.

    Shapes: h [S, hidden]; k_cache, v_cache [P, Hkv, D] (past, post-RoPE); positions int [S] = P..P+S-1.
    Returns (out [S, hidden], k_cache' [P+S, Hkv, D], v_cache' [P+S, Hkv, D]).
    """
    p = f"model.layers.{layer}.self_attn"
    S = h.shape[0]
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = (h @ w.linear(p + ".q_proj").T).reshape(S, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(S, H * D)  # per-head [query | gate], not flat halves
    k = (h @ w.linear(p + ".k_proj").T).reshape(S, Hkv, D)
    v = (h @ w.linear(p + ".v_proj").T).reshape(S, Hkv, D)
    q = rms_norm(q, w.vec(p + ".q_norm.weight"), cfg.rms_norm_eps)
    k = rms_norm(k, w.vec(p + ".k_norm.weight"), cfg.rms_norm_eps)
    q = rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
    k = rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
    K = np.concatenate([k_cache, k], axis=0)  # [T, Hkv, D]
    V = np.concatenate([v_cache, v], axis=0)
    T = K.shape[0]
    group = H // Hkv
    o = np.empty((S, H, D), dtype=np.float32)
    key_pos = np.arange(T)
    for hq in range(H):
        kh = hq // group
        scores = (q[:, hq, :] @ K[:, kh, :].T) * (D ** -0.5)  # [S, T]
        scores = np.where(key_pos[None, :] <= positions[:, None], scores, -np.inf)
        o[:, hq, :] = softmax(scores, axis=-1) @ V[:, kh, :]
    out = (o.reshape(S, H * D) * sigmoid(gate)) @ w.linear(p + ".o_proj").T
    return out.astype(np.float32), K, V

"""Gated full attention (docs/model.md §4.2): q/gate split per head, q/k norm, partial RoPE, GQA, sigmoid gate."""
from __future__ import annotations

import numpy as np

from .ops import rms_norm, rope, sigmoid, softmax


def attention_core(qg: np.ndarray, k: np.ndarray, v: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray,
                   k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray, n_heads: int, rotary_dim: int,
                   rope_theta: float, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mixer between its projections (the attention kernels' boundary): q/k norm, RoPE, causal GQA, gate.

    Shapes: qg [S, Hq*2D] per head [query | gate]; k, v [S, Hkv*D]; q_norm, k_norm [D];
    k_cache, v_cache [P, Hkv, D] (past, post-RoPE); positions int [S] = P..P+S-1.
    Returns (o [S, Hq*D] gated, k_cache' [P+S, Hkv, D], v_cache' [P+S, Hkv, D]).
    """
    S = qg.shape[0]
    H, Hkv, D = n_heads, k_cache.shape[1], k_cache.shape[2]
    qg = qg.reshape(S, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(S, H * D)  # per-head [query | gate], not flat halves
    k = rms_norm(k.reshape(S, Hkv, D), k_norm, eps)
    q = rope(rms_norm(q, q_norm, eps), positions, rotary_dim, rope_theta)
    k = rope(k, positions, rotary_dim, rope_theta)
    K = np.concatenate([k_cache, k], axis=0)  # [T, Hkv, D]
    V = np.concatenate([v_cache, v.reshape(S, Hkv, D)], axis=0)
    T = K.shape[0]
    group = H // Hkv
    o = np.empty((S, H, D), dtype=np.float32)
    key_pos = np.arange(T)
    for hq in range(H):
        kh = hq // group
        scores = (q[:, hq, :] @ K[:, kh, :].T) * (D ** -0.5)  # [S, T]
        scores = np.where(key_pos[None, :] <= positions[:, None], scores, -np.inf)
        o[:, hq, :] = softmax(scores, axis=-1) @ V[:, kh, :]
    return o.reshape(S, H * D) * sigmoid(gate), K, V


def attention_mixer(h: np.ndarray, w, layer: int, cfg, k_cache: np.ndarray, v_cache: np.ndarray,
                    positions: np.ndarray, prefix: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One attention layer on normalised rows; prefix names another layer's weights ("mtp.layers.0", the MTP head).

    Shapes: h [S, hidden]; k_cache, v_cache [P, Hkv, D] (past, post-RoPE); positions int [S] = P..P+S-1.
    Returns (out [S, hidden], k_cache' [P+S, Hkv, D], v_cache' [P+S, Hkv, D]).
    """
    p = f"{prefix or f'model.layers.{layer}'}.self_attn"
    o, K, V = attention_core(h @ w.linear(p + ".q_proj").T, h @ w.linear(p + ".k_proj").T,
                             h @ w.linear(p + ".v_proj").T, w.vec(p + ".q_norm.weight"), w.vec(p + ".k_norm.weight"),
                             k_cache, v_cache, positions, cfg.num_attention_heads, cfg.rotary_dim, cfg.rope_theta,
                             cfg.rms_norm_eps)
    out = o @ w.linear(p + ".o_proj").T
    return out.astype(np.float32), K, V

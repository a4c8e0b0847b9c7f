"""Gated DeltaNet mixer (model.md §4.3), with the naive per-token recurrence.

State layout: S [Hv, Dv, Dk] fp32 (MLX layout), conv state [K-1, C] (pre-conv qkv rows, oldest first).
"""
from __future__ import annotations

import numpy as np

from .ops import rms_norm, sigmoid, silu, softplus


def causal_conv(qkv: np.ndarray, conv_state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """qkv [S, C], conv_state [K-1, C], weight [C, K] (tap K-1 = current token) -> (conv [S, C], state' [K-1, C])."""
    K = weight.shape[1]
    X = np.concatenate([conv_state, qkv], axis=0)  # [S+K-1, C]
    S = qkv.shape[0]
    out = np.zeros_like(qkv, dtype=np.float32)
    for j in range(K):
        out += weight[:, j][None, :] * X[j:j + S]
    return out, X[X.shape[0] - (K - 1):].copy() if K > 1 else conv_state


def gated_delta_recurrence(q, k, v, g, beta, state):
    """q, k [S, Hk, Dk]; v [S, Hv, Dv]; g, beta [S, Hv]; state [Hv, Dv, Dk] -> (o [S, Hv, Dv], state')."""
    S, Hv = v.shape[0], v.shape[1]
    ratio = Hv // k.shape[1]
    state = state.copy()
    o = np.empty(v.shape, dtype=np.float32)
    for t in range(S):
        for h in range(Hv):
            kh = h // ratio  # consecutive value heads share a key head
            st = state[h] * g[t, h]
            m = st @ k[t, kh]                        # [Dv]
            delta = beta[t, h] * (v[t, h] - m)        # [Dv]
            st = st + np.outer(delta, k[t, kh])       # [Dv, Dk]
            o[t, h] = st @ q[t, kh]
            state[h] = st
    return o, state


def deltanet_mixer(h: np.ndarray, w, layer: int, cfg, conv_state: np.ndarray, rec_state: np.ndarray):
    """h [S, hidden] normalised rows -> (out [S, hidden], conv_state', rec_state')."""
    p = f"model.layers.{layer}.linear_attn"
    S = h.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = h @ w.linear(p + ".in_proj_qkv").T                  # [S, C], segments q | k | v
    z = (h @ w.linear(p + ".in_proj_z").T).reshape(S, Hv, Dv)
    b = h @ w.linear(p + ".in_proj_b").T                      # [S, Hv]
    a = h @ w.linear(p + ".in_proj_a").T                      # [S, Hv]
    conv_w = w.vec(p + ".conv1d.weight").reshape(qkv.shape[1], -1)  # [C, K]
    conv, conv_state = causal_conv(qkv, conv_state, conv_w)
    u = silu(conv)
    kd = Hk * Dk
    q = u[:, :kd].reshape(S, Hk, Dk)
    k = u[:, kd:2 * kd].reshape(S, Hk, Dk)
    v = u[:, 2 * kd:].reshape(S, Hv, Dv)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) * (Dk ** -0.5)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    beta = sigmoid(b)
    A = np.exp(w.vec(p + ".A_log"))
    g = np.exp(-A[None, :] * softplus(a + w.vec(p + ".dt_bias")[None, :]))
    o, rec_state = gated_delta_recurrence(q, k, v, g, beta, rec_state)
    y = rms_norm(o, w.vec(p + ".norm.weight"), cfg.rms_norm_eps) * silu(z)  # norm weight used as stored
    out = y.reshape(S, Hv * Dv) @ w.linear(p + ".out_proj").T
    return out.astype(np.float32), conv_state, rec_state

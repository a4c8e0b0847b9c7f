"""Gated DeltaNet mixer (docs/model.md §4.3), with the naive per-token recurrence.

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


def deltanet_scan(u: np.ndarray, b: np.ndarray, a: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
                  state: np.ndarray, k_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """The recurrence kernels' boundary: q/k l2 normalisation, the gates, the recurrence.

    Shapes: u [S, C] post-conv SiLU rows, channels q [Hk*Dk] | k [Hk*Dk] | v [Hv*Dv]; b, a [S, Hv];
    a_log, dt_bias [Hv]; state [Hv, Dv, Dk]. Returns (o [S, Hv, Dv], state' [Hv, Dv, Dk]).
    """
    S = u.shape[0]
    Hv, Dv, Dk = state.shape
    kd = k_heads * Dk
    q = u[:, :kd].reshape(S, k_heads, Dk)
    k = u[:, kd:2 * kd].reshape(S, k_heads, Dk)
    v = u[:, 2 * kd:].reshape(S, Hv, Dv)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) * (Dk ** -0.5)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    beta = sigmoid(b)
    g = np.exp(-np.exp(a_log)[None, :] * softplus(a + dt_bias[None, :]))
    return gated_delta_recurrence(q, k, v, g, beta, state)


def gated_rms_norm(o: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """o, z [S, Hv, Dv], weight [Dv] (used as stored) -> RMSNorm(o; weight) * SiLU(z) [S, Hv, Dv]."""
    return rms_norm(o, weight, eps) * silu(z)


def deltanet_core(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, conv_w: np.ndarray,
                  dt_bias: np.ndarray, a_log: np.ndarray, norm_w: np.ndarray, conv_state: np.ndarray,
                  rec_state: np.ndarray, k_heads: int, eps: float):
    """The mixer between its projections (the CPU kernel's boundary): conv + SiLU, scan, gated norm.

    Shapes: qkv [S, C]; z [S, Hv*Dv]; b, a [S, Hv]; conv_w [C, K]; dt_bias, a_log [Hv]; norm_w [Dv];
    conv_state [K-1, C]; rec_state [Hv, Dv, Dk]. Returns (y [S, Hv*Dv], conv_state', rec_state').
    """
    conv, conv_state = causal_conv(qkv, conv_state, conv_w)
    o, rec_state = deltanet_scan(silu(conv), b, a, a_log, dt_bias, rec_state, k_heads)
    S, Hv, Dv = o.shape
    y = gated_rms_norm(o, z.reshape(S, Hv, Dv), norm_w, eps)
    return y.reshape(S, Hv * Dv), conv_state, rec_state


def deltanet_mixer(h: np.ndarray, w, layer: int, cfg, conv_state: np.ndarray, rec_state: np.ndarray):
    """h [S, hidden] normalised rows -> (out [S, hidden], conv_state', rec_state')."""
    p = f"model.layers.{layer}.linear_attn"
    qkv = h @ w.linear(p + ".in_proj_qkv").T                  # [S, C], segments q | k | v
    z = h @ w.linear(p + ".in_proj_z").T                      # [S, Hv*Dv]
    b = h @ w.linear(p + ".in_proj_b").T                      # [S, Hv]
    a = h @ w.linear(p + ".in_proj_a").T                      # [S, Hv]
    conv_w = w.vec(p + ".conv1d.weight").reshape(qkv.shape[1], -1)  # [C, K]
    y, conv_state, rec_state = deltanet_core(qkv, z, b, a, conv_w, w.vec(p + ".dt_bias"), w.vec(p + ".A_log"),
                                             w.vec(p + ".norm.weight"), conv_state, rec_state,
                                             cfg.linear_num_key_heads, cfg.rms_norm_eps)
    out = y @ w.linear(p + ".out_proj").T
    return out.astype(np.float32), conv_state, rec_state

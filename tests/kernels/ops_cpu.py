"""The CPU op table of the kernel suite: lily._lily.ops (the CPU backend's kernels, outputs NaN-filled before the
kernel writes them) behind the family entry points of op_list.py (their operands and shapes are declared there)."""
from __future__ import annotations

import numpy as np
from kernel_inputs import BITS, Weight, moe_tensors

from lily import _lily

NAME = "cpu"
SAMPLER = "full"  # every option of the device sampler (lily._lily.sample_draw)
_ops = _lily.ops


def _f32(a):
    return np.ascontiguousarray(a, np.float32)


def _weight_args(w: Weight) -> dict:
    if w.fmt in BITS:
        return dict(weight=w.codes, scales=w.scales, biases=w.biases, bits=BITS[w.fmt], group=w.group)
    return dict(weight=w.codes)


def rms_norm(x, w, eps):
    return _ops.rms_norm(_f32(x), _f32(w), eps)


def gated_rms_norm(o, z, w, eps):
    return _ops.gated_rms_norm(_f32(o), _f32(z), _f32(w), eps)


def embed(w: Weight, ids):
    return _ops.embed(np.ascontiguousarray(ids, np.int32), **_weight_args(w))


def linear(w: Weight, x):
    return _ops.linear(_f32(x), **_weight_args(w))


def attention(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos0, n_heads, n_kv_heads, head_dim, rotary_dim,
              rope_theta, eps):
    return _ops.attention(_f32(qg), _f32(k), _f32(v), _f32(q_norm), _f32(k_norm), _f32(k_cache), _f32(v_cache),
                          pos0, n_heads, n_kv_heads, head_dim, rotary_dim, rope_theta, eps)


def deltanet(qkv, z, b, a, conv_w, dt_bias, a_log, norm_w, conv_state, ssm, k_heads, norm_eps):
    return _ops.deltanet(*(_f32(t) for t in (qkv, z, b, a, conv_w, dt_bias, a_log, norm_w, conv_state, ssm)),
                         k_heads, norm_eps)


def moe_route(logits, top_k, norm_topk_prob):
    return _ops.moe_route(_f32(logits), top_k, norm_topk_prob)


MOE_EXPERT_FORMATS = ("q4", "q8", "bf16", "f32")


def moe(h, W: dict, top_k, norm_topk_prob):
    tensors, quant = moe_tensors(W, "m.")
    return _ops.moe(_f32(h), tensors, quant, "m.", top_k, norm_topk_prob)


def sample_draw(logits, uniform, **options):
    return _lily.sample_draw(_f32(logits), uniform, **options)

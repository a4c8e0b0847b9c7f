"""The CUDA op table of the kernel suite: lily._lily.cuda_ops (the engine's launch functions, csrc/cuda/*.cuh, run on
host arrays copied to the device, outputs poisoned with NaN / -1 before the kernels write them) behind the family entry
points of op_list.py. Each family entry runs the kernel chain
backend_cuda.cu runs for S rows outside a decode step (the decode step's fused kernels have their own tests in
test_cuda_*.py). Where the backend's kernels read bf16 (a normed row, the KV cache) the entry rounds its fp32 input to
bf16 first, as the chain's producer does.

Legend: S rows, H hidden, E experts, k routed experts per row, cap KV cache rows, Hq/Hkv query/KV heads, D head dim."""
from __future__ import annotations

import numpy as np
from kernel_inputs import BITS, Weight
from lily.testing.tolerances import KERNEL_CHECKS, tol

from lily import _lily
from lily.quant import bf16_to_f32, f32_to_bf16

NAME = "cuda"
SAMPLER = "full"  # every option of the device sampler (csrc/cuda/sample.cuh)
KV_CACHE = "bf16"  # the engine's KV cache holds bf16 (Backend::kv_elem)
MOE_EXPERT_FORMATS = ("q4", "q8", "bf16", "f32")
# The router runs on bf16 operands (the normed row, and in the GEMM the weights): where two experts' fp32 logits are
# that close, rounding may pick the other one (test_moe checks the routing at such near-ties with moe_routing).
ROUTER_BF16 = True
_c = getattr(_lily, "cuda_ops", None)

# The rel RMS bound of each family against lily.reference (fp32) on this backend (the families' tests read it through
# kernel_inputs.rel_tol; the CPU and emulated Metal take the fp32 bounds).
TOLERANCE = {
    "norm": KERNEL_CHECKS["small_bf16_rel_rms"],           # an fp32 norm rounded to bf16 once
    "linear": tol("op_vs_reference", "bf16_tiles")["rel_rms"],  # A and W rounded to bf16 in the tiles
    "attention": tol("op_vs_reference", "bf16_chain")["rel_rms"],
    "kv": KERNEL_CHECKS["small_bf16_rel_rms"],             # the k cache: RMSNorm + RoPE in fp32, stored as bf16
    "deltanet": KERNEL_CHECKS["small_bf16_rel_rms"],       # fp32 conv and scan, the gated norm's output in bf16
    "deltanet_state": KERNEL_CHECKS["deltanet_seq_rel_rms"],  # the sequential fp32 scan (S < 128)
    "moe": tol("op_vs_reference", "bf16_chain")["rel_rms"],
    "self": tol("self_consistency", "bf16")["rel_rms"],
}


def available() -> bool:
    return _c is not None


def wt(w: Weight) -> tuple:
    """The weight tuple the op table takes: (weight, scales, biases, bits, group)."""
    if w.fmt in BITS:
        return (w.codes, w.scales, w.biases, BITS[w.fmt], w.group)
    return (w.codes, None, None, 0, 0)


def bf16(x) -> np.ndarray:
    """fp32 values -> bf16 bits (uint16), round to nearest even: what the kernels read."""
    return f32_to_bf16(np.asarray(x, np.float32))


def _f32(a):
    return np.ascontiguousarray(a, np.float32)


# ---- the family entry points of op_list.py (operands and shapes declared there) ----

def rms_norm(x, w, eps):
    """The kernel's bf16 output."""
    return bf16_to_f32(_c.rms_norm(_f32(x), _f32(w), eps))


def gated_rms_norm(o, z, w, eps):
    """The kernel's bf16 output."""
    return bf16_to_f32(_c.deltanet_gated_norm(_f32(o), _f32(z), _f32(w), eps))


def embed(w: Weight, ids):
    return _c.embed(np.ascontiguousarray(ids, np.int32), wt(w))


def linear(w: Weight, x):
    """The engine's dispatch (one row: the GEMV; else the one-output kernel, wgmma, mma or
    wmma GEMM), x read as bf16."""
    return _c.linear(bf16(x), wt(w))


def attention(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos0, n_heads, n_kv_heads, head_dim, rotary_dim,
              rope_theta, eps):
    """Prep, the prefill
    sub-block's split plan, attention (S > 1: the tensor-core flash attention; S = 1: the CUDA-core kernel). The
    caches travel as bf16 (fp32 in and out here: the values rounded to bf16)."""
    args = (n_heads, n_kv_heads, head_dim)
    q, kc, vc = _c.attention_prep(_f32(qg), _f32(k), _f32(v), _f32(q_norm), _f32(k_norm), bf16(k_cache),
                                  bf16(v_cache), pos0, *args, rotary_dim, rope_theta, eps)
    o = _c.attention(q, _f32(qg), kc, vc, pos0, *args)
    return bf16_to_f32(o), bf16_to_f32(kc), bf16_to_f32(vc)


NORM_CHUNK, NORM_AUTO, NORM_SEQ, NORM_SPLIT = 0, 1, 2, 3  # cuda_ops.deltanet_scan_norm variants


def deltanet(qkv, z, b, a, conv_w, dt_bias, a_log, norm_w, conv_state, ssm, k_heads, norm_eps):
    """Conv (+ l2 norm), then
    the scan with the gated norm in the form auto picks at S, with its scratch passed (backend_cuda.cu)."""
    Hv, Dv, Dk = ssm.shape
    u, conv1 = _c.deltanet_conv(_f32(qkv), _f32(conv_w), _f32(conv_state), k_heads, Dk, Hv, Dv)
    variant = NORM_CHUNK if _c.deltanet_scan_pick(qkv.shape[0]) == 2 else NORM_SEQ
    out, ssm1 = _c.deltanet_scan_norm(u, _f32(b), _f32(a), _f32(dt_bias), _f32(a_log), _f32(z), _f32(norm_w),
                                      _f32(ssm), k_heads, variant, norm_eps)
    return bf16_to_f32(out), conv1, ssm1


def moe_route(logits, top_k, norm_topk_prob):
    return _c.moe_route(_f32(logits), top_k, norm_topk_prob)


def moe(h, W: dict, top_k, norm_topk_prob):
    """backend_cuda.cu's moe_block after its norm (h rounded to bf16 as the norm leaves it):
    router and shared-expert gate, routing, shared expert, the routed experts (one row: the unfused decode experts;
    else sort + grouped GEMMs), combine onto zeros."""
    hb = bf16(h)
    S, H = hb.shape
    logits = _c.linear(hb, wt(W["router"]))
    sgate = np.ascontiguousarray(_c.linear(hb, wt(W["sh_expert_gate"]))[:, 0])
    ids, wts = _c.moe_route(logits, top_k, norm_topk_prob)
    shared = _c.linear(_c.linear_silu_mul(hb, wt(W["sh_gate"]), wt(W["sh_up"])), wt(W["sh_down"]))
    if S == 1:
        act = _c.experts_gate_up(hb[0], wt(W["gate"]), wt(W["up"]), ids[0])
        d = _c.experts_down(act, wt(W["down"]), ids[0], wts[0])
    else:
        d = _c.moe_experts(hb, ids, wts, wt(W["gate"]), wt(W["up"]), wt(W["down"]))
    return _c.moe_combine(np.zeros((S, H), np.float32), shared, sgate, d)


def moe_routing(h, W: dict, top_k, norm_topk_prob) -> np.ndarray:
    """The expert ids int32 [S, k] moe() routes h to (the same router product and routing kernel, deterministic)."""
    return _c.moe_route(_c.linear(bf16(h), wt(W["router"])), top_k, norm_topk_prob)[0]


def sample_draw(logits, uniform, **options):
    """DeviceSampler begin + draw, the engine's path."""
    return _c.sample_draw(_f32(logits), uniform, **options)

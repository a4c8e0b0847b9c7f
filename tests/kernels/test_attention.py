"""Attention family: the core between the projections (q/k norm, partial RoPE, KV append, causal GQA, sigmoid
gate) for S rows against a KV cache (S = 1: the decode step) on every backend against
lily.reference.attention.attention_core, at contexts off the tile sizes and odd head counts; then the Metal kernels
one by one: q/k prep, causal prefill attention, split-K decode attention (fp32 and bf16 caches), the mixer."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from kernel_inputs import Weight, kv_values, rel_tol
from ops_metal import attn_decode, attn_params, attn_prefill, attn_prep, gemm, gemv, rope_table
from lily.testing.tolerances import tol

from lily.quant import bf16_to_f32, f32_to_bf16, round_bf16
from lily.reference.attention import attention_core, attention_mixer
from lily.reference.linear import Weights
from lily.reference.ops import rms_norm, rope, sigmoid, softmax
from lily.testing import random_weights, tiny_configs

TOL = tol("op_vs_reference")["rel_rms"]
THETA = 1e7

CORE_SHAPES = [  # S, Hq, Hkv, D, pos0: decode rows (S = 1) and prefill rows around 64, contexts off the tiles
    (1, 4, 2, 64, 0), (1, 3, 1, 64, 300), (1, 16, 2, 256, 1000), (2, 5, 1, 32, 17), (63, 4, 2, 64, 0),
    (64, 3, 1, 32, 37), (65, 2, 1, 64, 100), (2, 16, 2, 256, 100)]


@pytest.mark.parametrize("S,Hq,Hkv,D,pos0", CORE_SHAPES)
def test_attention_core(backend, rng, S, Hq, Hkv, D, pos0):
    rd = D // 4
    qg = rng.standard_normal((S, Hq * 2 * D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv * D)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, D))).astype(np.float32)
    cap = pos0 + S + 3  # rows past the new ones must stay as they were
    # the past as the backend's cache holds it (bf16 on CUDA), so the reference attends to the same keys and values
    kc0 = kv_values(backend, rng.standard_normal((cap, Hkv * D)).astype(np.float32))
    vc0 = kv_values(backend, rng.standard_normal((cap, Hkv * D)).astype(np.float32))
    o, kc, vc = backend.attention(qg, k, v, qn, kn, kc0, vc0, pos0, Hq, Hkv, D, rd, THETA, 1e-6)
    ref_o, ref_k, _ = attention_core(qg, k, v, qn, kn, kc0[:pos0].reshape(pos0, Hkv, D),
                                     vc0[:pos0].reshape(pos0, Hkv, D), np.arange(pos0, pos0 + S), Hq, rd, THETA, 1e-6)
    name = f"{backend.NAME} attention S={S} Hq={Hq} Hkv={Hkv} D={D} pos0={pos0}"
    assert_close(name, o, ref_o, rel_tol(backend, "attention"))
    assert_close(name + " k cache", kc[pos0:pos0 + S], ref_k[pos0:].reshape(S, -1), rel_tol(backend, "kv"))
    np.testing.assert_array_equal(vc[pos0:pos0 + S], kv_values(backend, v))
    untouched = np.r_[0:pos0, pos0 + S:cap]
    np.testing.assert_array_equal(kc[untouched], kc0[untouched])
    np.testing.assert_array_equal(vc[untouched], vc0[untouched])


@pytest.mark.parametrize("S,Hq,Hkv,D", [(64, 4, 2, 64), (300, 16, 2, 256)])
def test_decode_row_equals_the_prefill_row(backend, rng, S, Hq, Hkv, D):
    """Prefill S rows then decode row S (the decode kernels on the prefill's cache) == the S+1 rows prefilled."""
    qg = rng.standard_normal((S + 1, Hq * 2 * D)).astype(np.float32)
    k = rng.standard_normal((S + 1, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((S + 1, Hkv * D)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, D))).astype(np.float32)
    cache = np.zeros((S + 1, Hkv * D), np.float32)
    args = (Hq, Hkv, D, D // 4, THETA, 1e-6)
    whole, _, _ = backend.attention(qg, k, v, qn, kn, cache, cache, 0, *args)
    _, kc, vc = backend.attention(qg[:S], k[:S], v[:S], qn, kn, cache, cache, 0, *args)
    last, _, _ = backend.attention(qg[S:], k[S:], v[S:], qn, kn, kc, vc, S, *args)
    assert_close(f"{backend.NAME} attention decode row {S} vs prefill D={D}", last, whole[S:], rel_tol(backend, "self"))


@pytest.mark.parametrize("S,Hq,Hkv,D,pos0", [(17, 4, 2, 128, 0), (5, 16, 2, 256, 130), (70, 3, 1, 64, 1000),
                                             (3, 8, 1, 72, 4100)])
def test_cpu_rows_are_one_row_calls_bit_for_bit(rng, S, Hq, Hkv, D, pos0):
    """The CPU kernel's key blocks are fixed by the key index alone (online softmax per (row, head), blocks of 64
    keys from key 0), so row t of an S-row call equals the one-row call at its position, bit for bit: the
    speculative verify and streams decoded together (Engine.step_streams) rely on it."""
    cpu = pytest.importorskip("ops_cpu")
    qg = rng.standard_normal((S, Hq * 2 * D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv * D)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, D))).astype(np.float32)
    kc = rng.standard_normal((pos0 + S, Hkv * D)).astype(np.float32)
    vc = rng.standard_normal((pos0 + S, Hkv * D)).astype(np.float32)
    args = (Hq, Hkv, D, D // 2, THETA, 1e-6)
    whole, kc_all, vc_all = cpu.attention(qg, k, v, qn, kn, kc, vc, pos0, *args)
    for t in range(S):
        row, kc, vc = cpu.attention(qg[t:t + 1], k[t:t + 1], v[t:t + 1], qn, kn, kc, vc, pos0 + t, *args)
        np.testing.assert_array_equal(row, whole[t:t + 1], err_msg=f"row {t}")
    np.testing.assert_array_equal(kc, kc_all)
    np.testing.assert_array_equal(vc, vc_all)


# ---- Metal: prep, prefill and split-K decode kernels one by one, and the mixer ----


@pytest.mark.parametrize("S,Hq,Hkv,D,pos0,kv", [(3, 4, 2, 64, 0, "f32"), (1, 3, 1, 64, 300, "f32"),
                                                (5, 2, 1, 32, 17, "f32"), (2, 16, 2, 256, 4000, "f32"),
                                                (3, 4, 2, 64, 9, "bf16"), (2, 16, 2, 256, 100, "bf16")])
def test_prep(rng, S, Hq, Hkv, D, pos0, kv):
    rd = D // 4
    qg = rng.standard_normal((S, Hq * 2 * D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv * D)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, D))).astype(np.float32)
    cap = pos0 + S + 3
    kc0 = rng.standard_normal((cap, Hkv * D)).astype(np.float32)
    vc0 = rng.standard_normal((cap, Hkv * D)).astype(np.float32)
    if kv == "bf16":  # caches hold bf16 bits; the kernel rounds K and V to nearest even
        kc0, vc0 = f32_to_bf16(kc0), f32_to_bf16(vc0)
    p = attn_params(Hq, Hkv, D, rd, THETA, pos0, S)
    q, kc, vc = attn_prep(qg, k, v, qn, kn, rope_table(rd, THETA), kc0, vc0, p)
    pos = np.arange(pos0, pos0 + S)
    ref_q = rope(rms_norm(qg.reshape(S, Hq, 2 * D)[..., :D], qn, 1e-6), pos, rd, THETA)
    ref_k = rope(rms_norm(k.reshape(S, Hkv, D), kn, 1e-6), pos, rd, THETA)
    assert_close(f"attn_prep q S={S} D={D} pos0={pos0}", q, ref_q.reshape(S, -1), TOL)
    if kv == "bf16":  # values agreeing to 1e-7 before rounding: equal bf16 bits, or one ulp apart at a tie edge
        got, want = bf16_to_f32(kc[pos0:pos0 + S]), round_bf16(ref_k.reshape(S, -1))
        same = np.mean(got == want)
        print(f"attn_prep k bf16 D={D} pos0={pos0}: {same:.4%} identical bf16 values")
        assert same > 0.99 and np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -7)
        np.testing.assert_array_equal(vc[pos0:pos0 + S], f32_to_bf16(v))
    else:
        assert_close(f"attn_prep k D={D} pos0={pos0}", kc[pos0:pos0 + S], ref_k.reshape(S, -1), TOL)
        np.testing.assert_array_equal(vc[pos0:pos0 + S], v)
    untouched = np.r_[0:pos0, pos0 + S:cap]
    np.testing.assert_array_equal(kc[untouched], kc0[untouched])
    np.testing.assert_array_equal(vc[untouched], vc0[untouched])


def _attn_ref(q, qg, kc, vc, Hq, Hkv, D, pos0):
    """q [S, Hq, D] (prepared), cache [T, Hkv, D] -> gated output [S, Hq*D]."""
    S = q.shape[0]
    G = Hq // Hkv
    out = np.zeros((S, Hq, D))
    for t in range(S):
        T = pos0 + t + 1
        for h in range(Hq):
            s = q[t, h] @ kc[:T, h // G].T * D ** -0.5
            out[t, h] = softmax(s) @ vc[:T, h // G]
    gate = qg.reshape(S, Hq, 2 * D)[..., D:]
    return (out * sigmoid(gate)).reshape(S, -1)


def _attn_inputs(rng, S, Hq, Hkv, D, pos0):
    T = pos0 + S
    q = rng.standard_normal((S, Hq, D)).astype(np.float32)
    qg = rng.standard_normal((S, Hq * 2 * D)).astype(np.float32)
    kc = rng.standard_normal((T + 2, Hkv, D)).astype(np.float32)
    vc = rng.standard_normal((T + 2, Hkv, D)).astype(np.float32)
    return q, qg, kc, vc


def _cache(c, kv):
    """(cache as the kernel sees it, the values the reference must use)."""
    flat = c.reshape(len(c), -1)
    return (f32_to_bf16(flat), round_bf16(c)) if kv == "bf16" else (flat, c)


@pytest.mark.parametrize("S,Hq,Hkv,D,pos0,kv", [(1, 4, 2, 64, 0, "f32"), (6, 3, 1, 64, 9, "f32"),
                                                (5, 2, 1, 32, 0, "f32"), (3, 16, 2, 256, 40, "f32"),
                                                (6, 3, 1, 64, 9, "bf16"), (3, 16, 2, 256, 40, "bf16")])
def test_prefill(rng, S, Hq, Hkv, D, pos0, kv):
    q, qg, kc, vc = _attn_inputs(rng, S, Hq, Hkv, D, pos0)
    (kd, kr), (vd, vr) = _cache(kc, kv), _cache(vc, kv)
    p = attn_params(Hq, Hkv, D, D // 4, THETA, pos0, S)
    out = attn_prefill(q.reshape(S, -1), qg, kd, vd, p)
    assert_close(f"attn_prefill S={S} Hq={Hq} D={D} pos0={pos0} kv={kv}", out,
                 _attn_ref(q, qg, kr, vr, Hq, Hkv, D, pos0), TOL)


@pytest.mark.parametrize("Hq,Hkv,D,pos0,split,kv", [(4, 2, 64, 0, 32, "f32"), (3, 1, 64, 99, 32, "f32"),
                                                    (2, 1, 32, 70, 16, "f32"), (16, 2, 256, 130, 64, "f32"),
                                                    (3, 1, 64, 99, 32, "bf16"), (16, 2, 256, 130, 64, "bf16")])
def test_decode_split_k(rng, Hq, Hkv, D, pos0, split, kv):
    q, qg, kc, vc = _attn_inputs(rng, 1, Hq, Hkv, D, pos0)
    (kd, kr), (vd, vr) = _cache(kc, kv), _cache(vc, kv)
    p = attn_params(Hq, Hkv, D, D // 4, THETA, pos0, 1)
    out = attn_decode(q.reshape(1, -1), qg, kd, vd, p, split_len=split)
    assert_close(f"attn_decode Hq={Hq} D={D} T={pos0 + 1} split={split} kv={kv}", out,
                 _attn_ref(q, qg, kr, vr, Hq, Hkv, D, pos0), TOL)


@pytest.mark.parametrize("name,S,pos0", [("tiny", 7, 5), ("tiny_dk_ne_dv", 1, 12), ("tiny_odd", 3, 0)])
def test_attention_mixer_vs_reference(rng, name, S, pos0):
    """Projections + prep + attention + o_proj against the reference mixer, with a cache already holding
    pos0 rows (prefill for S > 1, split-K decode for S == 1)."""
    cfg = tiny_configs()[name]
    layer = 3
    tensors, quant = random_weights(cfg, seed=11)
    ref_w = Weights(tensors, quant)
    pre = f"model.layers.{layer}.self_attn"
    W = {m: Weight.from_tensors(tensors, quant, f"{pre}.{m}") for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    kc0 = rng.standard_normal((pos0, Hkv, D)).astype(np.float32)
    vc0 = rng.standard_normal((pos0, Hkv, D)).astype(np.float32)
    ref_out, ref_k, ref_v = attention_mixer(h, ref_w, layer, cfg, kc0, vc0, np.arange(pos0, pos0 + S))
    cap = pos0 + S + 1
    kc = np.zeros((cap, Hkv * D), np.float32)
    vc = np.zeros((cap, Hkv * D), np.float32)
    kc[:pos0], vc[:pos0] = kc0.reshape(pos0, Hkv * D), vc0.reshape(pos0, Hkv * D)
    lin = gemv if S == 1 else gemm
    qg, k, v = (lin(W[m], h) for m in ("q_proj", "k_proj", "v_proj"))
    p = attn_params(Hq, Hkv, D, cfg.rotary_dim, cfg.rope_theta, pos0, S)
    q, kc, vc = attn_prep(qg, k, v, ref_w.vec(pre + ".q_norm.weight"), ref_w.vec(pre + ".k_norm.weight"),
                          rope_table(cfg.rotary_dim, cfg.rope_theta), kc, vc, p)
    o = attn_decode(q, qg, kc, vc, p, split_len=8) if S == 1 else attn_prefill(q, qg, kc, vc, p)
    x0 = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    out = lin(W["o_proj"], o, x0) if S == 1 else gemm(W["o_proj"], o, y0=x0)
    assert_close(f"attention mixer {name} S={S} pos0={pos0}", out - x0, ref_out, TOL)
    assert_close(f"attention k cache {name}", kc[:pos0 + S], ref_k.reshape(pos0 + S, -1), TOL)

"""DeltaNet family: the core between the projections (conv + SiLU, q/k l2 norm, gates, recurrence, gated norm)
for S rows with its conv and recurrent state in and out, on every backend against lily.reference.deltanet.deltanet_core,
and run in two chunks against one; then the Metal kernels one by one: causal conv, the register-resident
recurrence (plain and with the fused gated RMSNorm), the gated norm, and the whole mixer. Dk != Dv throughout
but once (a transposed state would pass with Dk == Dv)."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from kernel_inputs import Weight, rel_tol
import ops_metal as mtl  # the Metal kernels by name (their names are the reference functions' too)
from ops_metal import deltanet_params, gemm
from lily.testing.tolerances import tol

from lily.reference.deltanet import causal_conv, deltanet_core, deltanet_mixer, deltanet_scan
from lily.reference.linear import Weights
from lily.reference.ops import rms_norm, silu
from lily.testing import random_weights, tiny_configs

TOL = tol("op_vs_reference")["rel_rms"]
SELF_TOL = tol("self_consistency")["rel_rms"]


def _core_inputs(rng, S, K, Hk, Hv, Dk, Dv):
    """(qkv [S, C], z [S, Hv*Dv], b, a [S, Hv], conv_w [C, K], dt_bias, a_log [Hv], norm_w [Dv],
    conv_state [K-1, C], ssm [Hv, Dv, Dk])."""
    C = 2 * Hk * Dk + Hv * Dv
    f = np.float32
    return (rng.standard_normal((S, C)).astype(f), rng.standard_normal((S, Hv * Dv)).astype(f),
            rng.standard_normal((S, Hv)).astype(f), rng.standard_normal((S, Hv)).astype(f),
            (rng.uniform(-1, 1, (C, K)) * K ** -0.5).astype(f), rng.uniform(-1, 1, Hv).astype(f),
            np.log(rng.uniform(0.5, 8.0, Hv)).astype(f), (1 + 0.1 * rng.standard_normal(Dv)).astype(f),
            rng.standard_normal((K - 1, C)).astype(f), (rng.standard_normal((Hv, Dv, Dk)) * 0.1).astype(f))


CORE_SHAPES = [  # S, K, Hk, Hv, Dk, Dv: one row (decode), prefill rows around 64, odd head counts, Dk != Dv
    (1, 4, 2, 4, 32, 48), (2, 4, 2, 6, 48, 32), (63, 3, 1, 5, 16, 40), (64, 4, 1, 3, 64, 32),
    (65, 4, 2, 4, 32, 48), (2, 4, 1, 2, 128, 128)]


@pytest.mark.parametrize("S,K,Hk,Hv,Dk,Dv", CORE_SHAPES)
def test_deltanet_core(backend, rng, S, K, Hk, Hv, Dk, Dv):
    args = _core_inputs(rng, S, K, Hk, Hv, Dk, Dv)
    y, conv1, ssm1 = backend.deltanet(*args, Hk, 1e-6)
    ref_y, ref_conv, ref_ssm = deltanet_core(*args, Hk, 1e-6)
    name = f"{backend.NAME} deltanet S={S} K={K} Hv={Hv} Dk={Dk} Dv={Dv}"
    assert_close(name, y, ref_y, rel_tol(backend, "deltanet"))
    assert_close(name + " state", ssm1, ref_ssm, rel_tol(backend, "deltanet_state"))
    np.testing.assert_array_equal(conv1, ref_conv)  # the last K-1 input rows, copied


@pytest.mark.parametrize("S,split", [(65, 64), (9, 1)])
def test_deltanet_chunks_carry_the_state(backend, rng, S, split):
    """Rows [0, split) then [split, S) with the state carried between them == all S rows at once."""
    qkv, z, b, a, conv_w, dt_bias, a_log, norm_w, conv0, ssm0 = _core_inputs(rng, S, 4, 2, 4, 32, 48)
    whole = backend.deltanet(qkv, z, b, a, conv_w, dt_bias, a_log, norm_w, conv0, ssm0, 2, 1e-6)
    rows = [slice(0, split), slice(split, S)]
    y0, conv1, ssm1 = backend.deltanet(*(t[rows[0]] for t in (qkv, z, b, a)), conv_w, dt_bias, a_log, norm_w,
                                       conv0, ssm0, 2, 1e-6)
    y1, conv2, ssm2 = backend.deltanet(*(t[rows[1]] for t in (qkv, z, b, a)), conv_w, dt_bias, a_log, norm_w,
                                       conv1, ssm1, 2, 1e-6)
    self_tol = rel_tol(backend, "self")
    assert_close(f"{backend.NAME} deltanet {split}+{S - split} rows", np.concatenate([y0, y1]), whole[0], self_tol)
    assert_close(f"{backend.NAME} deltanet {split}+{S - split} state", ssm2, whole[2], self_tol)
    np.testing.assert_array_equal(conv2, whole[1])


# ---- Metal: conv, scan (unfused + gated norm, and fused), and the mixer, kernel by kernel ----


@pytest.mark.parametrize("S,K,Hk,Hv,Dk,Dv", [(1, 4, 2, 4, 32, 32), (2, 4, 2, 6, 48, 32), (7, 3, 1, 5, 16, 32)])
def test_conv(rng, S, K, Hk, Hv, Dk, Dv):
    C = 2 * Hk * Dk + Hv * Dv
    qkv = rng.standard_normal((S, C)).astype(np.float32)
    w = (rng.uniform(-1, 1, (C, K)) * K ** -0.5).astype(np.float32)
    st0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    u, st = mtl.deltanet_conv(qkv, w, st0, deltanet_params(Hk, Hv, Dk, Dv, K, S))
    ref, ref_st = causal_conv(qkv, st0, w)
    assert_close(f"deltanet_conv S={S} K={K} C={C}", u, silu(ref), TOL)
    np.testing.assert_array_equal(st, ref_st)


def _scan_inputs(rng, S, Hk, Hv, Dk, Dv):
    C = 2 * Hk * Dk + Hv * Dv
    u = silu(rng.standard_normal((S, C))).astype(np.float32)
    b = rng.standard_normal((S, Hv)).astype(np.float32)
    a = rng.standard_normal((S, Hv)).astype(np.float32)
    a_log = np.log(rng.uniform(0.5, 8.0, Hv)).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, Hv).astype(np.float32)
    state = (rng.standard_normal((Hv, Dv, Dk)) * 0.1).astype(np.float32)
    return u, b, a, a_log, dt_bias, state


SHAPES = [(1, 2, 4, 32, 32), (5, 2, 6, 48, 32), (3, 1, 5, 16, 32), (2, 1, 2, 128, 40)]


@pytest.mark.parametrize("S,Hk,Hv,Dk,Dv", SHAPES)
def test_scan(rng, S, Hk, Hv, Dk, Dv):
    u, b, a, a_log, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    p = deltanet_params(Hk, Hv, Dk, Dv, 4, S)
    o, st = mtl.deltanet_scan(u, b, a, a_log, dt_bias, state, p)
    ref_o, ref_st = deltanet_scan(u, b, a, a_log, dt_bias, state, Hk)
    assert_close(f"deltanet_scan S={S} Hv={Hv} Dk={Dk} Dv={Dv}", o, ref_o.reshape(S, -1), TOL)
    assert_close(f"deltanet_scan state Dk={Dk} Dv={Dv}", st, ref_st, TOL)
    # the unfused gated norm on the scan output
    z = rng.standard_normal((S, Hv * Dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(Dv)).astype(np.float32)
    y = mtl.deltanet_gated_norm(o, z, w, p)
    ref_y = rms_norm(ref_o, w, 1e-6) * silu(z.reshape(S, Hv, Dv))
    assert_close(f"deltanet_gated_norm Dv={Dv}", y, ref_y.reshape(S, -1), TOL)


@pytest.mark.parametrize("S,Hk,Hv,Dk,Dv", SHAPES)
def test_scan_fused_norm(rng, S, Hk, Hv, Dk, Dv):
    u, b, a, a_log, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    z = rng.standard_normal((S, Hv * Dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(Dv)).astype(np.float32)
    y, st = mtl.deltanet_scan(u, b, a, a_log, dt_bias, state, deltanet_params(Hk, Hv, Dk, Dv, 4, S), z=z, norm_w=w, fuse=True)
    ref_o, ref_st = deltanet_scan(u, b, a, a_log, dt_bias, state, Hk)
    ref_y = rms_norm(ref_o, w, 1e-6) * silu(z.reshape(S, Hv, Dv))
    assert_close(f"deltanet_scan_norm S={S} Dk={Dk} Dv={Dv}", y, ref_y.reshape(S, -1), TOL)
    assert_close(f"deltanet_scan_norm state Dk={Dk} Dv={Dv}", st, ref_st, TOL)


@pytest.mark.parametrize("name,S", [("tiny_dk_ne_dv", 6), ("tiny_odd", 1)])
def test_deltanet_mixer_vs_reference(rng, name, S):
    """Projections (GEMM) + conv + scan (fused norm) + out_proj, state carried in and out."""
    cfg = tiny_configs()[name]
    tensors, quant = random_weights(cfg, seed=5)
    ref_w = Weights(tensors, quant)
    pre = "model.layers.0.linear_attn"
    W = {m: Weight.from_tensors(tensors, quant, f"{pre}.{m}") for m in
         ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    h = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    conv0 = rng.standard_normal((K - 1, cfg.conv_dim)).astype(np.float32)
    rec0 = (rng.standard_normal((Hv, Dv, Dk)) * 0.1).astype(np.float32)
    p = deltanet_params(Hk, Hv, Dk, Dv, K, S)
    qkv, z, b, a = (gemm(W[m], h) for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    u, conv1 = mtl.deltanet_conv(qkv, ref_w.vec(pre + ".conv1d.weight").reshape(cfg.conv_dim, K), conv0, p)
    y, rec1 = mtl.deltanet_scan(u, b, a, ref_w.vec(pre + ".A_log"), ref_w.vec(pre + ".dt_bias"), rec0, p, z=z,
                       norm_w=ref_w.vec(pre + ".norm.weight"), fuse=True)
    out = gemm(W["out_proj"], y)
    ref_out, ref_conv, ref_rec = deltanet_mixer(h, ref_w, 0, cfg, conv0, rec0)
    assert_close(f"deltanet mixer {name} S={S}", out, ref_out, TOL)
    assert_close(f"deltanet conv state {name}", conv1, ref_conv, TOL)
    assert_close(f"deltanet rec state {name}", rec1, ref_rec, TOL)

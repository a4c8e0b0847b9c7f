"""CUDA Gated DeltaNet (csrc/cuda/deltanet*.cu) one launch at a time against lily.reference.deltanet: the causal conv
with the fused q/k l2 norm (float4 path and channel-per-thread path), the gated norm, the one-token step with its fused
norm (launched twice on the same head counters, as a recorded graph replays it), and every prefill scan form
(sequential with 8 or 16 lanes per row, chunked, auto) plain and with the gated norm (fused into the chunked form's
output kernel, or the scan then the norm). Dk != Dv throughout but for the real heads (a transposed state would pass
with Dk == Dv); odd head counts, row counts around the chunk of 64, zero and non-zero incoming states.

Tolerances (KERNEL_CHECKS): fp32 outputs of short chains (conv + l2 norm, the step's y and state): small_fp32_rel_rms
1e-5; bf16 outputs (gated norm, the step's out): one rounding; the conv state: the input rows, bit for bit. Prefill
scans (rel RMS of y and of the final state): sequential deltanet_seq_rel_rms 1e-4 (an exact fp32 recurrence, each step
contracting the state: expected ~1e-6); chunked deltanet_chunk_rel_rms 4e-3 (Gram and state products on TF32 operands,
2^-11: ~3e-4 per product, contracted by the decays; at S = 1 one or two products per output, measured 3.2e-3 on the
H200 with Dk 32 / Dv 40 on a zero state); with the norm, the chunked y error then out's bf16 rounding:
deltanet_chunk_norm_rel_rms 6e-3 (the sequential form: the rounding alone, small_bf16_rel_rms)."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close, rel_rms
from cuda_checks import KC, assert_bf16_close, vals

from lily.reference.deltanet import causal_conv, deltanet_scan, gated_delta_recurrence, gated_rms_norm
from lily.reference.ops import sigmoid, silu, softplus


def _l2_heads(u, Hk, Dk):
    """u [S, C] post-conv SiLU -> q (times Dk^-0.5) and k l2-normalised per head, as the conv kernel leaves them."""
    u = u.copy()
    for hh in range(2 * Hk):
        x = u[:, hh * Dk:(hh + 1) * Dk]
        x /= np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
        if hh < Hk:
            x *= Dk ** -0.5
    return u


# Hk, Hv, Dk, Dv, K, S, misalign (1 qkv / 2 conv state / 3 u one float past a 16-byte boundary). 16 rows a thread,
# loaded 4 at a time: every S but 4096 ends in a partial row block. Fused path (float4 channels + l2 norm; C % 4 == 0,
# 128 % Dk == 0, Dk % 4 == 0, aligned): the real heads at every S; 16-, 8-, 4- and 1-lane heads, partial last warps,
# the generic kernel size (K 5). Channel-per-thread path + the separate l2 norm: Dk 96 or 40, C not a multiple of 4,
# and the real shape misaligned.
CONV = [(16, 32, 128, 128, 4, S, 0) for S in (1, 2, 37, 100, 4096)] + [
    (3, 6, 64, 96, 4, 37, 0), (4, 8, 64, 64, 2, 17, 0), (2, 3, 32, 48, 3, 65, 0), (1, 2, 32, 24, 5, 40, 0),
    (2, 3, 16, 20, 4, 33, 0), (3, 2, 4, 6, 4, 7, 0), (1, 5, 96, 64, 4, 1, 0), (2, 2, 40, 17, 2, 37, 0),
    (2, 3, 32, 17, 4, 20, 0), (2, 2, 96, 10, 3, 18, 0), (1, 2, 40, 24, 5, 19, 0)] + [
    (16, 32, 128, 128, 4, 37, m) for m in (1, 2, 3)]


@pytest.mark.parametrize("Hk,Hv,Dk,Dv,K,S,misalign", CONV)
def test_conv(cuda, rng, Hk, Hv, Dk, Dv, K, S, misalign):
    C = 2 * Hk * Dk + Hv * Dv
    qkv = rng.standard_normal((S, C)).astype(np.float32)
    w = rng.uniform(-0.6, 0.6, (C, K)).astype(np.float32)
    st0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    u, st = cuda.deltanet_conv(qkv, w, st0, Hk, Dk, Hv, Dv, misalign=misalign)
    conv, ref_st = causal_conv(qkv.astype(np.float64), st0.astype(np.float64), w.astype(np.float64))
    tag = f"cuda deltanet_conv Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} K={K} S={S} misalign={misalign}"
    assert_close(tag, u, _l2_heads(silu(conv.astype(np.float64)), Hk, Dk), KC["small_fp32_rel_rms"])
    np.testing.assert_array_equal(st, ref_st.astype(np.float32), err_msg=tag + " state (the last K-1 input rows)")


@pytest.mark.parametrize("Hv,Dv,S", [(32, 128, 1), (32, 128, 37), (6, 96, 37), (3, 64, 5), (1, 40, 3), (5, 200, 2)])
def test_gated_norm(cuda, rng, Hv, Dv, S):
    y = (rng.standard_normal((S, Hv * Dv)) * 0.5).astype(np.float32)
    z = (rng.standard_normal((S, Hv * Dv)) * 1.5).astype(np.float32)
    w = rng.uniform(0.3, 1.5, Dv).astype(np.float32)
    ref = gated_rms_norm(y.reshape(S, Hv, Dv), z.reshape(S, Hv, Dv), w, 1e-6).reshape(S, -1)
    assert_bf16_close(f"cuda deltanet_gated_norm Hv={Hv} Dv={Dv} S={S}", cuda.deltanet_gated_norm(y, z, w), ref)


# Hk, Hv, Dk, Dv, zero state: the real heads; Dk != Dv; Dk not a multiple of 32; odd head counts; Dv not a multiple of
# the 4 rows a block (17, 97, 1: a head's last block holds idle warps), Dv 200 and 256.
@pytest.mark.parametrize("Hk,Hv,Dk,Dv,zero", [
    (16, 32, 128, 128, False), (16, 32, 128, 128, True), (3, 6, 64, 96, False), (1, 5, 96, 64, False),
    (2, 4, 100, 40, False), (2, 2, 32, 17, False), (1, 3, 128, 97, False), (2, 2, 64, 200, False),
    (1, 1, 128, 256, False), (1, 2, 16, 1, False)])
def test_step(cuda, rng, Hk, Hv, Dk, Dv, zero):
    """One token: the l2 norm of q, k fused in, the gated delta rule, the gated norm fused in."""
    C = 2 * Hk * Dk + Hv * Dv
    u = silu(rng.standard_normal(C) * 1.5).astype(np.float32)  # post-conv, q and k not normalised
    b, a = rng.uniform(-4, 4, Hv).astype(np.float32), rng.uniform(-3, 0.5, Hv).astype(np.float32)
    dtb, alog = rng.uniform(-1, 0.5, Hv).astype(np.float32), rng.uniform(-1.5, 0, Hv).astype(np.float32)
    z = (rng.standard_normal(Hv * Dv) * 1.5).astype(np.float32)
    w = rng.uniform(0.3, 1.5, Dv).astype(np.float32)
    ssm0 = np.zeros((Hv, Dv, Dk), np.float32) if zero else rng.uniform(-0.5, 0.5, (Hv, Dv, Dk)).astype(np.float32)
    ref_o, ref_st = deltanet_scan(u[None].astype(np.float64), b[None], a[None], alog, dtb, ssm0.astype(np.float64), Hk)
    ref_out = gated_rms_norm(ref_o, z.reshape(1, Hv, Dv), w, 1e-6).reshape(-1)
    tag = f"cuda deltanet_step Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}{' zero state' if zero else ''}"
    done = np.zeros(Hv, np.int32)
    for launch in ("", " (again)"):  # the same counters: every launch must leave them at zero for the next
        y, out, st, done = cuda.deltanet_step(u, b, a, dtb, alog, ssm0, z, w, done, Hk)
        assert_close(tag + " y" + launch, y, ref_o.reshape(-1), KC["small_fp32_rel_rms"])
        assert_close(tag + " state" + launch, st, ref_st, KC["small_fp32_rel_rms"])
        assert_bf16_close(tag + " gated out" + launch, out, ref_out)
        np.testing.assert_array_equal(done, np.zeros(Hv, np.int32), err_msg=tag + " head counters" + launch)


# Hk, Hv, Dk, Dv, M: the real heads at the verify's row counts, Dk != Dv, Dk not a multiple of 32, Dv not a multiple
# of a block's 4 rows, one row, a one-element head
@pytest.mark.parametrize("Hk,Hv,Dk,Dv,M", [
    (16, 32, 128, 128, 4), (16, 32, 128, 128, 8), (3, 6, 64, 96, 5), (1, 5, 96, 64, 1), (2, 2, 32, 17, 3),
    (1, 3, 128, 97, 2), (1, 2, 16, 1, 7)])
def test_step_rows(cuda, rng, Hk, Hv, Dk, Dv, M):
    """M tokens in one launch (the speculative verify's DeltaNet): row t equals the one-token step on the state after
    row t - 1, bit for bit (y, the gated output and the state kept after each row: the roll-back slots), the launch
    leaves the last row's state, and all of it is within the fp64 scan's bound."""
    C = 2 * Hk * Dk + Hv * Dv
    u = silu(rng.standard_normal((M, C)) * 1.5).astype(np.float32)
    b, a = rng.uniform(-4, 4, (M, Hv)).astype(np.float32), rng.uniform(-3, 0.5, (M, Hv)).astype(np.float32)
    dtb, alog = rng.uniform(-1, 0.5, Hv).astype(np.float32), rng.uniform(-1.5, 0, Hv).astype(np.float32)
    z = (rng.standard_normal((M, Hv * Dv)) * 1.5).astype(np.float32)
    w = rng.uniform(0.3, 1.5, Dv).astype(np.float32)
    ssm0 = rng.uniform(-0.5, 0.5, (Hv, Dv, Dk)).astype(np.float32)
    tag = f"cuda deltanet_step_rows Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} M={M}"
    y, out, st, done, rows = cuda.deltanet_step_rows(u, b, a, dtb, alog, ssm0, z, w, np.zeros(Hv, np.int32), Hk)
    np.testing.assert_array_equal(done, np.zeros(Hv, np.int32), err_msg=tag + " head counters")
    s = ssm0
    for t in range(M):
        y1, o1, s, _ = cuda.deltanet_step(u[t], b[t], a[t], dtb, alog, s, z[t], w, np.zeros(Hv, np.int32), Hk)
        np.testing.assert_array_equal(y[t].view(np.uint32), y1.view(np.uint32), err_msg=f"{tag} row {t} y")
        np.testing.assert_array_equal(out[t], o1, err_msg=f"{tag} row {t} gated out")
        np.testing.assert_array_equal(rows[t].view(np.uint32), s.view(np.uint32), err_msg=f"{tag} state after row {t}")
    np.testing.assert_array_equal(st.view(np.uint32), s.view(np.uint32), err_msg=tag + " last state")
    ref_o, ref_st = deltanet_scan(u.astype(np.float64), b, a, alog, dtb, ssm0.astype(np.float64), Hk)
    assert_close(tag + " y", y, ref_o.reshape(M, -1), KC["small_fp32_rel_rms"])
    assert_close(tag + " state", st, ref_st, KC["small_fp32_rel_rms"])
    assert_bf16_close(tag + " gated out", out, gated_rms_norm(ref_o, z.reshape(M, Hv, Dv), w, 1e-6).reshape(M, -1))


def _scan_inputs(rng, S, Hk, Hv, Dk, Dv, correlated, qk_aligned, nonzero):
    """u [S, C] with q, k l2-normalised (q times Dk^-0.5) as the conv kernel leaves them, v in [-1, 1]; b in [-4, 4]
    (beta in (0.02, 0.98)), a_log in [-1.5, 0], a + dt_bias in [-4, 1] (g in about (0.27, 1)); state 0 or in +-0.5.
    correlated: keys = a shared direction + 0.3 noise (stresses the chunked form's (I + A) solve). qk_aligned: each q
    head towards its k head, so q.k is not near zero (one token on a zero state gives y = beta v (q.k): a q.k near zero
    would make y's rel RMS the relative error of a cancelled sum)."""
    C, kd = 2 * Hk * Dk + Hv * Dv, Hk * Dk
    u = rng.uniform(-1, 1, (S, C))
    if qk_aligned:
        u[:, :kd] = u[:, kd:2 * kd] + 0.5 * u[:, :kd]
    if correlated:
        u[:, kd:2 * kd] = rng.uniform(-1, 1, kd)[None, :] + 0.3 * u[:, kd:2 * kd]
    u = _l2_heads(u, Hk, Dk).astype(np.float32)
    return (u, rng.uniform(-4, 4, (S, Hv)).astype(np.float32), rng.uniform(-3, 0.5, (S, Hv)).astype(np.float32),
            rng.uniform(-1, 0.5, Hv).astype(np.float32), rng.uniform(-1.5, 0, Hv).astype(np.float32),
            (rng.uniform(-0.5, 0.5, (Hv, Dv, Dk)) if nonzero else np.zeros((Hv, Dv, Dk))).astype(np.float32))


def _scan_reference(u, b, a, dtb, alog, ssm0, Hk):
    """The recurrence of lily.reference on u's already normalised q, k (deltanet_scan would normalise them again), in
    fp64: (y [S, Hv, Dv], state [Hv, Dv, Dk])."""
    S, (Hv, Dv, Dk) = u.shape[0], ssm0.shape
    kd = Hk * Dk
    f = u.astype(np.float64)
    g = np.exp(-np.exp(alog.astype(np.float64))[None, :] * softplus(a.astype(np.float64) + dtb[None, :]))
    return gated_delta_recurrence(f[:, :kd].reshape(S, Hk, Dk), f[:, kd:2 * kd].reshape(S, Hk, Dk),
                                  f[:, 2 * kd:].reshape(S, Hv, Dv), g, sigmoid(b.astype(np.float64)),
                                  ssm0.astype(np.float64))


# name, Hk, Hv, Dk, Dv, S, correlated keys, q aligned with k: the real heads around the chunk of 64 and a 2,048-row
# chunk; Dk != Dv; odd head counts; Dk and Dv not multiples of 32; Dv past kScanNormMaxDv (+norm: the scan, then the
# norm); one token on a zero state.
SCANS = [("real_S1", 16, 32, 128, 128, 1, False, False), ("real_S2", 16, 32, 128, 128, 2, False, False),
         ("real_S63", 16, 32, 128, 128, 63, False, False), ("real_S65", 16, 32, 128, 128, 65, False, False),
         ("real_S130", 16, 32, 128, 128, 130, False, False), ("real_S2048", 16, 32, 128, 128, 2048, False, False),
         ("real_corr_S200", 16, 32, 128, 128, 200, True, False), ("dk64_dv96_S65", 2, 4, 64, 96, 65, False, False),
         ("dk64_dv96_S130", 2, 4, 64, 96, 130, False, False), ("odd_h3_S63", 3, 3, 128, 128, 63, False, False),
         ("odd_h3v9_S130", 3, 9, 64, 96, 130, False, False), ("dk100_dv70_S129", 1, 2, 100, 70, 129, False, False),
         ("dk32_dv40_S1", 1, 1, 32, 40, 1, False, True), ("dk32_dv40_corr_S300", 1, 3, 32, 40, 300, True, False),
         ("dk128_dv33_S64", 1, 1, 128, 33, 64, False, False), ("dk64_dv160_S130", 1, 2, 64, 160, 130, False, False)]
SEQ8, SEQ16, CHUNK, AUTO = range(4)  # cuda_ops.deltanet_scan variants
NORM_CHUNK, NORM_AUTO, NORM_SEQ, NORM_SPLIT = range(4)  # cuda_ops.deltanet_scan_norm variants


@pytest.mark.parametrize("nonzero", [False, True], ids=["zero_state", "state"])
@pytest.mark.parametrize("name,Hk,Hv,Dk,Dv,S,corr,aligned", SCANS, ids=[s[0] for s in SCANS])
def test_scan_forms(cuda, rng, name, Hk, Hv, Dk, Dv, S, corr, aligned, nonzero):
    """Every prefill form on the same inputs, y and the state poisoned / read back, against the fp64 recurrence; then
    each with the gated norm (z ~ N(0, 1.5), w in [0.3, 1.5]) against lily.reference's gated norm of that y."""
    if S > 300 and not nonzero:
        pytest.skip("the 2,048-row chunk runs with a non-zero incoming state only")
    args = _scan_inputs(rng, S, Hk, Hv, Dk, Dv, corr, aligned, nonzero)
    ref_y, ref_st = _scan_reference(*args, Hk)
    chunk_at_s = cuda.deltanet_scan_pick(S) == 2
    errors = []

    def check(tag, got, ref, bound):
        err = rel_rms(got, ref) if np.all(np.isfinite(got)) else np.inf
        print(f"{tag:60s} rel_rms {err:.3e} (bound {bound:.0e})")
        if not err <= bound:
            errors.append(f"{tag}: rel_rms {err:.3e} > {bound:.0e}")

    for v, form in ((SEQ8, "seq8"), (SEQ16, "seq16"), (CHUNK, "chunk"), (AUTO, "auto")):
        y, st = cuda.deltanet_scan(*args, Hk, v)
        chunked = v == CHUNK or (v == AUTO and chunk_at_s)
        bound = KC["deltanet_chunk_rel_rms" if chunked else "deltanet_seq_rel_rms"]
        check(f"cuda deltanet_scan {name} {form}", y, ref_y.reshape(S, -1), bound)
        check(f"cuda deltanet_scan {name} {form} state", st, ref_st, bound)
    z = (rng.standard_normal((S, Hv * Dv)) * 1.5).astype(np.float32)
    w = rng.uniform(0.3, 1.5, Dv).astype(np.float32)
    ref_out = gated_rms_norm(ref_y, z.reshape(S, Hv, Dv), w, 1e-6).reshape(S, -1)
    for v, form in ((NORM_CHUNK, "chunk+norm"), (NORM_AUTO, "auto+norm"), (NORM_SEQ, "seq+norm"),
                    (NORM_SPLIT, "chunk,gated_norm")):
        out, st = cuda.deltanet_scan_norm(*args[:5], z, w, args[5], Hk, v)
        chunked = v in (NORM_CHUNK, NORM_SPLIT) or (v == NORM_AUTO and chunk_at_s)
        check(f"cuda deltanet_scan_norm {name} {form}", vals(out), ref_out,
              KC["deltanet_chunk_norm_rel_rms" if chunked else "small_bf16_rel_rms"])
        check(f"cuda deltanet_scan_norm {name} {form} state", st, ref_st,
              KC["deltanet_chunk_rel_rms" if chunked else "deltanet_seq_rel_rms"])
    assert not errors, "; ".join(errors)

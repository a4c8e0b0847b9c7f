"""The CUDA decode GEMV (csrc/cuda/gemv*.cu: every projection of the fused decode step) one launch at a time against
fp64 products of lily.quant's dequantized weights: random MLX 4-bit and 8-bit weights (groups 64, 128, 256) and
dense bf16 ones; segments that share one input row (store, accumulate, SiLU(gate) * up) and mix formats (the MoE
entry: 8-bit router + 4-bit shared gate/up); the RMSNorm staging of the residual, the routing prologue (softmax top-k,
each slot reading its expert), the greedy head's block argmax, the DeltaNet in-projection's conv epilogue, the MoE down
with the combine; and the launches the kernel refuses.

Tolerances (KERNEL_CHECKS): fp32 dequantised weights and fp32 accumulation, the codes' constant part subtracted per
32-element unit (up to ~2^-13 relative a unit): gemv_rel_rms 1e-4; SiLU(gate) * up rounded to bf16: gemv_dual_rel_rms
8e-3; the outputs of a staged RMSNorm row: gemv_staged_rel_rms 5e-4 (an element near a bf16 rounding boundary may round
the other way than the fp64 twin's: ~1e-4 of a 2,048-term dot each); routing weights small_fp32_rel_rms."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from cuda_checks import KC, RawWeight, bits, silu, vals

STORE, ACCUM, DUAL, CONV = 0, 1, 2, 3  # gemv::OMode
NORM = 1  # gemv::XMode: RMSNorm of the fp32 residual (0: a bf16 row)


def _w(rng, nbits, out, inp, group=64, experts=0):
    return RawWeight(rng, nbits, out, inp, experts=experts, group=group if nbits != 16 else 0, kind="gemv")


# tag, in, outputs per segment, mode, bits per segment (16: dense bf16; default 4), group
PROJ = [("store", 2048, [8192, 4096, 32, 32], STORE, [], 64), ("store", 64, [1, 17], STORE, [], 64),
        ("store", 192, [33], STORE, [], 64), ("accum", 4096, [2048], ACCUM, [], 64), ("accum", 576, [5], ACCUM, [], 64),
        ("dual", 2048, [512], DUAL, [], 64), ("dual", 128, [7, 16], DUAL, [], 64),
        ("store", 512, [1, 17, 40], STORE, [], 64), ("dual", 1024, [3, 40], DUAL, [], 64),
        ("accum", 1536, [31], ACCUM, [], 64),
        ("router+gate", 2048, [256, 1], STORE, [8, 8], 64), ("router", 2048, [256], STORE, [8], 64),
        ("moe_entry", 2048, [256, 512, 1], STORE, [8, 4, 8], 64), ("store", 128, [5, 3], STORE, [8, 16], 64),
        ("dense", 160, [128, 7], STORE, [16, 16], 64), ("dense", 96, [128], ACCUM, [16], 64),
        ("dense", 96, [9], DUAL, [16], 64),
        ("longest_in", 8192, [33], STORE, [], 64),  # 8 slices
        ("head_like", 2048, [248320 // 16 + 3], STORE, [], 64),  # many tiles per warp
        ("g128", 2048, [300, 7], STORE, [4, 4], 128), ("g128", 256, [9], DUAL, [], 128),  # two lanes' groups share one
        ("g256", 1024, [33, 5], STORE, [4, 8], 256)]


@pytest.mark.parametrize("tag,inp,outs,mode,nbits,group", PROJ,
                         ids=[f"{c[0]}-in{c[1]}-out{'_'.join(map(str, c[2]))}" for c in PROJ])
def test_proj(cuda, rng, tag, inp, outs, mode, nbits, group):
    """Segments reading one bf16 row; a one-segment store also checks the greedy head's block keys and their argmax."""
    x = bits(rng.standard_normal(inp))
    xf = vals(x).astype(np.float64)
    w0 = [_w(rng, nbits[s] if s < len(nbits) else 4, o, inp, group) for s, o in enumerate(outs)]
    w1 = [_w(rng, w.bits, w.out, inp, group) for w in w0] if mode == DUAL else w0
    y0 = [rng.standard_normal(o).astype(np.float32) for o in outs]
    segs = [dict(w0=a.t, w1=b.t, mode=mode, y0=y if mode == ACCUM else None) for a, b, y in zip(w0, w1, y0)]
    head = mode == STORE and len(outs) == 1
    r = cuda.gemv_proj(segs, inp, x=x, head=head)
    for s, (a, b) in enumerate(zip(w0, w1)):
        name = f"cuda gemv proj {tag} {a.bits}-bit g{group} in={inp} out={a.out} seg{s}/{len(outs)}"
        if mode == DUAL:
            assert_close(name, vals(r["y"][s][0]), silu(a.dense() @ xf) * (b.dense() @ xf), KC["gemv_dual_rel_rms"])
        else:
            ref = a.dense() @ xf + (y0[s] if mode == ACCUM else 0)
            assert_close(name, r["y"][s][0], ref, KC["gemv_rel_rms"])
    if head:  # the largest key names the largest output (ties: the lowest row), and argmax_from_block_keys says so
        keys, y = r["amax"], r["y"][0][0]
        assert len(keys) == r["blocks"] <= cuda.gemv_head_blocks(outs[0])
        assert np.all(keys != np.uint64(2 ** 64 - 1)), "a block wrote no key"
        row = 0xFFFFFFFF - int(keys.max() & np.uint64(0xFFFFFFFF))
        assert row == int(np.argmax(y)) == r["token"], (row, int(np.argmax(y)), r["token"])


def test_fits_refuses_4bit_groups_under_64(cuda, rng):
    """The tensor-core tile sums 64 elements under one scale: 4-bit weights with groups of 32 go to the unfused path."""
    assert not cuda.gemv_fits(_w(rng, 4, 8, 256, 32).t)
    assert cuda.gemv_fits(_w(rng, 8, 8, 256, 32).t)


# tag, xmode, routing (E, k, renormalise) or None, in, out, mode: the DeltaNet in-projection's staging, the longest
# RMSNorm rows (4 slices of 256 threads; 3 slices of 192: two fetches a thread), the experts' gate/up (routed dual)
STAGED = [("rmsnorm store", NORM, None, 2048, 8192 + 4096 + 64, STORE), ("rmsnorm store", NORM, None, 192, 33, STORE),
          ("rmsnorm store", NORM, None, 4096, 300, STORE), ("rmsnorm store", NORM, None, 2560, 77, STORE),
          ("routed dual", 0, (256, 8, True), 2048, 512, DUAL), ("routed dual", 0, (5, 3, False), 128, 9, DUAL),
          ("rmsnorm routed dual", NORM, (64, 4, True), 512, 40, DUAL)]


@pytest.mark.parametrize("tag,xmode,routing,inp,out,mode", STAGED,
                         ids=[f"{c[0].replace(' ', '_')}-in{c[3]}-out{c[4]}" for c in STAGED])
def test_staged(cuda, rng, tag, xmode, routing, inp, out, mode):
    """The prologues: RMSNorm of the fp32 residual staged in the launch (block 0 also writes the bf16 row), and the
    routing (softmax top-k of E logits, block 0 writes it; slot j reads expert ids[j])."""
    xr = (rng.standard_normal(inp) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, inp).astype(np.float32)
    if xmode == NORM:  # the staged row as the kernel rounds it: bf16(x inv w), the norm in fp64 here
        inv = 1 / np.sqrt(np.mean(xr.astype(np.float64) ** 2) + 1e-6)
        xs = bits((xr * inv * nw).astype(np.float32))
    else:
        xs = bits(rng.standard_normal(inp))
    E, k, norm = routing or (1, 1, True)
    w0 = _w(rng, 4, out, inp, experts=E if routing else 0)
    w1 = _w(rng, 4, out, inp, experts=E if routing else 0) if mode == DUAL else w0
    seg = dict(w0=w0.t, w1=w1.t, mode=mode, routed=1 if routing else 0, slots=k)
    kw = dict(xf=xr, nw=nw, h_out=True) if xmode == NORM else dict(x=xs)
    ids = np.zeros(1, int)
    if routing:
        logits = (rng.standard_normal(E) * 2).astype(np.float32)
        p = np.exp(logits.astype(np.float64) - logits.max())
        p /= p.sum()
        ids = np.argsort(-p, kind="stable")[:k]
        wts = p[ids] / p[ids].sum() if norm else p[ids]
        kw.update(route_logits=logits, top_k=k, norm_topk=norm)
    r = cuda.gemv_proj([seg], inp, xmode=xmode, eps=1e-6, **kw)
    if xmode == NORM:
        assert_close(f"cuda gemv {tag} h_out in={inp}", vals(r["h_out"]), vals(xs), KC["small_bf16_rel_rms"])
    if routing:
        np.testing.assert_array_equal(r["top_idx"], ids, err_msg=f"{tag}: routing ids")
        assert_close(f"cuda gemv {tag} routing weights E={E} k={k}", r["top_w"], wts, KC["small_fp32_rel_rms"])
    xf = vals(xs).astype(np.float64)
    e_of = (lambda j: int(ids[j])) if routing else (lambda j: None)
    if mode == DUAL:
        got = vals(r["y"][0])
        ref = np.stack([silu(w0.dense(e_of(j)) @ xf) * (w1.dense(e_of(j)) @ xf) for j in range(k)])
    else:
        got, ref = r["y"][0], np.stack([w0.dense(e_of(j)) @ xf for j in range(k)])
    assert_close(f"cuda gemv {tag} in={inp} out={out} x{k}", got, ref,
                 KC["gemv_dual_rel_rms" if mode == DUAL else "gemv_staged_rel_rms"])


def test_rmsnorm_staging_past_its_limit_is_refused(cuda, rng):
    """An RMSNorm staging past kMaxNormIn (4,096) elements: one fetch per thread no longer covers the row, so the
    launch is refused with a message, not run. 8-bit weights in groups of 32, so 4,128 inputs are a valid shape and
    the staging's own limit is what refuses it (4-bit's group of 64 does not divide 4,128)."""
    w = _w(rng, 8, 8, 4128, group=32)
    with pytest.raises(ValueError, match="RMSNorm staging"):
        cuda.gemv_proj([dict(w0=w.t, mode=STORE)], 4128, xmode=NORM, xf=np.ones(4128, np.float32),
                       nw=np.ones(4128, np.float32))


# in, C (conv channels), K, other (a store segment beside it, as z / b / a are in the step)
@pytest.mark.parametrize("inp,C,K,other", [(2048, 8192, 4, 4096 + 64), (64, 33, 4, 5), (192, 7, 2, 1), (128, 40, 3, 9)])
def test_conv_epilogue(cuda, rng, inp, C, K, other):
    """The DeltaNet in-projection's conv (segment 0): u[c] = silu(sum_j<K-1 w[c, j] state[j, c] + w[c, K-1] y[c]) with
    y = W x, and the state shifted one row with y as its newest (K-1 rows of C channels): the shifted rows bit for bit,
    the new row and u within the GEMV's bound."""
    w, wz = _w(rng, 4, C, inp), _w(rng, 4, other, inp)
    x = bits(rng.standard_normal(inp))
    cw = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    st = rng.standard_normal((K - 1, C)).astype(np.float32)
    r = cuda.gemv_proj([dict(w0=w.t, mode=CONV), dict(w0=wz.t, mode=STORE)], inp, x=x, conv_w=cw, conv_state=st)
    xf = vals(x).astype(np.float64)
    y = w.dense() @ xf
    conv = cw[:, K - 1] * y + np.einsum("cj,jc->c", cw[:, :K - 1].astype(np.float64), st)
    tag = f"cuda gemv conv epilogue in={inp} C={C} K={K}"
    assert_close(tag + " u", r["u"], silu(conv), KC["gemv_rel_rms"])
    assert_close(tag + " state's new row", r["conv_state"][K - 2], y, KC["gemv_rel_rms"])
    np.testing.assert_array_equal(r["conv_state"][:K - 2], st[1:], err_msg=tag + " shifted state rows")
    assert_close(tag + f" neighbour store out={other}", r["y"][1][0], wz.dense() @ xf, KC["gemv_rel_rms"])


# H, I, k, E, bits, Is: the model's down (8 of 256 + shared), small sets, one expert, dense (tiny_odd), 8-bit
@pytest.mark.parametrize("H,I,k,E,nbits,Is", [(2048, 512, 8, 256, 4, 512), (96, 128, 3, 5, 4, 128),
                                              (17, 64, 1, 1, 4, 64), (40, 512, 3, 7, 4, 512),
                                              (128, 96, 3, 3, 16, 160), (64, 128, 2, 4, 8, 128)])
def test_moe_down(cuda, rng, H, I, k, E, nbits, Is):
    """x[r] += sum_j w_j (act_j . Wd[e_j][r]) + sigmoid(g) (sact . Ws[r]): the routed experts' down rows side by side
    along K with the shared expert's, summed into the residual."""
    wd, ws = _w(rng, nbits, H, I, experts=E), _w(rng, nbits, H, Is)
    act, sact = bits(rng.standard_normal((k, I))), bits(rng.standard_normal(Is))
    ids = rng.permutation(E)[np.arange(k) % E].astype(np.int32)
    tw = rng.uniform(0, 1, k).astype(np.float32)
    x0 = rng.standard_normal(H).astype(np.float32)
    got = cuda.gemv_moe_down(x0, act, sact, ids, tw, 0.3, wd.t, ws.t)
    ref = x0 + sum(tw[j] * (wd.dense(int(ids[j])) @ vals(act[j]).astype(np.float64)) for j in range(k))
    ref = ref + 1 / (1 + np.exp(-0.3)) * (ws.dense() @ vals(sact).astype(np.float64))
    assert_close(f"cuda gemv moe_down {nbits}-bit H={H} I={I} Is={Is} k={k} E={E}", got, ref, KC["gemv_rel_rms"])

"""The M-row decode GEMV (csrc/cuda/gemv_rows.cu: one launch over M = 1..8 input rows, each 4-bit weight fragment
dequantised once for all of them) against fp64 products of lily.quant's dequantized weights, and its exact rows: row m
of an M-row launch equals the one-row launch of that row bit for bit (the speculative verify decides with them what
plain decoding would). Segments that share the input rows (store, accumulate, SiLU(gate) * up), the RMSNorm staging of
fp32 rows, groups of 64 / 128 / 256, odd output counts and input lengths that are not multiples of the 256-element
chunk, the greedy head's per-row block keys, the DeltaNet in-projection's conv over the M rows, and the MoE over the
rows' routing: the 8-bit router, the experts' gate/up and down (each distinct expert read once, every row's slots written), the shared
expert beside them, and the combine.

Tolerances (KERNEL_CHECKS) as the one-row GEMV's (test_cuda_gemv.py): gemv_rel_rms for fp32 outputs of bf16 rows,
gemv_staged_rel_rms for outputs of RMSNorm-staged rows, gemv_dual_rel_rms for SiLU(gate) * up rounded to bf16."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from cuda_checks import KC, RawWeight, bits, silu, vals

STORE, ACCUM, DUAL, CONV = 0, 1, 2, 3  # rows::OMode
NORM = 1  # rows::XMode


def _w(rng, out, inp, group=64, nbits=4):
    return RawWeight(rng, nbits, out, inp, group=group, kind="gemv")


def _same_bits(name, got, want):
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert g.shape == w.shape, (name, g.shape, w.shape)
    bad = np.flatnonzero(g.view(np.uint32 if g.dtype == np.float32 else np.uint16).ravel() !=
                         w.view(np.uint32 if w.dtype == np.float32 else np.uint16).ravel())
    assert bad.size == 0, f"{name}: {bad.size} of {g.size} elements differ from the one-row launch (first {bad[:5]})"


# tag, in, outputs per segment, mode, group: the model's DeltaNet in-projection and attention q/k/v (4 / 3 segments),
# the out-projections (accumulate, 4096 inputs: 2 chunks a slice), the shared expert (dual), awkward sizes (one row,
# 17 rows, 192 inputs: a chunk of 3 blocks; 320: 5 chunks over 5 slices), larger groups
CASES = [("store", 2048, [8192, 4096, 32, 32], STORE, 64), ("store", 2048, [512, 1, 17], STORE, 64),
         ("store", 192, [33], STORE, 64), ("accum", 4096, [2048], ACCUM, 64), ("accum", 320, [5], ACCUM, 64),
         ("dual", 2048, [512], DUAL, 64), ("dual", 128, [7, 16], DUAL, 64), ("accum", 512, [2048], ACCUM, 64),
         ("g128", 2048, [300, 7], STORE, 128), ("g256", 1024, [33, 5], DUAL, 256), ("longest_in", 8192, [40], STORE, 64)]


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("tag,inp,outs,mode,group", CASES,
                         ids=[f"{c[0]}-in{c[1]}-out{'_'.join(map(str, c[2]))}-g{c[4]}" for c in CASES])
def test_rows(cuda, rng, tag, inp, outs, mode, group, M):
    """M bf16 rows through segments sharing them: each row against fp64, and each row equal to its one-row launch."""
    x = bits(rng.standard_normal((M, inp)))
    w0 = [_w(rng, o, inp, group) for o in outs]
    w1 = [_w(rng, o, inp, group) for o in outs] if mode == DUAL else w0
    y0 = [rng.standard_normal((M, o)).astype(np.float32) for o in outs]

    def segs(rows):
        return [dict(w0=a.t, w1=b.t, mode=mode, y0=y[rows] if mode == ACCUM else None) for a, b, y in zip(w0, w1, y0)]

    r = cuda.gemv_rows(segs(slice(None)), inp, x=x)
    xf = vals(x).astype(np.float64)
    for s, (a, b) in enumerate(zip(w0, w1)):
        name = f"cuda gemv rows {tag} M={M} g{group} in={inp} out={a.out} seg{s}/{len(outs)}"
        assert r["y"][s].shape == (M, a.out)
        if mode == DUAL:
            assert_close(name, vals(r["y"][s]), silu(xf @ a.dense().T) * (xf @ b.dense().T), KC["gemv_dual_rel_rms"])
        else:
            ref = xf @ a.dense().T + (y0[s] if mode == ACCUM else 0)
            assert_close(name, r["y"][s], ref, KC["gemv_rel_rms"])
    for m in range(M):
        one = cuda.gemv_rows(segs(slice(m, m + 1)), inp, x=x[m:m + 1])
        for s in range(len(outs)):
            _same_bits(f"{tag} M={M} row {m} seg {s}", r["y"][s][m:m + 1], one["y"][s])


@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("inp,outs,mode", [(2048, [8192, 4096, 32, 32], STORE), (2048, [512], DUAL),
                                           (192, [33], STORE), (4096, [300], STORE)])
def test_rmsnorm_staging(cuda, rng, inp, outs, mode, M):
    """RMSNorm of M fp32 rows staged in the launch (block 0 writes the bf16 rows): each row's norm and products as a
    one-row launch of that row computes them, bit for bit."""
    xr = (rng.standard_normal((M, inp)) * rng.uniform(0.5, 4, (M, 1))).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, inp).astype(np.float32)
    inv = 1 / np.sqrt(np.mean(xr.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6)
    xs = bits((xr * inv * nw).astype(np.float32))
    w0 = [_w(rng, o, inp) for o in outs]
    w1 = [_w(rng, o, inp) for o in outs] if mode == DUAL else w0
    segs = [dict(w0=a.t, w1=b.t, mode=mode) for a, b in zip(w0, w1)]
    r = cuda.gemv_rows(segs, inp, xmode=NORM, xf=xr, nw=nw, eps=1e-6, h_out=True)
    assert_close(f"cuda gemv rows h_out M={M} in={inp}", vals(r["h_out"]), vals(xs), KC["small_bf16_rel_rms"])
    xf = vals(r["h_out"]).astype(np.float64)  # the products of the rows the kernel staged
    for s, (a, b) in enumerate(zip(w0, w1)):
        name = f"cuda gemv rows rmsnorm M={M} in={inp} out={a.out} seg{s}"
        if mode == DUAL:
            assert_close(name, vals(r["y"][s]), silu(xf @ a.dense().T) * (xf @ b.dense().T), KC["gemv_dual_rel_rms"])
        else:
            assert_close(name, r["y"][s], xf @ a.dense().T, KC["gemv_staged_rel_rms"])
    for m in range(M):
        one = cuda.gemv_rows(segs, inp, xmode=NORM, xf=xr[m:m + 1], nw=nw, eps=1e-6, h_out=True)
        _same_bits(f"rmsnorm M={M} row {m} h_out", r["h_out"][m:m + 1], one["h_out"])
        for s in range(len(outs)):
            _same_bits(f"rmsnorm M={M} row {m} seg {s}", r["y"][s][m:m + 1], one["y"][s])



# in, C (conv channels), K, other (a store segment beside it, as z / b / a are in the step); the model's in-projection
# at 4 taps (2,048 -> 8,192 + 4,096 + 64), fewer channels than a tile, 2 and 3 taps (fewer rows than taps: M = 1, 2)
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("inp,C,K,other", [(2048, 8192, 4, 4096 + 64), (64, 33, 4, 5), (192, 7, 2, 1), (128, 40, 3, 9)])
def test_conv_rows(cuda, rng, inp, C, K, other, M):
    """The DeltaNet in-projection's conv over M rows (segment 0): with X = [state; y] (y = W x of each row) row m's
    u = silu(sum_j w[:, j] X[m + j]), the state X's last K-1 rows and conv_hist X; and M rows equal M one-row launches
    that carry the state from one to the next, bit for bit (u, state, the neighbour's products)."""
    w, wz = _w(rng, C, inp), _w(rng, other, inp)
    x = bits(rng.standard_normal((M, inp)))
    cw = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    st = rng.standard_normal((K - 1, C)).astype(np.float32)
    segs = [dict(w0=w.t, mode=CONV), dict(w0=wz.t, mode=STORE)]
    r = cuda.gemv_rows(segs, inp, x=x, conv_w=cw, conv_state=st)
    xf = vals(x).astype(np.float64)
    X = np.concatenate([st.astype(np.float64), xf @ w.dense().T])  # [K-1+M, C]
    conv = np.stack([np.einsum("cj,jc->c", cw.astype(np.float64), X[m:m + K]) for m in range(M)])
    tag = f"cuda gemv rows conv M={M} in={inp} C={C} K={K}"
    assert r["y"][0] is None
    assert_close(tag + " u", r["u"], silu(conv), KC["gemv_rel_rms"])
    assert_close(tag + " state", r["conv_state"], X[M:], KC["gemv_rel_rms"])
    assert_close(tag + " hist", r["conv_hist"], X, KC["gemv_rel_rms"])
    np.testing.assert_array_equal(r["conv_hist"][:K - 1], st, err_msg=tag + " hist's state rows")
    kept = max(0, K - 1 - M)  # state rows that were state rows before (M < K - 1)
    np.testing.assert_array_equal(r["conv_state"][:kept], st[M:M + kept], err_msg=tag + " state rows shifted")
    assert_close(tag + f" neighbour store out={other}", r["y"][1], xf @ wz.dense().T, KC["gemv_rel_rms"])
    state = st
    for m in range(M):  # one row at a time, the state carried
        one = cuda.gemv_rows(segs, inp, x=x[m:m + 1], conv_w=cw, conv_state=state)
        _same_bits(f"conv M={M} row {m} u", r["u"][m:m + 1], one["u"])
        _same_bits(f"conv M={M} row {m} y", r["conv_hist"][K - 1 + m:K + m], one["conv_hist"][K - 1:])
        _same_bits(f"conv M={M} row {m} neighbour", r["y"][1][m:m + 1], one["y"][1])
        state = one["conv_state"]
    _same_bits(f"conv M={M} final state", r["conv_state"], state)


def _route(logits, k, norm):
    """Each row's top-k of softmax(logits) in fp64 (ties: the lower id) and its weights."""
    p = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    return ids, w / w.sum(axis=1, keepdims=True) if norm else w


# E, k, norm, in, I (each expert's gate / up rows): the model's (256 of 8, 2048 -> 512), fewer experts than the rows'
# choices (the union saturates), odd rows, RMSNorm-staged rows
@pytest.mark.parametrize("M", [1, 2, 5, 8])
@pytest.mark.parametrize("E,k,norm,inp,I,xmode", [(256, 8, True, 2048, 512, 0), (5, 3, False, 128, 9, 0),
                                                  (64, 4, True, 512, 40, NORM)])
def test_routed_rows(cuda, rng, E, k, norm, inp, I, xmode, M):
    """The experts' gate/up over M rows: row m's top-k of its router logits, and slot j's SiLU(gate) * up of expert
    ids[m, j] (each distinct expert of the rows' choices streamed once for all); each row equal to its one-row launch
    bit for bit (ids, weights, every slot)."""
    w0, w1 = RawWeight(rng, 4, I, inp, experts=E, kind="gemv"), RawWeight(rng, 4, I, inp, experts=E, kind="gemv")
    logits = (rng.standard_normal((M, E)) * 2).astype(np.float32)
    seg = [dict(w0=w0.t, w1=w1.t, mode=DUAL, routed=1)]
    if xmode == NORM:
        xr = (rng.standard_normal((M, inp)) * 3).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, inp).astype(np.float32)
        kw = dict(xmode=NORM, xf=xr, nw=nw, eps=1e-6, h_out=True)
        one_kw = lambda m: dict(kw, xf=xr[m:m + 1])
    else:
        x = bits(rng.standard_normal((M, inp)))
        kw = dict(x=x)
        one_kw = lambda m: dict(x=x[m:m + 1])
    r = cuda.gemv_rows(seg, inp, route_logits=logits, top_k=k, norm_topk=norm, **kw)
    ids, wts = _route(logits, k, norm)
    tag = f"cuda gemv rows routed M={M} E={E} k={k} in={inp} I={I}"
    np.testing.assert_array_equal(r["top_idx"], ids, err_msg=tag + " ids")
    assert_close(tag + " weights", r["top_w"], wts, KC["small_fp32_rel_rms"])
    xf = vals(r["h_out"] if xmode == NORM else x).astype(np.float64)
    assert r["y"][0].shape == (M, k, I)
    ref = np.stack([[silu(w0.dense(e) @ xf[m]) * (w1.dense(e) @ xf[m]) for e in ids[m]] for m in range(M)])
    assert_close(tag, vals(r["y"][0]), ref, KC["gemv_dual_rel_rms"])
    for m in range(M):
        one = cuda.gemv_rows(seg, inp, route_logits=logits[m:m + 1], top_k=k, norm_topk=norm, **one_kw(m))
        _same_bits(f"{tag} row {m} weights", r["top_w"][m:m + 1], one["top_w"])
        _same_bits(f"{tag} row {m} slots", r["y"][0][m:m + 1], one["y"][0])


def test_routed_rows_non_finite_row(cuda, rng):
    """A row with a NaN router logit picks expert 0 in every slot with NaN weights (as the one-row routing does): all
    its slots get expert 0's product, and the other rows keep their own routing."""
    E, k, inp, I, M = 16, 4, 256, 24, 3
    w0, w1 = RawWeight(rng, 4, I, inp, experts=E, kind="gemv"), RawWeight(rng, 4, I, inp, experts=E, kind="gemv")
    logits = rng.standard_normal((M, E)).astype(np.float32)
    logits[1, 5] = np.nan
    x = bits(rng.standard_normal((M, inp)))
    r = cuda.gemv_rows([dict(w0=w0.t, w1=w1.t, mode=DUAL, routed=1)], inp, x=x, route_logits=logits, top_k=k)
    np.testing.assert_array_equal(r["top_idx"][1], np.zeros(k, np.int32))
    assert np.isnan(r["top_w"][1]).all()
    xf = vals(x).astype(np.float64)
    e0 = silu(w0.dense(0) @ xf[1]) * (w1.dense(0) @ xf[1])
    for j in range(k):
        assert_close(f"cuda gemv rows routed NaN row slot {j}", vals(r["y"][0][1, j]), e0, KC["gemv_dual_rel_rms"])
    ids, _ = _route(logits[[0, 2]], k, True)
    np.testing.assert_array_equal(r["top_idx"][[0, 2]], ids)


def _moe_rows(cuda, W, h, logits, sgate, x0, k):
    """The MoE's row launches: the experts' gate/up (routing), the shared expert's gate/up, both downs, the combine."""
    up = cuda.gemv_rows([dict(w0=W["gate"].t, w1=W["up"].t, mode=DUAL, routed=1)], h.shape[1], x=h,
                        route_logits=logits, top_k=k)
    sact = cuda.gemv_rows([dict(w0=W["sh_gate"].t, w1=W["sh_up"].t, mode=DUAL)], h.shape[1], x=h)["y"][0]
    act = up["y"][0]
    down = cuda.gemv_rows([dict(w0=W["down"].t, mode=STORE, routed=1, xrouted=1, x=act),
                           dict(w0=W["sh_down"].t, mode=STORE, x=sact)], act.shape[2], top_idx=up["top_idx"])
    x = cuda.moe_combine_rows(down["y"][0], down["y"][1], up["top_w"], sgate, x0)
    return dict(up=up, act=act, sact=sact, yx=down["y"][0], ysh=down["y"][1], x=x)


# E, k, H, I: the model's (256 of 8, 2048, 512), fewer experts than the rows' choices (12 tiles of down rows an expert:
# 4 warps a block, not 8), three k blocks a row of the down (a short chunk)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("E,k,H,I", [(256, 8, 2048, 512), (5, 3, 192, 64), (12, 2, 128, 192)])
def test_moe_rows(cuda, rng, E, k, H, I, M):
    """The MoE over M rows from the row launches: x + sum_j w_j down_{e_j}(act_j) + sigmoid(g) shared_down(sact)
    against fp64 on the kernels' own bf16 activations, and each row equal to the same launches over that row alone,
    bit for bit (activations, each slot's down, the residual)."""
    W = {n: RawWeight(rng, 4, o, i, experts=E if n in ("gate", "up", "down") else 0, kind="gemv")
         for n, o, i in (("gate", I, H), ("up", I, H), ("down", H, I), ("sh_gate", I, H), ("sh_up", I, H),
                         ("sh_down", H, I))}
    h = bits(rng.standard_normal((M, H)))
    logits = (rng.standard_normal((M, E)) * 2).astype(np.float32)
    sgate = rng.standard_normal(M).astype(np.float32)
    x0 = rng.standard_normal((M, H)).astype(np.float32)
    r = _moe_rows(cuda, W, h, logits, sgate, x0, k)
    ids, wts = r["up"]["top_idx"], r["up"]["top_w"].astype(np.float64)
    act, sact = vals(r["act"]).astype(np.float64), vals(r["sact"]).astype(np.float64)
    tag = f"cuda rows moe M={M} E={E} k={k} H={H} I={I}"
    yx = np.stack([[W["down"].dense(int(ids[m, j])) @ act[m, j] for j in range(k)] for m in range(M)])
    assert_close(tag + " experts' down", r["yx"], yx, KC["gemv_rel_rms"])
    ysh = sact @ W["sh_down"].dense().T
    assert_close(tag + " shared down", r["ysh"], ysh, KC["gemv_rel_rms"])
    sig = 1 / (1 + np.exp(-sgate.astype(np.float64)))
    moe = np.einsum("mj,mjh->mh", wts, r["yx"].astype(np.float64)) + sig[:, None] * r["ysh"]
    assert_close(tag + " combine", r["x"] - x0, moe, KC["small_fp32_rel_rms"])
    for m in range(M):
        one = _moe_rows(cuda, W, h[m:m + 1], logits[m:m + 1], sgate[m:m + 1], x0[m:m + 1], k)
        for key in ("act", "sact", "yx", "ysh", "x"):
            _same_bits(f"{tag} row {m} {key}", r[key][m:m + 1], one[key])


# in, then (outputs, bits, mode) per segment: the MoE's first launch (the 8-bit router, the shared expert's 4-bit
# gate/up, its 8-bit one-row gate), 8-bit rows not a multiple of the 8-row tile, an 8-bit accumulate, 3 k blocks a row
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("inp,segs", [(2048, [(256, 8, STORE), (512, 4, DUAL), (1, 8, STORE)]),
                                      (512, [(37, 8, STORE), (9, 4, STORE)]), (192, [(20, 8, ACCUM)])])
def test_q8_rows(cuda, rng, inp, segs, M):
    """8-bit segments (each code as its two nibbles on the tile) beside 4-bit ones over RMSNorm-staged rows: each
    against fp64 on the staged rows, and each row equal to its one-row launch bit for bit."""
    xr = (rng.standard_normal((M, inp)) * 2).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, inp).astype(np.float32)
    ws = [(_w(rng, o, inp, nbits=b), _w(rng, o, inp, nbits=b) if mode == DUAL else None, mode) for o, b, mode in segs]
    y0 = [rng.standard_normal((M, w0.out)).astype(np.float32) for w0, _, _ in ws]

    def launch(rows):
        sg = [dict(w0=w0.t, w1=(w1 or w0).t, mode=mode, y0=y[rows] if mode == ACCUM else None)
              for (w0, w1, mode), y in zip(ws, y0)]
        return cuda.gemv_rows(sg, inp, xmode=NORM, xf=xr[rows], nw=nw, eps=1e-6, h_out=True)

    r = launch(slice(None))
    xf = vals(r["h_out"]).astype(np.float64)
    for s, ((w0, w1, mode), y) in enumerate(zip(ws, y0)):
        name = f"cuda gemv rows q8 M={M} in={inp} seg{s} {w0.bits}-bit out={w0.out}"
        if mode == DUAL:
            assert_close(name, vals(r["y"][s]), silu(xf @ w0.dense().T) * (xf @ w1.dense().T), KC["gemv_dual_rel_rms"])
        else:
            assert_close(name, r["y"][s], xf @ w0.dense().T + (y if mode == ACCUM else 0), KC["gemv_staged_rel_rms"])
    for m in range(M):
        one = launch(slice(m, m + 1))
        for s in range(len(segs)):
            _same_bits(f"q8 M={M} row {m} seg {s}", r["y"][s][m:m + 1], one["y"][s])

@pytest.mark.parametrize("M,out", [(1, 248320 // 16 + 3), (4, 4099), (8, 1000)])
def test_head_keys(cuda, rng, M, out):
    """The greedy head: per block and input row the largest key of (logit, -row); their maximum names each row's
    argmax (ties: the lowest row), as the device's reduction (sample::argmax_from_block_keys over M rows) finds it."""
    x = bits(rng.standard_normal((M, 2048)))
    w = _w(rng, out, 2048)
    r = cuda.gemv_rows([dict(w0=w.t, mode=STORE)], 2048, x=x, head=True)
    keys, y = r["amax"], r["y"][0]
    assert keys.shape == (r["blocks"], M)
    assert np.all(keys != np.uint64(2 ** 64 - 1)), "a block wrote no key"
    for m in range(M):
        row = 0xFFFFFFFF - int(keys[:, m].max() & np.uint64(0xFFFFFFFF))
        assert row == int(np.argmax(y[m])), (m, row, int(np.argmax(y[m])))
        assert int(r["tokens"][m]) == row, ("the device's reduction of row", m, int(r["tokens"][m]), row)


def test_fits_and_refusals(cuda, rng):
    """4- and 8-bit with groups of at least 64 only; a launch over 9 rows or with a mismatched input is refused by name."""
    assert cuda.gemv_rows_fits(_w(rng, 8, 256).t)
    assert not cuda.gemv_rows_fits(RawWeight(rng, 4, 8, 256, group=32, kind="gemv").t)
    assert cuda.gemv_rows_fits(RawWeight(rng, 8, 8, 256, kind="gemv").t)
    assert not cuda.gemv_rows_fits(RawWeight(rng, 8, 8, 256, group=32, kind="gemv").t)
    assert not cuda.gemv_rows_fits(RawWeight(rng, 16, 8, 256, kind="gemv").t)
    w = _w(rng, 8, 256)
    with pytest.raises(ValueError, match="rows 9"):
        cuda.gemv_rows([dict(w0=w.t, mode=STORE)], 256, x=bits(rng.standard_normal((9, 256))))
    with pytest.raises(ValueError, match="input length"):
        cuda.gemv_rows([dict(w0=w.t, mode=STORE)], 128, x=bits(rng.standard_normal((2, 128))))
    with pytest.raises(ValueError, match="conv_w"):
        cuda.gemv_rows([dict(w0=w.t, mode=CONV)], 256, x=bits(rng.standard_normal((2, 256))))
    cw, st = np.ones((8, 4), np.float32), np.ones((3, 8), np.float32)
    with pytest.raises(ValueError, match="route_logits"):
        cuda.gemv_rows([dict(w0=w.t, w1=w.t, mode=DUAL, routed=1)], 256, x=bits(rng.standard_normal((2, 256))))
    with pytest.raises(ValueError, match="one conv segment"):
        cuda.gemv_rows([dict(w0=w.t, mode=CONV)] * 2, 256, x=bits(rng.standard_normal((2, 256))), conv_w=cw,
                       conv_state=st)

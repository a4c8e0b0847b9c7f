"""The Metal op table of the kernel suite: numpy-in / numpy-out wrappers of lily's Metal kernels on the emulator
(three schedules each). Grid and threadgroup shapes are chosen here the way the host backend chooses them, so
the tests exercise the same launch geometry. The kernel-level wrappers (gemv, gemm, route, deltanet_scan, ...) come
first; the family entry points of op_list.py close the file."""
from __future__ import annotations

import numpy as np
from metal_env import emu, lib

from kernel_inputs import Weight

NAME = "metal"

GEMV_ROWS, GEMV_NSG = 4, 2


def linear_args(w: Weight):
    """kp::LinearParams of w, as lily::linear_params builds it on the host."""
    quant = w.fmt in ("q4", "q8")
    bits = {"q4": 4, "q8": 8}.get(w.fmt, 0)
    return emu.params("LinearParams", kind={"bf16": 1, "f32": 2}.get(w.fmt, 0), bits=bits,
                      group=w.group if quant else 0, out=w.out, **{"in": w.inp},
                      expert_words=w.out * w.inp * bits // 32, expert_groups=w.out * (w.inp // w.group) if quant else 0,
                      expert_elems=w.out * w.inp)


GEMV_MAX_M = 8  # Ops::kGemvRowsMax: input rows one GEMV threadgroup serves


def row_groups(S: int, nm: int | None = None) -> list[tuple[int, int, int]]:
    """(first row, rows per threadgroup NM, threadgroups) per launch over S input rows, as Ops::linear and
    MetalBackend::moe_decode split them: all S <= 8 rows in one threadgroup row, else groups of 8 and then the rest;
    nm given: groups of nm rows (nm = 1: the one-row kernel over every row)."""
    nm = nm or min(S, GEMV_MAX_M)
    full = S // nm * nm
    return [(0, nm, S // nm)] + ([(full, S - full, 1)] if full < S else [])


def _rows_suffix(nm: int) -> str:
    return "" if nm == 1 else f"_m{nm}"


def gemv(w: Weight, x: np.ndarray, y0: np.ndarray | None = None, nm: int | None = None) -> np.ndarray:
    """x [S, in] -> y [S, out]; with y0 the result is added to it (residual add fused). nm: input rows per
    threadgroup (gemv_<fmt>_m<nm>; 1: gemv_<fmt>, one row each); None: the host's split (row_groups)."""
    S = x.shape[0]
    acc = y0 is not None
    x = np.ascontiguousarray(x, np.float32)
    y = y0.copy() if acc else np.zeros((S, w.out), np.float32)
    ga = emu.params("GemvArgs", x_stride=x.shape[1], y_stride=w.out, accumulate=int(acc))
    for r0, m, n in row_groups(S, nm):
        grid = (-(-w.out // (GEMV_ROWS * GEMV_NSG)), n, 1)
        y[r0:r0 + m * n], = emu.run3(lib("gemv"), f"gemv_{w.fmt}{_rows_suffix(m)}", grid, (32 * GEMV_NSG, 1, 1),
                                     [*w.bufs, x[r0:r0 + m * n], y[r0:r0 + m * n], linear_args(w), ga], outputs=[4],
                                     poison=not acc)
    return y


GEMM_BN = 32
_I32 = np.zeros(1, np.int32)


def gemm(w: Weight, a: np.ndarray, *, t: str = "f32", bm: int = 32, y0: np.ndarray | None = None,
         up: Weight | None = None, block_map=None, row_index=None, M: int | None = None,
         tensor: bool = False) -> np.ndarray:
    """Y = A W^T (plain), Y += ... (y0 given), silu(A Wg^T) * (A Wu^T) (up given).
    block_map = (tile_expert, tile_row0, tile_rows, n_tiles, max_tiles) for the grouped (MoE) form, with
    row_index (gather of A rows per sorted pair) or None (A read in pair order); M = number of pairs.
    tensor: the Metal 4 tensor-op kernels of gemm_tensor.metal (same arguments and launch geometry)."""
    M = a.shape[0] if M is None else M
    n_out = w.out
    y = y0.copy() if y0 is not None else np.zeros((M, n_out), np.float32)
    grouped = block_map is not None
    if grouped:
        te, tr0, trn, nt, max_tiles = block_map
        maps = [np.asarray(x, np.int32) for x in (row_index if row_index is not None else _I32, te, tr0, trn, [nt])]
        tiles = max_tiles
    else:
        maps, tiles = [_I32] * 5, -(-M // bm)
    ga = emu.params("GemmArgs", M=M, grouped=int(grouped), gather=int(row_index is not None),
                    epilogue=1 if y0 is not None else (2 if up else 0), lda=a.shape[1], ldy=n_out,
                    max_tiles=tiles)
    name = f"gemm_{'tensor_' if tensor else ''}{'glu_' if up else ''}{w.fmt}_{t}_bm{bm}"
    w2 = up.bufs if up else w.bufs
    out, = emu.run3(lib("gemm_tensor" if tensor else "gemm"), name, (-(-n_out // GEMM_BN), tiles, 1), (128, 1, 1),
                    [np.ascontiguousarray(a, np.float32), *w.bufs, *w2, y, linear_args(w), ga, *maps],
                    outputs=[7], poison=y0 is None)
    return out


def route(logits: np.ndarray, k: int, norm: bool = True, bm: int = 32):
    """Routing on the device: -> dict(ids, wts, sorted_row, sorted_w, inv, block_map)."""
    S, E = logits.shape
    nb = -(-S // 32)
    max_tiles = -(-S * k // bm) + E
    ra = emu.params("RouteArgs", S=S, n_experts=E, top_k=k, norm_topk=int(norm), block_rows=32, n_blocks=nb,
                    tile_rows=bm, max_tiles=max_tiles)
    L = lib("moe")
    ids, wts = emu.run3(L, "moe_topk_j8" if E > 32 else "moe_topk_j1", (S, 1, 1), (32, 1, 1),
                        [logits.astype(np.float32), np.zeros((S, k), np.int32), np.zeros((S, k), np.float32), ra],
                        outputs=[1, 2])
    counts, = emu.run3(L, "moe_count", (nb, 1, 1), (32, 1, 1), [ids, np.zeros((nb, E), np.int32), ra], outputs=[1])
    nt = -(-E // 32) * 32
    base, te, tr0, trn, ntl = emu.run3(
        L, "moe_offsets", (1, 1, 1), (nt, 1, 1),
        [counts, np.zeros((nb, E), np.int32), *[np.full(max_tiles, -7, np.int32) for _ in range(3)],
         np.zeros(1, np.int32), ra], outputs=[1, 2, 3, 4, 5])
    srow, sw, inv = emu.run3(L, "moe_scatter", (nb, 1, 1), (32, 1, 1),
                             [ids, wts, base, np.zeros(S * k, np.int32), np.zeros(S * k, np.float32),
                              np.zeros((S, k), np.int32), ra], outputs=[3, 4, 5])
    return dict(ids=ids, wts=wts, counts=counts, sorted_row=srow, sorted_w=sw, inv=inv,
                block_map=(te, tr0, trn, int(ntl[0]), max_tiles))


def moe_prefill(x: np.ndarray, h: np.ndarray, W: dict, k: int, norm: bool = True, bm: int = 32) -> np.ndarray:
    """x + MoE(h) through the prefill chain (router GEMM, device routing, grouped GEMMs, combine).
    W: router, gate, up, down, sh_gate, sh_up, sh_down, sh_expert_gate (Weight objects)."""
    S = h.shape[0]
    logits = gemm(W["router"], h)
    sgl = gemm(W["sh_expert_gate"], h)
    r = route(logits, k, norm, bm)
    act = gemm(W["gate"], h, bm=bm, up=W["up"], block_map=r["block_map"], row_index=r["sorted_row"], M=S * k)
    yd = gemm(W["down"], act, bm=bm, block_map=r["block_map"], M=S * k)
    ysh = gemm(W["sh_down"], gemm(W["sh_gate"], h, up=W["sh_up"]))
    mp = emu.params("MoeParams", hidden=x.shape[1], n_experts=W["router"].out, top_k=k, S=S)
    out, = emu.run3(lib("moe"), "moe_combine", (-(-x.shape[1] // 64), S, 1), (64, 1, 1),
                    [x, yd, ysh, sgl[:, 0].copy(), r["inv"], r["wts"], mp], outputs=[0], poison=False)
    return out


def moe_decode(x: np.ndarray, h: np.ndarray, W: dict, k: int, norm: bool = True, nm: int | None = None) -> np.ndarray:
    """x + MoE(h) for S rows through the fused decode chains, as MetalBackend::moe_decode runs them: router and
    shared-expert gate GEMVs and top-k over the S rows, then gate/up and down per group of nm rows (row_groups: None
    the host's split, 1 the one-row kernels row by row), each expert a group's rows chose streamed once for them."""
    S, H = h.shape
    h = np.ascontiguousarray(h, np.float32)
    logits = gemv(W["router"], h, nm=nm)
    sgl = gemv(W["sh_expert_gate"], h, nm=nm)[:, 0].copy()
    E = W["router"].out
    ra = emu.params("RouteArgs", S=S, n_experts=E, top_k=k, norm_topk=int(norm), block_rows=32, n_blocks=-(-S // 32))
    ids, wts = emu.run3(lib("moe"), "moe_topk_j8" if E > 32 else "moe_topk_j1", (S, 1, 1), (32, 1, 1),
                        [logits, np.zeros((S, k), np.int32), np.zeros((S, k), np.float32), ra], outputs=[1, 2])
    I, Is = W["gate"].out, W["sh_gate"].out
    stride = -(-max(I, Is) // 8) * 8
    ma = emu.params("MoeDecodeArgs", top_k=k, inter=I, shared_inter=Is, act_stride=stride)
    rows = GEMV_ROWS * GEMV_NSG
    out = np.ascontiguousarray(x, np.float32).copy()
    for g0, m, n in row_groups(S, nm):
        for t in range(n):  # the host's groups run one after another (one activation buffer)
            r = slice(g0 + t * m, g0 + (t + 1) * m)
            act, = emu.run3(lib("moe"), f"moe_gate_up_decode_{W['gate'].fmt}{_rows_suffix(m)}",
                            (-(-max(I, Is) // rows), m * k + 1, 1), (32 * GEMV_NSG, 1, 1),
                            [h[r], ids[r], *W["gate"].bufs, *W["up"].bufs, *W["sh_gate"].bufs, *W["sh_up"].bufs,
                             np.zeros((m, k + 1, stride), np.float32), linear_args(W["gate"]),
                             linear_args(W["sh_gate"]), ma], outputs=[14])
            out[r], = emu.run3(lib("moe"), f"moe_down_decode_{W['down'].fmt}{_rows_suffix(m)}", (-(-H // rows), 1, 1),
                               (32 * GEMV_NSG, 1, 1),
                               [act, ids[r], wts[r], sgl[r], *W["down"].bufs, *W["sh_down"].bufs, out[r],
                                linear_args(W["down"]), linear_args(W["sh_down"]), ma], outputs=[10], poison=False)
    return out


def _nk(dk: int) -> int:
    return 1 if dk <= 32 else 2 if dk <= 64 else 4


def deltanet_params(Hk, Hv, Dk, Dv, K, S, eps=1e-6):
    return emu.params("DeltaNetParams", k_heads=Hk, v_heads=Hv, k_dim=Dk, v_dim=Dv, conv_kernel=K,
                      conv_dim=2 * Hk * Dk + Hv * Dv, norm_eps=eps, qk_eps=1e-6, S=S)


def deltanet_conv(qkv, conv_w, conv_state, p):
    """-> (u [S, C], conv_state')."""
    C = qkv.shape[1]
    u, st = emu.run3(lib("deltanet"), "deltanet_conv", (-(-C // 64), 1, 1), (64, 1, 1),
                     [qkv, conv_w, conv_state, np.zeros_like(qkv), p], outputs=[3, 2], poison=[3])
    return u, st


def deltanet_scan(u, b, a, a_log, dt_bias, state, p, z=None, norm_w=None, fuse=False, nsg=2):
    """-> (o or y [S, Hv*Dv], state'); fuse applies the gated RMSNorm in the same kernel."""
    Hv, Dv, Dk = state.shape
    S = u.shape[0]
    rows = 4
    if fuse:
        name, grid, tg = f"deltanet_scan_norm_nk{_nk(Dk)}", (1, Hv, 1), (32 * -(-Dv // rows), 1, 1)
    else:
        name, grid, tg = f"deltanet_scan_nk{_nk(Dk)}", (-(-Dv // (rows * nsg)), Hv, 1), (32 * nsg, 1, 1)
    zz = z if z is not None else np.zeros(1, np.float32)
    nw = norm_w if norm_w is not None else np.zeros(1, np.float32)
    o, st = emu.run3(lib("deltanet"), name, grid, tg,
                     [u, b, a, a_log, dt_bias, state, np.zeros((S, Hv * Dv), np.float32), zz, nw, p],
                     outputs=[6, 5], poison=[6])
    return o, st


def deltanet_gated_norm(o, z, w, p):
    Dv = w.shape[0]
    rows = o.size // Dv
    y, = emu.run3(lib("deltanet"), "deltanet_gated_norm", (rows, 1, 1), (32, 1, 1), [o, z, w, p], outputs=[0],
                  poison=False)
    return y


def rope_table(rotary_dim: int, theta: float) -> np.ndarray:
    """[rd/2, 2] float32 (hi, lo) split of theta^(-2i/rd) computed in double, as the host does."""
    f = theta ** (-np.arange(rotary_dim // 2, dtype=np.float64) * 2.0 / rotary_dim)
    hi = f.astype(np.float32)
    return np.stack([hi, (f - hi.astype(np.float64)).astype(np.float32)], 1)


def attn_params(Hq, Hkv, D, rd, theta, pos0, S, eps=1e-6):
    return emu.params("AttentionParams", n_heads=Hq, n_kv_heads=Hkv, head_dim=D, rotary_dim=rd,
                      rope_theta=theta, eps=eps, scale=D ** -0.5, pos0=pos0, S=S)


def _kvs(cache: np.ndarray) -> str:
    """Kernel-name suffix of the KV cache element type: fp32, or bf16 bits carried as uint16."""
    return "_kvbf16" if cache.dtype == np.uint16 else ""


def _hpg(nd: int) -> int:
    return 8 if nd == 8 else 4


def attn_prep(qg, k, v, q_norm, k_norm, rope, k_cache, v_cache, p):
    """-> (q [S, Hq*D], k_cache', v_cache')."""
    S = qg.shape[0]
    Hq, Hkv, D = int(p["n_heads"]), int(p["n_kv_heads"]), int(p["head_dim"])
    q, kc, vc = emu.run3(lib("attention"), f"attn_prep_nd{D // 32}{_kvs(k_cache)}", (S, Hq + Hkv, 1), (32, 1, 1),
                         [qg, k, v, q_norm, k_norm, rope, np.zeros((S, Hq * D), np.float32), k_cache, v_cache, p],
                         outputs=[6, 7, 8], poison=[6])
    return q, kc, vc


def attn_prefill(q, qg, k_cache, v_cache, p, rows=4):
    S = q.shape[0]
    Hq, Hkv, D = int(p["n_heads"]), int(p["n_kv_heads"]), int(p["head_dim"])
    nd = D // 32
    hpg = _hpg(nd)
    grid = (-(-S // rows), Hkv, -(-(Hq // Hkv) // hpg))
    out, = emu.run3(lib("attention"), f"attn_prefill_nd{nd}_h{hpg}{_kvs(k_cache)}", grid, (32 * rows, 1, 1),
                    [q, qg, k_cache, v_cache, np.zeros((S, Hq * D), np.float32), p], outputs=[4])
    return out


def attn_decode(q, qg, k_cache, v_cache, p, split_len=32, nsg=2):
    """One row at position pos0 (keys 0..pos0), split-K with parts of split_len keys."""
    Hq, Hkv, D = int(p["n_heads"]), int(p["n_kv_heads"]), int(p["head_dim"])
    nd = D // 32
    hpg = _hpg(nd)
    T = int(p["pos0"]) + 1
    parts = -(-T // split_len)
    sp = emu.params("AttnSplitParams", n_splits=parts, split_len=split_len)
    grid = (-(-parts // nsg), Hkv, -(-(Hq // Hkv) // hpg))
    ml, po = emu.run3(lib("attention"), f"attn_decode_nd{nd}_h{hpg}{_kvs(k_cache)}", grid, (32 * nsg, 1, 1),
                      [q, k_cache, v_cache, np.zeros((Hq, parts, 2), np.float32),
                       np.zeros((Hq, parts, D), np.float32), p, sp], outputs=[3, 4])
    out, = emu.run3(lib("attention"), f"attn_decode_combine_nd{nd}", (Hq, 1, 1), (32, 1, 1),
                    [ml, po, qg, np.zeros((1, Hq * D), np.float32), p, sp], outputs=[3])
    return out


def rms_norm(x, w, eps=1e-6, nt=None):
    """x [S, n], w [n] -> [S, n]; nt threads per row (None: the host's choice, a thread per 8 values)."""
    S, n = x.shape
    nt = nt or min(1024, max(32, -(-n // 8) // 32 * 32))
    na = emu.params("NormArgs", dim=n, eps=eps, x_stride=n, y_stride=n)
    y, = emu.run3(lib("norm"), "rms_norm", (S, 1, 1), (nt, 1, 1), [x, w, np.zeros_like(x), na], outputs=[2])
    return y


def embed(w: Weight, ids):
    ids = np.asarray(ids, np.int32)
    x, = emu.run3(lib("norm"), f"embed_{w.fmt}", (len(ids), 1, 1), (64, 1, 1),
                  [*w.bufs, ids, np.zeros((len(ids), w.inp), np.float32), linear_args(w)], outputs=[4])
    return x


# The device sampler (sample.metal): every option of lily._lily.sample_draw, the host's three dispatches.
SAMPLER = "full"
SAMPLE_SPAN, SAMPLE_GRID_THREADS, SAMPLE_SELECT_THREADS = 2048, 256, 1024  # kSampleSpan, Ops::sample's threads


def sample_draw_kernels(logits, uniform, seen=None, counts=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, bias_ids=(),
                        bias_vals=(), slot=1, select_threads=SAMPLE_SELECT_THREADS):
    """logits [V] -> (token, seen' [V] uint8, counts' [V] int32): sample_process, sample_weigh (skipped when
    greedy, as the host does), sample_select, each on three schedules; the draw lands in tokens[slot]."""
    x = np.ascontiguousarray(logits, np.float32).reshape(-1)
    V = x.size
    nb = -(-V // SAMPLE_SPAN)
    greedy = temperature == 0
    sa = emu.params("SampleArgs", inv_temperature=1.0 if greedy else 1.0 / temperature, greedy=int(greedy),
                    top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, n_bias=len(bias_ids),
                    vocab=V, token_slot=slot)
    seen = np.zeros(V, np.uint8) if seen is None else np.asarray(seen, np.uint8).copy()
    counts = np.zeros(V, np.int32) if counts is None else np.asarray(counts, np.int32).copy()
    ids = np.asarray(bias_ids, np.int32) if len(bias_ids) else np.zeros(1, np.int32)
    vals = np.asarray(bias_vals, np.float32) if len(bias_ids) else np.zeros(1, np.float32)
    work = np.full(6 * nb + 4 * nb * SAMPLE_SPAN, np.nan, np.float32)
    L = lib("sample")
    xp, work = emu.run3(L, "sample_process", (nb, 1, 1), (SAMPLE_GRID_THREADS, 1, 1),
                        [x, np.zeros(V, np.float32), work, ids, vals, seen, counts, sa], outputs=[1, 2], poison=[1])
    if not greedy:
        work, = emu.run3(L, "sample_weigh", (nb, 1, 1), (SAMPLE_GRID_THREADS, 1, 1), [xp, work, sa], outputs=[1],
                         poison=False)
    seen, counts, tok = emu.run3(L, "sample_select", (1, 1, 1), (select_threads, 1, 1),
                                 [xp, work, seen, counts, np.array([uniform], np.float32),
                                  np.full(2, -1, np.int32), sa], outputs=[2, 3, 5], poison=False)
    return int(tok[slot]), seen, counts


def sample_draw(logits, uniform, **options):
    return sample_draw_kernels(logits, uniform, **options)[0]


def argmax(logits, slot=1, nt=256):
    na = emu.params("NormArgs", dim=logits.size, x_stride=slot)
    tok, = emu.run3(lib("norm"), "argmax", (1, 1, 1), (nt, 1, 1), [logits, np.full(2, -1, np.int32), na],
                    outputs=[1], poison=False)
    return int(tok[slot])


# ---- the family entry points of op_list.py (operands and shapes declared there): the host backend's kernel chains ----
GEMV_MAX_ROWS = 4     # Ops::kGemvMaxRows: up to 4 rows the host runs the GEMV, above it the GEMM
ATTN_SPLIT_LEN = 256  # Ops::kSplitLen: keys per split-K part of decode attention


def gated_rms_norm(o, z, w, eps):
    Dv = w.shape[0]
    p = deltanet_params(1, o.shape[1] // Dv, Dv, Dv, 1, o.shape[0], eps)
    return deltanet_gated_norm(np.ascontiguousarray(o, np.float32), np.ascontiguousarray(z, np.float32), w, p)


def linear(w: Weight, x):
    """The GEMV up to GEMV_MAX_ROWS rows, else the GEMM (Ops::linear's choice)."""
    x = np.ascontiguousarray(x, np.float32)
    return gemv(w, x) if x.shape[0] <= GEMV_MAX_ROWS else gemm(w, x)


def attention(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos0, n_heads, n_kv_heads, head_dim, rotary_dim,
              rope_theta, eps):
    """Prep, then decode attention (S = 1) or the prefill kernel."""
    S = qg.shape[0]
    p = attn_params(n_heads, n_kv_heads, head_dim, rotary_dim, rope_theta, pos0, S, eps)
    q, kc, vc = attn_prep(qg, k, v, q_norm, k_norm, rope_table(rotary_dim, rope_theta), k_cache.copy(),
                          v_cache.copy(), p)
    if S == 1:
        return attn_decode(q, qg, kc, vc, p, split_len=ATTN_SPLIT_LEN), kc, vc
    return attn_prefill(q, qg, kc, vc, p), kc, vc


def deltanet(qkv, z, b, a, conv_w, dt_bias, a_log, norm_w, conv_state, ssm, k_heads, norm_eps):
    """The conv, then the scan with the gated norm fused."""
    Hv, Dv, Dk = ssm.shape
    p = deltanet_params(k_heads, Hv, Dk, Dv, conv_w.shape[1], qkv.shape[0], norm_eps)
    u, conv1 = deltanet_conv(qkv, conv_w, conv_state, p)
    y, rec1 = deltanet_scan(u, b, a, a_log, dt_bias, ssm, p, z=z, norm_w=norm_w, fuse=True)
    return y, conv1, rec1


def moe_route(logits, top_k, norm_topk_prob):
    """The device routing chain."""
    r = route(np.ascontiguousarray(logits, np.float32), top_k, norm_topk_prob)
    return r["ids"], r["wts"]


# Expert (and shared-expert) weight formats with MoE kernels: gemm.metal's GLU and moe.metal's decode chains
MOE_EXPERT_FORMATS = ("q4", "bf16")


def moe(h, W: dict, top_k, norm_topk_prob):
    """The fused decode chains for one row, else the prefill chain with the host's tile rows."""
    S, H = h.shape
    x = np.zeros((S, H), np.float32)  # the kernels add the residual; zero leaves the MoE output itself
    if S == 1:
        return moe_decode(x, h, W, top_k, norm_topk_prob)
    E, pairs = W["router"].out, S * top_k
    small = pairs < 24 * E and W["gate"].fmt in ("q4", "bf16") and W["down"].fmt in ("q4", "bf16")
    return moe_prefill(x, h, W, top_k, norm_topk_prob, bm=16 if small else 32)

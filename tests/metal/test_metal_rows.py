"""The multi-row decode kernels on emulated Metal: gemv_<fmt>_m<M> (metal/gemv.metal) and the fused MoE decode chains
moe_gate_up_decode_<fmt>_m<M> / moe_down_decode_<fmt>_m<M> (metal/moe.metal), which read each weight chunk (each
expert any row chose) once for M <= 8 input rows. The speculative verify and streams decoded together rely on each
row being bit-equal to the one-row kernel run on that row alone, so: (a) row m of the M-row launch equals the one-row
launch on row m bit for bit, and (b) both are within the fp32 bound of the reference (x @ dense W^T in float64,
lily.reference.moe.moe_ffn). M = 1, 2, 3, 5, 8, and 11 / 16 (groups of 8, then the rest, as the host splits them);
output counts that are not a multiple of the 8-row tile, inputs of one chunk, one group, and more chunks than lanes.
Outputs start as NaN (emu.run3 poisons them), so an element no kernel wrote shows. Last, the engine: streams stepped
together in one exact-rows forward end with the logits of their solo runs, bit for bit (each Metal run in a forked
child, test_metal_backend._in_child, with the scratch poisoned with NaN before every chunk and step)."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from lily.testing.metrics import assert_close

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
import ops_metal  # noqa: E402
from kernel_inputs import Weight, moe_tensors, rel_tol  # noqa: E402

from lily.reference.linear import Weights  # noqa: E402
from lily.reference.moe import moe_ffn  # noqa: E402
from lily.reference.moe import route as ref_route  # noqa: E402

ROWS = [1, 2, 3, 5, 8, 11, 16]
def _same_bits(name: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    g, w = np.ascontiguousarray(got, np.float32).view(np.uint32), np.ascontiguousarray(want, np.float32).view(np.uint32)
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{name}: {len(bad)} of {g.size} values differ from the one-row result (first {bad[:4].tolist()})"


# fmt, out, in, group: 37 / 129 outputs (no multiple of the 8-row tile); one chunk, one group, several groups, and more
# chunks than the 32 lanes (a lane takes a second chunk): q4 32 values a chunk, q8 16, bf16 / f32 8
GEMV_CASES = [("q4", 37, 64, 64), ("q4", 129, 1056, 32), ("q8", 37, 32, 32), ("q8", 129, 544, 32),
              ("bf16", 37, 8, 0), ("bf16", 129, 264, 0), ("f32", 37, 40, 0), ("f32", 129, 264, 0)]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("fmt,out,inp,group", GEMV_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-g{c[3]}" for c in GEMV_CASES])
def test_gemv_rows(rng, fmt, out, inp, group, M):
    w = Weight(rng, out, inp, fmt, group or 64)
    x = rng.standard_normal((M, inp)).astype(np.float32)
    rows = ops_metal.gemv(w, x)
    one = ops_metal.gemv(w, x, nm=1)
    _same_bits(f"gemv_{fmt} M={M} {out}x{inp}", rows, one)
    ref = x.astype(np.float64) @ w.dense.T
    assert_close(f"gemv_{fmt}_m{M} {out}x{inp} g{group}", rows, ref, rel_tol(ops_metal, "linear"))
    # the residual add fused (y += x W^T), as the out-projections run it
    y0 = rng.standard_normal((M, out)).astype(np.float32)
    rows = ops_metal.gemv(w, x, y0)
    _same_bits(f"gemv_{fmt} M={M} accumulate", rows, ops_metal.gemv(w, x, y0, nm=1))
    assert_close(f"gemv_{fmt}_m{M} accumulate", rows, y0 + ref, rel_tol(ops_metal, "linear"))


def test_row_groups_match_the_host_split():
    """ops_metal.row_groups is Ops::linear's split: every row covered once, groups of up to 8 rows, full groups."""
    for S in range(1, 27):
        covered = []
        for r0, m, n in ops_metal.row_groups(S):
            assert 1 <= m <= 8 and n >= 1
            covered += list(range(r0, r0 + m * n))
        assert covered == list(range(S)), S
        assert len(ops_metal.row_groups(S)) == (1 if S <= 8 or S % 8 == 0 else 2)


def _moe_layer(rng, E, H, I, Is, fmt):
    """q4 experts with a q8 router and gate (group 32), or bf16 experts with a bf16 router and an f32 gate."""
    router, gate = ("q8", "q8") if fmt == "q4" else ("bf16", "f32")
    return {"router": Weight(rng, E, H, router, 32), "gate": Weight(rng, I, H, fmt, 32, experts=E),
            "up": Weight(rng, I, H, fmt, 32, experts=E), "down": Weight(rng, H, I, fmt, 32, experts=E),
            "sh_gate": Weight(rng, Is, H, fmt, 32), "sh_up": Weight(rng, Is, H, fmt, 32),
            "sh_down": Weight(rng, H, Is, fmt, 32), "sh_expert_gate": Weight(rng, 1, H, gate, 32)}


def _rows(rng, W, M, H, E, k, mode):
    """h [M, H] routed as `mode` says: "random" (rows share some experts and not others), "same" (every row the same
    k experts, each row in another order: the per-row slot order of the combine), "disjoint" (no expert shared)."""
    h = (rng.standard_normal((M, H)) * 0.5).astype(np.float32)
    if mode == "random":
        return h
    r = W["router"]
    dense = np.zeros((E, H), np.float32)
    for m in range(M):  # feature m selects row m's experts, in a row-specific order
        experts = np.arange(k) if mode == "same" else (np.arange(k) + k * m) % E
        dense[experts, m] = 1.0 + 0.25 * rng.permutation(k)
        h[m, :M] = 0.0
        h[m, m] = 8.0
    W["router"] = Weight(rng, E, H, r.fmt, r.group, w=dense)
    return h


MOE_CASES = [("q4", 16, 8, "random"), ("bf16", 16, 8, "random"), ("q4", 16, 8, "same"), ("bf16", 64, 8, "disjoint"),
             ("q4", 9, 3, "random")]


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("fmt,E,k,mode", MOE_CASES, ids=[f"{c[0]}-E{c[1]}-k{c[2]}-{c[3]}" for c in MOE_CASES])
def test_moe_decode_rows(rng, fmt, E, k, mode, M):
    if mode == "disjoint" and M * k > E:
        pytest.skip(f"{E} experts keep at most {E // k} rows of {k} apart")
    # I != Is: the shared expert's threadgroups past Is rows have nothing to write; H of 5 / 20 chunks
    H, I, Is = (160, 96, 64) if fmt == "q4" else (40, 48, 24)
    W = _moe_layer(rng, E, H, I, Is, fmt)
    h = _rows(rng, W, M, H, E, k, mode)
    ids, _ = ref_route(h @ W["router"].dense.T, k, True)
    shared = [len(set(ids[m]) & set(ids[:m].ravel())) for m in range(M)]
    if mode == "disjoint":
        assert not any(shared)
    if mode == "same":
        assert all(set(r) == set(ids[0]) for r in ids) and (M == 1 or len({tuple(r) for r in ids}) > 1)
    x = rng.standard_normal((M, H)).astype(np.float32)
    rows = ops_metal.moe_decode(x, h, W, k)
    one = ops_metal.moe_decode(x, h, W, k, nm=1)
    _same_bits(f"moe decode {fmt} E={E} k={k} {mode} M={M}", rows, one)
    tensors, quant = moe_tensors(W)
    ref = moe_ffn(h, Weights(tensors, quant), 0, SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=True))
    assert_close(f"moe decode {fmt}_m{M} E={E} k={k} {mode} (experts shared with earlier rows: {shared})",
                 rows - x, ref, rel_tol(ops_metal, "moe"))


# ---- the engine: an exact-rows forward over S streams' rows against each stream's one-row steps ----

N_STEPS = 3


def _engine_case():
    from lily.testing import random_weights, tiny_configs
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, 6)
    return cfg, tensors, quant


@pytest.mark.parametrize("n_streams", [3, 9])
def test_streams_stepped_together_equal_their_solo_steps(n_streams):
    """n_streams greedy streams, every step taken by all of them in one forward (Engine.step_streams: the GEMVs and the
    fused MoE decode over the streams' rows; 9 = a group of 8 and the rest), against each stream alone (one-row steps):
    the same tokens, the KV caches and DeltaNet states they leave bit for bit (every row of every step wrote into
    them), and the logits of one more one-row step on each state bit for bit."""
    import test_metal_backend as t_be

    cfg, tensors, quant = _engine_case()
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, 2 + i % 4).astype(np.int32) for i in range(n_streams)]

    def opened(eng, p):
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, p, logits="last")[-1]))
        return st, eng.open_stream(st, first, N_STEPS, temperature=0.0, batch=True)

    def ended(eng, st, toks):
        arrays = {k: np.array(v) for k, v in st.export_arrays().items()}
        return toks, arrays, np.array(eng.forward(st, np.array(toks[-1:], np.int32), logits="last")[-1])

    def run():
        eng = t_be.metal_engine(cfg, tensors, quant, debug=True)
        solo = []
        for p in prompts:
            st, s = opened(eng, p)
            toks = []
            while (t := s.next()) >= 0:
                toks.append(t)
            s.close()
            solo.append(ended(eng, st, toks))
        streams = [opened(eng, p) for p in prompts]
        got, stepped = [[] for _ in streams], []
        while not all(s.ended for _, s in streams):
            stepped.append(eng.step_streams([s for _, s in streams]))
            for i, (_, s) in enumerate(streams):
                if not s.ended and (t := s.next()) >= 0:
                    got[i].append(t)
        for _, s in streams:
            s.close()
        return solo, [ended(eng, st, g) for (st, _), g in zip(streams, got)], stepped

    solo, together, stepped = t_be._in_child(run)
    assert stepped[:N_STEPS - 1] == [n_streams] * (N_STEPS - 1), stepped
    for i, ((t_solo, a_solo, l_solo), (t_tog, a_tog, l_tog)) in enumerate(zip(solo, together)):
        assert t_tog == t_solo, f"stream {i}: tokens {t_tog} stepped together, {t_solo} alone"
        assert sorted(a_tog) == sorted(a_solo) and int(a_tog["position"]) == len(prompts[i]) + N_STEPS
        for name in a_solo:
            if name != "position":
                _same_bits(f"stream {i} of {n_streams}: {name}", a_tog[name], a_solo[name])
        assert np.all(np.isfinite(l_tog))
        _same_bits(f"stream {i} of {n_streams}: logits after", l_tog, l_solo)

"""MoE family: routing (softmax, top-k, renormalisation, ties to the lower id) and the whole MoE FFN (routing,
experts, shared expert, combine) on every backend against lily.reference.moe, with experts that get no rows and
all rows sent to one expert; then the Metal kernels one by one: the device routing chain (top-k, histogram,
offsets, block map, stable scatter), the prefill chain (grouped GEMMs + combine), the fused decode chains."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from kernel_inputs import Weight, moe_tensors, moe_weights, rel_tol
from ops_metal import moe_decode, moe_prefill, route
from lily.testing.tolerances import tol

import lily.reference.moe as reference_moe
from lily.reference.linear import Weights
from lily.reference.moe import moe_ffn
from lily.reference.moe import route as ref_route
from lily.reference.ops import softmax
from lily.testing import random_weights, tiny_configs

TOL = tol("op_vs_reference")["rel_rms"]
CONFIGS = tiny_configs()


@pytest.mark.parametrize("S,E,k", [(1, 5, 3), (2, 8, 2), (63, 256, 8), (64, 8, 1), (65, 64, 8)])
def test_moe_route(backend, rng, S, E, k):
    logits = rng.standard_normal((S, E)).astype(np.float32) * 2
    for norm in (True, False):
        ids, wts = backend.moe_route(logits, k, norm)
        ref_ids, ref_wts = ref_route(logits, k, norm)
        np.testing.assert_array_equal(ids, ref_ids)
        assert_close(f"{backend.NAME} route S={S} E={E} k={k} norm={norm}", wts, ref_wts, TOL)


def test_moe_route_all_rows_to_one_expert_and_ties(backend):
    logits = np.zeros((65, 8), np.float32)
    logits[:, 5] = 4.0          # every row's first choice is expert 5; the rest tie -> lowest ids (0, 1)
    ids, _ = backend.moe_route(logits, 3, True)
    np.testing.assert_array_equal(ids, np.tile([5, 0, 1], (65, 1)))


def _moe_layer(rng, E, H, I, Is, fmt, router_fmt, mode):
    """MoE weights {router, gate, ...: Weight} and rows h [.., H] routed as `mode` says: "spread" (random),
    "one_expert" (every row's first choice is expert E-1), "dead_experts" (the first half never chosen)."""
    g = 32 if fmt in ("q4", "q8") else 64
    r = (rng.standard_normal((E, H)) * H ** -0.5).astype(np.float32)
    # feature 0 of h is a large constant (see _moe_rows); its router column decides the mode
    r[:, 0] = 0.0
    if mode == "one_expert":
        r[E - 1, 0] = 2.0
    elif mode == "dead_experts":
        r[:E // 2, 0] = -2.0
    return {"router": Weight(rng, E, H, router_fmt, 32, w=r), "gate": Weight(rng, I, H, fmt, g, experts=E),
            "up": Weight(rng, I, H, fmt, g, experts=E), "down": Weight(rng, H, I, fmt, g, experts=E),
            "sh_gate": Weight(rng, Is, H, fmt, g), "sh_up": Weight(rng, Is, H, fmt, g),
            "sh_down": Weight(rng, H, Is, fmt, g), "sh_expert_gate": Weight(rng, 1, H, router_fmt, 32)}


MOE_CASES = [  # S, E, k, fmt (experts and shared expert), router fmt, mode
    (1, 8, 2, "q4", "q8", "spread"), (2, 64, 2, "q4", "q8", "spread"), (63, 8, 2, "bf16", "q8", "spread"),
    (64, 16, 4, "bf16", "f32", "dead_experts"), (65, 8, 3, "q4", "q8", "one_expert"),
    (1, 16, 8, "bf16", "bf16", "one_expert"), (5, 256, 8, "q4", "q8", "dead_experts"),
    (63, 8, 2, "q8", "bf16", "spread"), (2, 16, 8, "f32", "bf16", "one_expert")]


@pytest.mark.parametrize("S,E,k,fmt,router_fmt,mode", MOE_CASES)
def test_moe(backend, rng, S, E, k, fmt, router_fmt, mode):
    if fmt not in backend.MOE_EXPERT_FORMATS:
        pytest.skip(f"the {backend.NAME} backend has no MoE kernels for {fmt} experts")
    H, I, Is = 128, 96, 64
    W = _moe_layer(rng, E, H, I, Is, fmt, router_fmt, mode)
    h = rng.standard_normal((S, H)).astype(np.float32)
    h[:, 0] = 8.0
    ids, _ = ref_route(h @ W["router"].dense.T, k, True)
    assert mode != "one_expert" or np.all(ids[:, 0] == E - 1)   # the routing is the one the case names
    assert mode != "dead_experts" or np.all(ids >= E // 2)
    tensors, quant = moe_tensors(W)
    cfg = SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=True)
    _check_moe(backend, f"moe S={S} E={E} k={k} {fmt}/{router_fmt} {mode}", h, W, Weights(tensors, quant), cfg)


@pytest.mark.parametrize("name,S", [("tiny", 1), ("tiny_dk_ne_dv", 40), ("tiny_odd", 19)])
def test_moe_tiny_configs(backend, rng, name, S):
    cfg, ref_w, W = _layer(name)
    h = rng.standard_normal((S, cfg.hidden_size)).astype(np.float32)
    _check_moe(backend, f"moe {name} S={S}", h, W, ref_w, cfg)


def _check_moe(backend, name, h, W, ref_w, cfg):
    """backend.moe(h) vs lily.reference.moe.moe_ffn. A backend whose router runs on bf16 operands (ROUTER_BF16) may
    route a row to an expert whose fp32 logit ties the reference's k-th within rounding: its routing must differ from
    the reference's only at such near-ties (tol routing_tie), and the reference then runs with the backend's routing."""
    k, norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
    got = backend.moe(h, W, k, norm)
    route = ref_route
    if getattr(backend, "ROUTER_BF16", False):
        ids = backend.moe_routing(h, W, k, norm)
        _assert_routing_near_ties(h @ W["router"].dense.T, ids, k)
        route = _routed_as(ids)
    saved, reference_moe.route = reference_moe.route, route  # moe_ffn's selection, pinned for this call only
    try:
        ref = moe_ffn(h, ref_w, 0, cfg)
    finally:
        reference_moe.route = saved
    assert_close(f"{backend.NAME} {name}", got, ref, rel_tol(backend, "moe"))


def _assert_routing_near_ties(logits, ids, k):
    """ids [S, k] picks the reference's experts (logits [S, E] fp32), except experts within the routing_tie gap of
    the reference's k-th logit of the row."""
    gap = tol("routing_tie", "bf16")["logit_gap"]
    want = ref_route(logits, k, True)[0]
    swapped = 0
    for s in range(len(logits)):
        differ = set(ids[s].tolist()) ^ set(want[s].tolist())
        if not differ:
            continue
        swapped += 1
        kth = logits[s, want[s, -1]]
        scale = np.sqrt(np.mean(logits[s].astype(np.float64) ** 2))
        far = [e for e in differ if abs(logits[s, e] - kth) > gap * scale]
        assert not far, f"row {s}: experts {sorted(differ)} routed apart, {far} not near the k-th logit {kth:.4f}"
    print(f"routing: {swapped} of {len(logits)} rows swapped an expert at a near-tie")


def _routed_as(ids):
    """lily.reference.moe.route with its selection pinned to ids [S, k]; the weights are the reference's softmax
    at those experts (renormalised over them when asked)."""
    def route(logits, top_k, renormalize):
        wts = np.take_along_axis(softmax(logits.astype(np.float32), axis=-1), ids, axis=-1)
        return ids, wts / wts.sum(-1, keepdims=True) if renormalize else wts
    return route


# ---- Metal: the device routing chain, the prefill and the fused decode chains, kernel by kernel ----


def _check_route(r, logits, k, bm):
    S, E = logits.shape
    ids, wts = ref_route(logits, k, True)
    np.testing.assert_array_equal(r["ids"], ids)
    assert_close(f"route weights S={S} E={E} k={k}", r["wts"], wts, TOL)
    counts = np.bincount(ids.ravel(), minlength=E)
    np.testing.assert_array_equal(r["counts"].sum(0), counts)
    # sorted order: experts ascending, rows ascending within an expert; inv points back
    start = np.concatenate([[0], np.cumsum(counts)])
    for e in range(E):
        rows = r["sorted_row"][start[e]:start[e + 1]]
        np.testing.assert_array_equal(rows, np.sort(np.nonzero((ids == e).any(1))[0]))
    s_idx = np.repeat(np.arange(S), k)
    np.testing.assert_array_equal(r["sorted_row"][r["inv"].ravel()], s_idx)
    np.testing.assert_array_equal(r["sorted_w"][r["inv"].ravel()], r["wts"].ravel())
    te, tr0, trn, n, _ = r["block_map"]
    assert n == sum(-(-c // bm) for c in counts)
    cover = np.zeros(S * k, int)
    for t in range(n):
        assert 0 < trn[t] <= bm and start[te[t]] <= tr0[t] and tr0[t] + trn[t] <= start[te[t] + 1]
        cover[tr0[t]:tr0[t] + trn[t]] += 1
    assert np.all(cover == 1)


@pytest.mark.parametrize("S,E,k,bm", [(37, 8, 2, 32), (70, 256, 8, 16), (1, 5, 3, 32)])
def test_route(rng, S, E, k, bm):
    logits = rng.standard_normal((S, E)).astype(np.float32) * 2
    _check_route(route(logits, k, bm=bm), logits, k, bm)


def test_route_all_rows_to_one_expert_and_ties(rng):
    S, E, k = 70, 8, 2
    logits = np.zeros((S, E), np.float32)
    logits[:, 5] = 4.0          # every row's first choice is expert 5; the rest tie -> lowest id (0)
    r = route(logits, k, bm=16)
    np.testing.assert_array_equal(r["ids"], np.tile([5, 0], (S, 1)))
    _check_route(r, logits, k, 16)


@pytest.mark.parametrize("E,k", [(8, 2), (256, 8)])
def test_route_nonfinite_row_stays_in_range(rng, E, k):
    """A NaN residual upstream makes a router row NaN: its slots go to expert 0 with NaN weights (so the NaN reaches
    the output) instead of an id past E, which the histogram would use as an index; finite rows are unaffected."""
    logits = rng.standard_normal((4, E)).astype(np.float32) * 2
    logits[0] = np.nan
    logits[2, E // 2] = np.nan
    r = route(logits, k, bm=16)
    for s in (0, 2):
        np.testing.assert_array_equal(r["ids"][s], np.zeros(k, np.int32))
        assert np.all(np.isnan(r["wts"][s]))
    ids, wts = ref_route(logits[[1, 3]], k, True)
    np.testing.assert_array_equal(r["ids"][[1, 3]], ids)
    assert_close("finite rows beside NaN rows", r["wts"][[1, 3]], wts, TOL)
    assert np.all((r["ids"] >= 0) & (r["ids"] < E))


def _layer(name, seed=3):
    cfg = CONFIGS[name]
    tensors, quant = random_weights(cfg, seed=seed)
    return cfg, Weights(tensors, quant), moe_weights(tensors, quant, 0)


@pytest.mark.parametrize("name,S,bm", [("tiny", 19, 32), ("tiny_dk_ne_dv", 40, 16), ("tiny_odd", 5, 32)])
def test_moe_prefill_vs_reference(rng, name, S, bm):
    cfg, ref_w, W = _layer(name)
    H = cfg.hidden_size
    x = rng.standard_normal((S, H)).astype(np.float32)
    h = rng.standard_normal((S, H)).astype(np.float32)
    got = moe_prefill(x, h, W, cfg.num_experts_per_tok, cfg.norm_topk_prob, bm)
    # compare the MoE branch itself (x is added in the kernel, and would dilute the error)
    assert_close(f"moe prefill {name} S={S} bm={bm}", got - x, moe_ffn(h, ref_w, 0, cfg), TOL)


@pytest.mark.parametrize("name", ["tiny", "tiny_dk_ne_dv", "tiny_odd"])
def test_moe_decode_vs_reference(rng, name):
    cfg, ref_w, W = _layer(name)
    H = cfg.hidden_size
    x = rng.standard_normal((1, H)).astype(np.float32)
    h = rng.standard_normal((1, H)).astype(np.float32)
    got = moe_decode(x, h, W, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    assert_close(f"moe decode {name}", got - x, moe_ffn(h, ref_w, 0, cfg), TOL)

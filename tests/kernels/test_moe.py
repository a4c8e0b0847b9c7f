"""metal/moe.metal: routing on the device (top-k, histogram, offsets, block map, stable scatter), the
prefill chain (grouped GEMMs + combine) and the fused decode chains, against lily.reference.moe."""
from __future__ import annotations

import numpy as np
import pytest
from _metrics import assert_close
from metal_ops import moe_decode, moe_prefill, moe_weights, route
from tolerances import tol

from lily.reference.linear import Weights
from lily.reference.moe import moe_ffn
from lily.reference.moe import route as ref_route
from lily.testing import random_weights, tiny_configs

TOL = tol("op_vs_reference")["rel_rms"]
CONFIGS = tiny_configs()


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

"""The chunked DeltaNet recurrence on Metal (metal/deltanet_chunk.metal: WY/UT, chunk 64, simdgroup matrices),
on the emulator under its three schedules with the outputs NaN-poisoned first: against lily.reference's
sequential recurrence and against the sequential Metal kernel (deltanet_scan) on awkward shapes (Dk != Dv, odd row
counts around the chunk boundaries, odd head counts, a non-zero initial state); prefill chunks that alternate
the two forms carry the one state; and the tiny model through the Metal backend with each form forced
(backend flag deltanet_form) equals the CPU backend."""
from __future__ import annotations

import numpy as np
import pytest
from lily.testing.metrics import assert_close
from metal_env import emu, lib
import ops_metal as mtl  # the Metal kernels by name (their names are the reference functions' too)
from ops_metal import deltanet_params
from lily.testing.tolerances import tol

from lily.reference.deltanet import deltanet_scan, gated_rms_norm
from lily.reference.ops import silu

TOL = tol("op_vs_reference")["rel_rms"]
SELF_TOL = tol("self_consistency")["rel_rms"]
CHUNK, THREADS, STATE_ROWS = 64, 256, 32  # deltanet_chunk.metal's kChunk, kChunkThreads, kStateRows


def _nk(dk: int) -> int:
    return 1 if dk <= 32 else 2 if dk <= 64 else 4


def deltanet_scan_chunked(u, b, a, a_log, dt_bias, state, p, z=None, norm_w=None):
    """The chunked form as csrc/metal/ops_metal.cpp's deltanet_scan_chunked encodes it: prep -> state (-> gated norm).
    u [S, C]; b, a [S, Hv]; a_log, dt_bias [Hv]; state [Hv, Dv, Dk] -> (o or y [S, Hv*Dv], state')."""
    S = u.shape[0]
    Hv, Dv, Dk = state.shape
    nk = _nk(Dk)
    dkp, nc = 32 * nk, -(-S // CHUNK)
    # scratch regions W, U, P, Qg, Kd, LG (all written by the prep kernel: poisoned first)
    scratch = [np.zeros((Hv, nc, CHUNK, n), np.float32) for n in (dkp, Dv, CHUNK, dkp, dkp, 1)]
    L = lib("deltanet_chunk")
    regions = emu.run3(L, f"deltanet_chunk_prep_nk{nk}", (nc, Hv, 1), (THREADS, 1, 1),
                       [u, b, a, a_log, dt_bias, *scratch, p], outputs=[5, 6, 7, 8, 9, 10])
    o, st = emu.run3(L, f"deltanet_chunk_state_nk{nk}", (-(-Dv // STATE_ROWS), Hv, 1), (THREADS, 1, 1),
                     [*regions, state, np.zeros((S, Hv * Dv), np.float32), p], outputs=[7, 6], poison=[7])
    if z is not None:
        o = mtl.deltanet_gated_norm(o, z, norm_w, p)
    return o, st


def _scan_inputs(rng, S, Hk, Hv, Dk, Dv):
    """u [S, C] (post conv SiLU), b, a [S, Hv], a_log, dt_bias [Hv], state [Hv, Dv, Dk] (non-zero)."""
    C = 2 * Hk * Dk + Hv * Dv
    f = np.float32
    return (silu(rng.standard_normal((S, C))).astype(f), rng.standard_normal((S, Hv)).astype(f),
            rng.standard_normal((S, Hv)).astype(f), np.log(rng.uniform(0.5, 8.0, Hv)).astype(f),
            rng.uniform(-1, 1, Hv).astype(f), (rng.standard_normal((Hv, Dv, Dk)) * 0.1).astype(f))


# S, Hk, Hv, Dk, Dv: one row, chunk boundaries (63, 64, 65, 128 + 2), a partial third chunk (200); odd value-head
# counts, GQA ratios 1..3, Dk != Dv everywhere, Dk not a multiple of 32 (padded key columns), Dv not a multiple
# of 32 (a partial state-row block) and Dv > 32 (two blocks), the real Dk = 128
SHAPES = [(1, 2, 4, 32, 48), (2, 1, 3, 48, 40), (63, 1, 5, 16, 40), (64, 1, 3, 64, 32), (65, 2, 6, 32, 72),
          (130, 1, 3, 40, 24), (200, 2, 2, 128, 72)]


@pytest.mark.parametrize("S,Hk,Hv,Dk,Dv", SHAPES)
def test_chunked_scan_vs_reference_and_sequential(rng, S, Hk, Hv, Dk, Dv):
    u, b, a, a_log, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    p = deltanet_params(Hk, Hv, Dk, Dv, 4, S)
    o, st = deltanet_scan_chunked(u, b, a, a_log, dt_bias, state, p)
    ref_o, ref_st = deltanet_scan(u, b, a, a_log, dt_bias, state, Hk)
    name = f"deltanet_chunk S={S} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}"
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(st)), f"{name}: unwritten (NaN) outputs"
    assert_close(name, o, ref_o.reshape(S, -1), TOL)
    assert_close(name + " state", st, ref_st, TOL)
    # the sequential Metal kernel on the same inputs: the two forms agree to summation order
    seq_o, seq_st = mtl.deltanet_scan(u, b, a, a_log, dt_bias, state, p)
    assert_close(name + " vs deltanet_scan", o, seq_o, SELF_TOL)
    assert_close(name + " state vs deltanet_scan", st, seq_st, SELF_TOL)


@pytest.mark.parametrize("S,Hk,Hv,Dk,Dv", [(65, 1, 3, 48, 40), (1, 2, 2, 128, 128)])
def test_chunked_scan_with_gated_norm(rng, S, Hk, Hv, Dk, Dv):
    """The chunked form followed by deltanet_gated_norm (what the backend encodes) vs the reference."""
    u, b, a, a_log, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    z = rng.standard_normal((S, Hv * Dv)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(Dv)).astype(np.float32)
    y, st = deltanet_scan_chunked(u, b, a, a_log, dt_bias, state, deltanet_params(Hk, Hv, Dk, Dv, 4, S), z=z, norm_w=w)
    ref_o, ref_st = deltanet_scan(u, b, a, a_log, dt_bias, state, Hk)
    ref_y = gated_rms_norm(ref_o, z.reshape(S, Hv, Dv), w, 1e-6)
    assert_close(f"deltanet_chunk + gated norm S={S} Dk={Dk} Dv={Dv}", y, ref_y.reshape(S, -1), TOL)
    assert_close(f"deltanet_chunk + gated norm state S={S}", st, ref_st, TOL)


def test_chunked_scan_strong_decay_underflows_cleanly(rng):
    """Decays near 0 (log g ~ -60 per token): the in-chunk ratios exp(lg_i - lg_j) underflow to 0 instead of
    forming 0/0, and the chunked form still equals the reference."""
    S, Hk, Hv, Dk, Dv = 70, 1, 2, 32, 40
    u, b, _, _, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    a = rng.uniform(5, 8, (S, Hv)).astype(np.float32)
    a_log = np.full(Hv, np.log(8.0), np.float32)
    p = deltanet_params(Hk, Hv, Dk, Dv, 4, S)
    o, st = deltanet_scan_chunked(u, b, a, a_log, dt_bias, state, p)
    ref_o, ref_st = deltanet_scan(u, b, a, a_log, dt_bias, state, Hk)
    assert_close("deltanet_chunk strong decay", o, ref_o.reshape(S, -1), TOL)
    assert_close("deltanet_chunk strong decay state", st, ref_st, TOL)


def test_prefill_chunks_alternate_forms(rng):
    """Rows [0, 70) chunked, [70, 75) sequential, [75, 140) chunked, the state carried between them (the two
    kernels read and write the same [Hv, Dv, Dk] state) == the reference over all rows."""
    S, Hk, Hv, Dk, Dv = 140, 1, 3, 32, 48
    u, b, a, a_log, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    ref_o, ref_st = deltanet_scan(u, b, a, a_log, dt_bias, state, Hk)
    outs, st = [], state
    for (r0, r1), form in zip([(0, 70), (70, 75), (75, 140)], (deltanet_scan_chunked, mtl.deltanet_scan, deltanet_scan_chunked)):
        o, st = form(u[r0:r1], b[r0:r1], a[r0:r1], a_log, dt_bias, st, deltanet_params(Hk, Hv, Dk, Dv, 4, r1 - r0))
        outs.append(o)
    assert_close("chunked | sequential | chunked rows", np.concatenate(outs), ref_o.reshape(S, -1), TOL)
    assert_close("chunked | sequential | chunked state", st, ref_st, TOL)


# ---- the whole tiny model through the Metal backend (emulated), each DeltaNet form forced ----


@pytest.mark.parametrize("name,prompt,chunk", [("tiny_dk_ne_dv", 70, 67), ("tiny_odd", 33, 33)])
def test_model_chunked_form_equals_cpu(name, prompt, chunk):
    """Prefill with deltanet_form 2 (chunked: chunks of 67 and 3 rows, a partial DeltaNet chunk each) and deltanet_form 1
    (sequential) on emulated Metal, scratch NaN-poisoned (debug), vs the CPU backend's logits; then lock-step
    decode steps after the chunked prefill (the sequential form on the state the chunked one left)."""
    from test_metal_backend import _cpu_run, _in_child, _report, lock_step, metal_engine

    from lily.testing import random_weights, tiny_configs

    cfg = tiny_configs()[name]
    tensors, quant = random_weights(cfg, seed=17)
    toks = np.random.default_rng(8).integers(0, cfg.vocab_size, prompt).astype(np.int32)
    steps = 3

    def run():
        out = {}
        for form in (2, 1):
            eng = metal_engine(cfg, tensors, quant, debug=True)
            eng.set_backend_flag("deltanet_form", form)
            assert eng.backend_flag("deltanet_form") == form
            st = eng.new_state()
            pre = np.array(eng.forward(st, toks, logits="all", chunk_size=chunk))
            first = int(np.argmax(pre[-1]))
            gen, dec = lock_step(eng, st, first, steps)
            out[form] = (pre, first, gen, dec)
            del eng, st
        return out

    out = _in_child(run)
    pre, first, gen, dec = out[2]
    seq = np.concatenate([toks, [first], gen[:-1]]).astype(np.int32)
    ref, cpu_greedy = _cpu_run(cfg, tensors, quant, seq, prompt, steps)
    _report(f"{name} deltanet_form=2 prefill ({prompt} rows, chunks of {chunk})", pre, ref[:prompt], toks)
    _report(f"{name} deltanet_form=2 then decode steps ({steps})", dec, ref[prompt:], seq[prompt:])
    _report(f"{name} deltanet_form=1 prefill ({prompt} rows, chunks of {chunk})", out[1][0], ref[:prompt], toks)
    np.testing.assert_array_equal(gen, cpu_greedy, err_msg="greedy tokens after the chunked prefill differ")
    assert_close(f"{name} prefill: chunked vs sequential form", pre, out[1][0], SELF_TOL)


def test_model_auto_form_picks_by_chunk_length():
    """deltanet_form 0 (auto): a prefill chunk of 130 rows (>= Ops::kScanChunkMinRows = 128) runs the chunked form, bit
    for bit what deltanet_form 2 gives, and not the sequential form's bits; the 10-row chunk after it runs the
    sequential form. On a device that allows pipelines only 128 threads (fewer than the chunked kernels' 256),
    auto runs the sequential form and the flag refuses the chunked form with a message."""
    from test_metal_backend import _in_child, metal_engine

    from lily.testing import random_weights, tiny_configs

    cfg = tiny_configs()["tiny_dk_ne_dv"]
    tensors, quant = random_weights(cfg, seed=23)
    toks = np.random.default_rng(3).integers(0, cfg.vocab_size, 140).astype(np.int32)

    def run():
        out = {}
        for form in (0, 1, 2):
            eng = metal_engine(cfg, tensors, quant, schedule=0)
            eng.set_backend_flag("deltanet_form", form)
            out[form] = np.array(eng.forward(eng.new_state(), toks, logits="all", chunk_size=130))
            del eng
        small = metal_engine(cfg, tensors, quant, schedule=0, max_threads=128)
        out["auto_128"] = np.array(small.forward(small.new_state(), toks, logits="all", chunk_size=130))
        try:
            small.set_backend_flag("deltanet_form", 2)
            out["forced_128"] = "accepted"
        except Exception as ex:  # noqa: BLE001 - the message is checked below
            out["forced_128"] = str(ex)
        del small
        return out

    out = _in_child(run)
    assert "need 256 threads per threadgroup" in out["forced_128"], out["forced_128"]
    assert_close("auto on a 128-thread device vs the sequential form", out["auto_128"], out[1], SELF_TOL)
    np.testing.assert_array_equal(out[0][:130], out[2][:130], err_msg="auto did not run the chunked form")
    assert not np.array_equal(out[0][:130], out[1][:130]), "the forms gave the same bits: was one not run?"
    assert_close("auto vs sequential form, 140 rows", out[0], out[1], SELF_TOL)


# ---- the emulator's side: Apple's make_filled_simdgroup_matrix spelling, and a planted race ----

FILLED_MMA = """#include <metal_stdlib>
using namespace metal;
kernel void filled_mma(device const float* a [[buffer(0)]],   // [8, 8]
                       device float*       d [[buffer(1)]],   // [8, 8]
                       uint lane [[thread_index_in_simdgroup]])
{
    simdgroup_float8x8 ma, acc = make_filled_simdgroup_matrix<float, 8, 8>(1.5f);
    simdgroup_load(ma, a, 8, ulong2(0, 0), true);
    simdgroup_multiply_accumulate(acc, ma, ma, acc);
    simdgroup_store(acc, d, 8);
}
"""


def test_emulator_filled_simdgroup_matrix(tmp_path, rng):
    """make_filled_simdgroup_matrix<T, Cols, Rows>(v) fills every element (not only the diagonal), and a
    transposed load reads src^T: d = 1.5 + a^T a^T."""
    src = tmp_path / "filled_mma.metal"
    src.write_text(FILLED_MMA)
    a = rng.standard_normal((8, 8)).astype(np.float32)
    d, = emu.run3(emu.library(str(src)), "filled_mma", (1, 1, 1), (32, 1, 1), [a, np.zeros((8, 8), np.float32)],
                  outputs=[1])
    np.testing.assert_allclose(d, 1.5 + a.T @ a.T, rtol=1e-5, atol=1e-5)


def test_planted_missing_barrier_is_caught(tmp_path, rng):
    """deltanet_chunk_state without the barrier between the state's gamma_last scaling and step 3: the emulator's
    schedules disagree (or a tile reads a value still unscaled), so the race cannot pass silently."""
    import metal_env

    text = open(f"{metal_env.METAL_DIR}/deltanet_chunk.metal").read()
    planted = text.replace("threadgroup_barrier(mem_flags::mem_threadgroup);   // tg_s scaled", "", 1)
    assert planted != text
    path = tmp_path / "deltanet_chunk.metal"
    path.write_text(planted)
    S, Hk, Hv, Dk, Dv = 70, 1, 1, 32, 32
    u, b, a, a_log, dt_bias, state = _scan_inputs(rng, S, Hk, Hv, Dk, Dv)
    metal_env.OVERRIDE["deltanet_chunk"] = str(path)
    try:
        with pytest.raises(emu.EmulatorError):
            deltanet_scan_chunked(u, b, a, a_log, dt_bias, state, deltanet_params(Hk, Hv, Dk, Dv, 4, S))
    finally:
        metal_env.OVERRIDE.pop("deltanet_chunk")

"""The whole tiny model through the Metal backend (csrc/metal) on the emulated device, driven like any other
backend: `lily._lily.Engine(backend="metal", options={"emu_kernel_libs": ...})`, so the real Engine, its one
layer loop, the bindings and the token loop run on emulated Metal. Prefill in several chunks (teacher-forced
logits for every row), lock-step decode steps (logits) and device-mode greedy streams (tokens drawn on the
device, one step ahead) are compared with the CPU backend. The backend computes in fp32, so the fp32 rows of
the tolerance table apply (docs/numerics.md: a fp32 backend matches a fp32 reference almost exactly). Each run
happens in a forked child: a crash inside the emulator fails the test instead of the test process."""
from __future__ import annotations

import gc
import os
import pickle
import signal

import numpy as np
import pytest
from lily.testing.metrics import perplexity, rel_rms, top1_agreement
from metal_env import emu, metal_files
from lily.testing.tolerances import ENVELOPE_SLACK_PPL, ENVELOPE_SLACK_TOP1, tol

from lily.testing import random_weights, tiny_configs

_lily = pytest.importorskip("lily._lily")
if "metal (emulated)" not in _lily.build_info()["backends"]:
    pytest.skip("this lily._lily was built without the emulated Metal backend (LILY_METAL_EMULATED=OFF)",
                allow_module_level=True)

TOL = tol("model_vs_reference")
_LIBS: list[str] = []


def kernel_libs() -> str:
    """The emulator builds of every metal/*.metal file (tools/msl/mslc.py, cached on disk), ';'-joined."""
    if not _LIBS:
        _LIBS.append(";".join(emu.library(f).lib._name for f in metal_files()))
    return _LIBS[0]


def metal_engine(cfg, tensors, quant, max_context=256, debug=False, **options):
    """The Metal backend on the emulated device. options: backend_metal.h's names without the emu_ prefix
    where they are emulator settings (schedule=0, max_threads=128, tensor_ops=1, kv_bf16=1, ...). debug: scratch
    poisoned with NaN before every chunk and step (then nothing runs ahead: begin_step waits)."""
    opts = {"emu_kernel_libs": kernel_libs(), "kv_bf16": "0"}
    for k, v in options.items():
        opts[k if k == "kv_bf16" else "emu_" + k] = v if isinstance(v, str) else str(int(v))
    os.environ["LILY_DEBUG"] = "1" if debug else "0"  # read when the engine is made (in the forked child)
    return _lily.Engine(cfg.to_dict(), tensors, quant, threads=1, max_context=max_context, backend="metal",
                        options=opts)


def _in_child(fn, timeout=600):
    kernel_libs()  # built once in the parent, so every child finds them
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(timeout)
        try:
            data = pickle.dumps(("ok", fn()))
        except BaseException as ex:  # noqa: BLE001 - reported to the parent
            data = pickle.dumps(("error", f"{type(ex).__name__}: {ex}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        pytest.fail(f"the Metal backend run crashed (status {status}: signal {os.WTERMSIG(status)})")
    kind, val = pickle.loads(data)
    if kind == "error":
        pytest.fail(val)
    return val


def lock_step(eng, st, first, n):
    """n lock-step decode steps from `first` (host argmax): tokens [n] and each step's logits [n, V]."""
    s = eng.open_stream(st, first, n, device=False)
    assert not s.device
    toks, rows, tok = [], [], first
    for _ in range(n):
        rows.append(np.array(s.step(tok)))
        tok = int(np.argmax(rows[-1]))
        toks.append(tok)
    s.close()
    return np.array(toks, np.int32), np.stack(rows)


def device_stream(eng, st, first, n, stop_ids=()):
    """A device-mode greedy stream through the engine's token loop: the tokens next() returns."""
    s = eng.open_stream(st, first, n, stop_ids=list(stop_ids), temperature=0.0)
    assert s.device, "the Metal backend declined the greedy device sampler"
    out = []
    while (t := s.next()) >= 0:
        out.append(t)
    s.close()
    return np.array(out, np.int32)


def _cpu_run(cfg, tensors, quant, seq, prompt=None, steps=0):
    """Teacher-forced logits of the CPU backend over seq, and its greedy tokens after seq[:prompt] (steps of
    them); the engine (and its worker threads) is gone before the next test forks a child."""
    cpu = _lily.Engine(cfg.to_dict(), tensors, quant, threads=2, max_context=256)
    out = cpu.forward(cpu.new_state(), seq, logits="all")
    greedy = None
    if steps:
        st = cpu.new_state()
        first = int(np.argmax(cpu.forward(st, seq[:prompt], logits="last")[-1]))
        greedy = np.asarray(cpu.decode_greedy(st, first, steps))
    del cpu
    gc.collect()
    return out, greedy


def _report(name, metal, cpu, tokens):
    err = rel_rms(metal, cpu)
    t1 = top1_agreement(metal, cpu)
    ppl = perplexity(metal, tokens) / perplexity(cpu, tokens)
    print(f"{name:44s} top1 {t1:.4f}  ppl ratio {ppl:.6f}  rel_rms {err:.3e}")
    assert np.all(np.isfinite(metal)), f"{name}: non-finite logits"
    assert err <= TOL["rel_rms"] and t1 >= TOL["top1"], f"{name}: rel_rms {err:.3e}, top-1 {t1:.3f}"


def _configs():
    from lily.config import ModelConfig
    from lily.testing.configs import tiny_config_dicts
    out = tiny_configs()
    # the real per-head shapes (head_dim 256, GQA 8:1, Dk = Dv = 128, 256 experts top-8) at small width:
    # the specialisations the full model uses (attn *_nd8_h8, deltanet_scan_norm_nk4 with 1024 threads, topk_j8);
    # narrow hidden and expert widths keep the emulated grouped GEMMs (one tile per routed row) affordable
    d = dict(tiny_config_dicts()["tiny"])
    d.update(hidden_size=256, num_hidden_layers=4, vocab_size=1024, num_attention_heads=16, num_key_value_heads=2,
             head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
             linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=64,
             shared_expert_intermediate_size=64)
    out["mid_real_heads"] = ModelConfig.from_dict(d)
    return out


@pytest.mark.parametrize("name,prompt,chunk,steps,max_threads", [
    ("tiny", 40, 16, 8, 1024), ("tiny_dk_ne_dv", 21, 8, 5, 1024), ("tiny_odd", 13, 5, 4, 1024),
    ("tiny", 9, 4, 3, 128),    # 128: pipelines limited as Apple may limit register-heavy ones (fallback paths)
    ("mid_real_heads", 10, 6, 3, 1024)])
def test_model_prefill_chunks_then_decode(name, prompt, chunk, steps, max_threads):
    """Prefill in chunks and lock-step decode steps (debug: scratch poisoned) vs the CPU backend's logits;
    then, on an engine that runs ahead, engine.decode_greedy and a device-mode token stream: the CPU's greedy
    tokens."""
    cfg = _configs()[name]
    tensors, quant = random_weights(cfg, seed=21)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, prompt).astype(np.int32)

    def run():
        eng = metal_engine(cfg, tensors, quant, debug=True, max_threads=max_threads)
        st = eng.new_state()
        pre = np.array(eng.forward(st, toks, logits="all", chunk_size=chunk))
        first = int(np.argmax(pre[-1]))
        gen, dec = lock_step(eng, st, first, steps)
        pos = st.position
        del eng, st
        fast = metal_engine(cfg, tensors, quant, max_threads=max_threads)
        st = fast.new_state()
        fast.forward(st, toks, logits="none", chunk_size=chunk)
        snap = st.snapshot()
        greedy = np.asarray(fast.decode_greedy(st, first, steps))
        st.restore(snap)
        streamed = device_stream(fast, st, first, steps)
        return pre, first, gen, dec, pos, greedy, streamed

    pre, first, gen, dec, pos, greedy, streamed = _in_child(run)
    assert pos == prompt + steps
    # CPU backend, teacher-forced on the same sequence (prompt + the tokens the Metal steps fed)
    seq = np.concatenate([toks, [first], gen[:-1]]).astype(np.int32)
    ref, cpu_greedy = _cpu_run(cfg, tensors, quant, seq, prompt, steps)
    tag = f"{name}" + (f" max_threads={max_threads}" if max_threads < 1024 else "")
    _report(f"{tag} prefill ({prompt} rows, chunks of {chunk})", pre, ref[:prompt], toks)
    _report(f"{tag} decode steps ({steps})", dec, ref[prompt:], seq[prompt:])
    assert first == int(np.argmax(ref[prompt - 1]))
    np.testing.assert_array_equal(gen, cpu_greedy, err_msg="lock-step greedy tokens differ from the CPU's")
    np.testing.assert_array_equal(greedy, cpu_greedy, err_msg="engine.decode_greedy differs from the CPU's")
    np.testing.assert_array_equal(streamed, cpu_greedy, err_msg="the device-mode stream differs from the CPU's")


def test_chunked_equals_unchunked_snapshot_restore_and_schedules():
    """Self-consistency of the backend on the emulated device: prefill in one chunk == in chunks of 3 (to
    summation order); decoding twice from a restored snapshot gives the same tokens and logits; and each of
    the emulator's three schedules, held fixed for the whole run, gives the same bits."""
    cfg = tiny_configs()["tiny_dk_ne_dv"]
    tensors, quant = random_weights(cfg, seed=4)
    toks = np.random.default_rng(9).integers(0, cfg.vocab_size, 11).astype(np.int32)

    def run():
        a = metal_engine(cfg, tensors, quant, debug=True)
        whole = np.array(a.forward(a.new_state(), toks, logits="all"))
        del a
        b = metal_engine(cfg, tensors, quant, debug=True)
        st = b.new_state()
        chunked = np.array(b.forward(st, toks, logits="all", chunk_size=3))
        snap = st.snapshot()
        t1, l1 = lock_step(b, st, int(np.argmax(chunked[-1])), 4)
        st.restore(snap)
        t2, l2 = lock_step(b, st, int(np.argmax(chunked[-1])), 4)
        del b, st, snap
        per_schedule = []
        for sched in (0, 1, 2):
            e = metal_engine(cfg, tensors, quant, schedule=sched)
            s = e.new_state()
            lg = np.array(e.forward(s, toks, logits="all", chunk_size=4))
            per_schedule.append((lg, np.asarray(e.decode_greedy(s, int(np.argmax(lg[-1])), 3))))
            del e, s
        return whole, chunked, t1, l1, t2, l2, per_schedule

    whole, chunked, t1, l1, t2, l2, per_schedule = _in_child(run)
    err = rel_rms(chunked, whole)
    print(f"metal chunked (3) vs unchunked prefill          rel_rms {err:.3e}")
    assert err <= tol("self_consistency")["rel_rms"]
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_array_equal(l1, l2)
    for lg, gen in per_schedule[1:]:
        np.testing.assert_array_equal(lg, per_schedule[0][0], err_msg="prefill logits depend on the schedule")
        np.testing.assert_array_equal(gen, per_schedule[0][1], err_msg="decoded tokens depend on the schedule")


def test_device_stream_stops_on_a_stop_id_and_at_max_tokens():
    """The engine's token loop on Metal: a stop id is returned and ends the stream (its step was already fed:
    the state holds it); max_tokens ends it with the last token unfed."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=3)
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, 7).astype(np.int32)

    def run():
        eng = metal_engine(cfg, tensors, quant)
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, toks, logits="last")[-1]))
        snap = st.snapshot()
        full = device_stream(eng, st, first, 8)
        pos_full = st.position
        st.restore(snap)
        stop = int(full[3])
        s = eng.open_stream(st, first, 8, stop_ids=[stop], temperature=0.0)
        out = []
        while (t := s.next()) >= 0:
            out.append(t)
        fed, returned = s.fed, s.returned
        s.close()
        # the host never waited for the device before launching a step, and committed step i + 1 before it
        # waited for step i (two command buffers in flight)
        assert eng.backend_counters()["step_waits"] == 0 and eng.backend_counters()["max_inflight"] == 2
        return full, pos_full, stop, out, fed, returned, st.position

    full, pos_full, stop, out, fed, returned, pos = _in_child(run)
    assert len(full) == 8 and pos_full == 7 + 8, "max_tokens: 8 tokens returned, the last one not fed"
    cut = list(full).index(stop)
    assert out == list(full[:cut + 1]) and returned == cut + 1
    assert fed == cut + 2 and pos == 7 + fed, "the stop token's step had run (first + every returned token)"


def test_stream_closed_early_continues_as_lock_step():
    """The host stops reading a device-mode stream after k tokens (a stop string it saw, a cancel) and closes
    it while the device has already launched the next step. The state must be exactly that of a lock-step run
    that fed the same tokens one by one: the logits after the last token (close(logits=True) vs the last
    step's) and after a next turn's prefill must agree. Bitwise, not to a tolerance: both runs issue the same
    kernels on the same inputs in the same order (the device draw only adds an argmax that writes the token
    slot, read by the same embed kernel), the emulated kernels give the same bits under every schedule
    (tests above and each kernel family's run3), so any difference is state the run-ahead corrupted."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=8)
    rng = np.random.default_rng(4)
    toks = rng.integers(0, cfg.vocab_size, 9).astype(np.int32)
    turn = rng.integers(0, cfg.vocab_size, 5).astype(np.int32)
    k = 3

    def run():
        eng = metal_engine(cfg, tensors, quant)
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, toks, logits="last")[-1]))
        snap = st.snapshot()
        s = eng.open_stream(st, first, 20, temperature=0.0)
        got = [s.next() for _ in range(k)]
        fed = s.fed
        after_stream = s.close(logits=True)
        pos_stream = st.position
        next_stream = np.array(eng.forward(st, turn, logits="all"))
        st.restore(snap)
        ls = eng.open_stream(st, first, 20, device=False)
        rows = [np.array(ls.step(t)) for t in [first, *got]]
        ls.close()
        pos_lock = st.position
        next_lock = np.array(eng.forward(st, turn, logits="all"))
        return first, got, fed, None if after_stream is None else np.array(after_stream), pos_stream, \
            next_stream, rows, pos_lock, next_lock

    first, got, fed, after_stream, pos_stream, next_stream, rows, pos_lock, next_lock = _in_child(run)
    assert fed == k + 1 and pos_stream == pos_lock == len(toks) + k + 1
    assert got == [int(np.argmax(r)) for r in rows[:-1]], "the stream's tokens are not the lock-step argmaxes"
    assert after_stream is not None, "close(logits=True) returned no logits"
    np.testing.assert_array_equal(after_stream, rows[-1])
    np.testing.assert_array_equal(next_stream, next_lock)
    # and both are the CPU backend's, to the fp32 bar
    seq = np.concatenate([toks, [first], got, turn]).astype(np.int32)
    ref, _ = _cpu_run(cfg, tensors, quant, seq)
    p = len(toks)
    _report("after an early-closed stream + next turn", np.concatenate([np.stack(rows), next_stream]),
            ref[p:], seq[p:])


@pytest.mark.parametrize("name", ["tiny", "mid_real_heads"])
def test_model_bf16_kv_cache(name):
    """The default on Apple: a bf16 KV cache (everything else fp32). Judged by docs/numerics.md's bar for a
    backend that computes in fp32 (top-1 >= 99 %, relative RMS <= 1e-3); measured 6e-5 here."""
    cfg = _configs()[name]
    tensors, quant = random_weights(cfg, seed=21)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).astype(np.int32)

    def run():
        eng = metal_engine(cfg, tensors, quant, debug=True, kv_bf16=1)
        st = eng.new_state()
        pre = np.array(eng.forward(st, toks, logits="all", chunk_size=5))
        gen, dec = lock_step(eng, st, int(np.argmax(pre[-1])), 3)
        return pre, gen, dec

    pre, gen, dec = _in_child(run)
    seq = np.concatenate([toks, [np.argmax(pre[-1])], gen[:-1]]).astype(np.int32)
    ref, _ = _cpu_run(cfg, tensors, quant, seq)
    metal = np.concatenate([pre, dec])
    err, t1 = rel_rms(metal, ref), top1_agreement(metal, ref)
    print(f"{name} bf16 KV vs CPU (fp32)                  top1 {t1:.4f}  rel_rms {err:.3e}")
    bar = tol("model_vs_cpu", "bf16_kv")
    assert np.all(np.isfinite(metal)) and t1 >= bar["top1"] and err <= bar["rel_rms"]


class _HalfMatrix:
    """A weight matrix whose products round the activation operand and the weight to half, as the tensor-op
    GEMMs do (numpy defers to it): the reference run for the rounding envelope of that path."""

    __array_ufunc__ = None

    def __init__(self, a):
        self.a = a

    @property
    def T(self):
        return _HalfMatrix(self.a.T)

    def __getitem__(self, i):
        return _HalfMatrix(self.a[i])

    def __rmatmul__(self, x):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32) @ self.a

    def __matmul__(self, x):
        return self.a @ np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def _half_envelope(cfg, tensors, quant, seq):
    """Logits of lily.reference with every matrix product's inputs rounded to half (docs/numerics.md envelope)."""
    from lily.reference import ReferenceEngine
    ref = ReferenceEngine(cfg, tensors, quant, max_context=256)
    dense = ref.weights.linear
    ref.weights.linear = lambda module: _HalfMatrix(dense(module).astype(np.float16).astype(np.float32))
    return ref.forward(ref.new_state(), seq, logits="all")


@pytest.mark.parametrize("name", ["tiny", "mid_real_heads"])
def test_model_tensor_op_gemms(name):
    """The device reports Metal 4 tensor ops: every prefill GEMM (plain, GLU, grouped experts) runs the
    tensor-op kernels of gemm_tensor.metal (half tiles, fp32 accumulation) through the shim's matmul2d.
    Judged against the rounding envelope of docs/numerics.md for that precision: lily.reference with every
    matrix product's inputs rounded to half, vs the CPU backend (fp32). The prefill must also differ from
    the fp32-tile run of the simdgroup path (else the option did not select the tensor-op kernels)."""
    cfg = _configs()[name]
    tensors, quant = random_weights(cfg, seed=21)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).astype(np.int32)

    def run():
        eng = metal_engine(cfg, tensors, quant, debug=True, tensor_ops=1)
        st = eng.new_state()
        pre = np.array(eng.forward(st, toks, logits="all", chunk_size=7))
        gen, dec = lock_step(eng, st, int(np.argmax(pre[-1])), 2)
        del eng, st
        if name != "tiny":   # the path-selection check once is enough
            return pre, gen, dec, None
        ref_eng = metal_engine(cfg, tensors, quant, debug=True, tensor_ops=0)
        pre32 = np.array(ref_eng.forward(ref_eng.new_state(), toks, logits="all", chunk_size=7))
        return pre, gen, dec, pre32

    pre, gen, dec, pre32 = _in_child(run)
    seq = np.concatenate([toks, [np.argmax(pre[-1])], gen[:-1]]).astype(np.int32)
    ref, _ = _cpu_run(cfg, tensors, quant, seq)
    env = _half_envelope(cfg, tensors, quant, seq)
    metal = np.concatenate([pre, dec])
    err, t1, ppl = rel_rms(metal, ref), top1_agreement(metal, ref), perplexity(metal, seq) / perplexity(ref, seq)
    e_err, e_t1, e_ppl = rel_rms(env, ref), top1_agreement(env, ref), perplexity(env, seq) / perplexity(ref, seq)
    print(f"{name} tensor-op GEMMs vs CPU (fp32)   top1 {t1:.4f}  ppl ratio {ppl:.6f}  rel_rms {err:.3e}   "
          f"envelope (half products): top1 {e_t1:.4f}  ppl ratio {e_ppl:.6f}  rel_rms {e_err:.3e}")
    assert np.all(np.isfinite(metal))
    assert t1 >= e_t1 - ENVELOPE_SLACK_TOP1 and abs(ppl - 1) <= abs(e_ppl - 1) + ENVELOPE_SLACK_PPL
    assert err <= 2 * e_err, "further from fp32 than twice the half-rounding envelope"
    assert pre32 is None or not np.array_equal(pre, pre32), "tensor_ops=1 ran the same kernels as the simdgroup path"


def test_options_are_checked():
    """Unknown option names and bad values are errors that name them; without kernel libraries the Linux
    build says the backend is the emulator and how to run it."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)
    with pytest.raises(ValueError, match="no option 'emu_schedul'"):
        _lily.Engine(cfg.to_dict(), tensors, quant, backend="metal",
                     options={"emu_kernel_libs": kernel_libs(), "emu_schedul": "1"})
    with pytest.raises(ValueError, match="emu_schedule='3'"):
        _lily.Engine(cfg.to_dict(), tensors, quant, backend="metal",
                     options={"emu_kernel_libs": kernel_libs(), "emu_schedule": "3"})
    with pytest.raises(RuntimeError, match="emulated device"):
        _lily.Engine(cfg.to_dict(), tensors, quant, backend="metal")
    with pytest.raises(ValueError, match="takes no options"):
        _lily.Engine(cfg.to_dict(), tensors, quant, backend="cpu", options={"emu_kernel_libs": kernel_libs()})


def test_decode_after_a_larger_prefill_chunk():
    """A prefill chunk larger than any before re-makes the per-chunk scratch; the decode attention's split-K
    partials must come back with it (they once went with the old scratch: the next decode step crashed)."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=4)
    seq = np.random.default_rng(4).integers(0, cfg.vocab_size, 60).astype(np.int32)

    def run():
        eng = metal_engine(cfg, tensors, quant)
        st = eng.new_state()
        tok = int(np.argmax(eng.forward(st, seq[:8], logits="last")[-1]))
        eng.forward(st, np.array([tok], np.int32), logits="last")  # a decode step: partials sized
        st2 = eng.new_state()
        eng.forward(st2, seq[:40], logits="last")  # a larger chunk: the scratch grows
        rows = [eng.forward(st, np.array([t], np.int32), logits="last")[0] for t in seq[9:13]]
        return np.stack(rows)

    metal = _in_child(run)
    cpu = _lily.Engine(cfg.to_dict(), tensors, quant, threads=2, max_context=256)
    st = cpu.new_state()
    tok = int(np.argmax(cpu.forward(st, seq[:8], logits="last")[-1]))
    cpu.forward(st, np.array([tok], np.int32), logits="last")
    want = np.stack([cpu.forward(st, np.array([t], np.int32), logits="last")[0] for t in seq[9:13]])
    assert rel_rms(metal, want) <= TOL["rel_rms"]

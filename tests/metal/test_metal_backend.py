"""The whole tiny model through the Metal backend (csrc/metal) on the emulated device: prefill in several
chunks (teacher-forced logits for every row), then the double-buffered greedy decode loop; logits compared
with the CPU backend. The backend computes in fp32, so the fp32 rows of the tolerance table apply (design.md
§8: a fp32 backend matches a fp32 reference almost exactly). Each run happens in a forked child: a crash
inside the emulator fails the test instead of the test process."""
from __future__ import annotations

import ctypes
import gc
import os
import pickle
import signal

import numpy as np
import pytest
from _metrics import perplexity, rel_rms, top1_agreement
from metal_env import emu, metal_files, mslc
from tolerances import ENVELOPE_SLACK_PPL, ENVELOPE_SLACK_TOP1, tol

from lily.testing import random_weights, tiny_configs

_lily = pytest.importorskip("lily._lily")

TOL = tol("model_vs_reference")
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.uint32): 2, np.dtype(np.int32): 3}


def _in_child(fn, timeout=600):
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


class EmulatedMetalEngine:
    """ctypes front of csrc/metal/emu_capi.cpp: the Metal backend on the emulated device."""

    def __init__(self, cfg, tensors, quant, max_context=256, schedule=-1, debug=True, host_lib=None,
                 max_threads=1024, kv_bf16=False, tensor_ops=False):
        libs = ";".join(emu.library(f).lib._name for f in metal_files())
        self.lib = lib = ctypes.CDLL(host_lib or mslc.build_host())
        lib.lily_metal_emu_new.restype = ctypes.c_void_p
        lib.lily_metal_emu_position.restype = ctypes.c_int64
        lib.lily_metal_emu_position.argtypes = [ctypes.c_void_p]
        lib.lily_metal_emu_free.argtypes = [ctypes.c_void_p]
        d = cfg.to_dict()
        nums = {k: float(v) for k, v in d.items() if isinstance(v, (int, float, bool))}
        self._keep = [np.ascontiguousarray(t) for t in tensors.values()]
        names = list(tensors)
        shapes = np.concatenate([np.array(t.shape, np.int64) for t in self._keep])
        cs = lambda xs: (ctypes.c_char_p * len(xs))(*[x.encode() for x in xs])  # noqa: E731
        self.V = cfg.vocab_size
        err = ctypes.create_string_buffer(4096)
        self.h = lib.lily_metal_emu_new(
            len(nums), cs(list(nums)), (ctypes.c_double * len(nums))(*nums.values()),
            len(d["layer_types"]), cs(d["layer_types"]),
            len(names), cs(names), (ctypes.c_void_p * len(names))(*[t.ctypes.data for t in self._keep]),
            (ctypes.c_int * len(names))(*[DTYPES[t.dtype] for t in self._keep]),
            (ctypes.c_int * len(names))(*[t.ndim for t in self._keep]), shapes.ctypes.data_as(ctypes.c_void_p),
            len(quant), cs(list(quant)), (ctypes.c_int * len(quant))(*[b for b, _ in quant.values()]),
            (ctypes.c_int * len(quant))(*[g for _, g in quant.values()]), libs.encode(), schedule, max_threads,
            ctypes.c_int64(max_context), int(debug), int(kv_bf16), int(tensor_ops), err, len(err))
        if not self.h:
            raise RuntimeError(err.value.decode())
        self._shapes = shapes

    def _check(self, rc, err):
        if rc:
            raise RuntimeError(err.value.decode())

    def forward(self, tokens, chunk):
        toks = np.ascontiguousarray(tokens, np.int32)
        out = np.zeros((len(toks), self.V), np.float32)
        err = ctypes.create_string_buffer(1 << 16)
        self._check(self.lib.lily_metal_emu_forward(ctypes.c_void_p(self.h), toks.ctypes.data_as(ctypes.c_void_p),
                                                    ctypes.c_int64(len(toks)), 1, ctypes.c_int64(chunk),
                                                    out.ctypes.data_as(ctypes.c_void_p), err, len(err)), err)
        return out

    def decode(self, first, n):
        toks = np.zeros(n, np.int32)
        logits = np.zeros((n, self.V), np.float32)
        err = ctypes.create_string_buffer(1 << 16)
        self._check(self.lib.lily_metal_emu_decode(ctypes.c_void_p(self.h), ctypes.c_int32(first), n,
                                                   toks.ctypes.data_as(ctypes.c_void_p),
                                                   logits.ctypes.data_as(ctypes.c_void_p), err, len(err)), err)
        return toks, logits

    def snapshot(self):
        self.lib.lily_metal_emu_snapshot.restype = ctypes.c_void_p
        return self.lib.lily_metal_emu_snapshot(ctypes.c_void_p(self.h))

    def restore(self, snap):
        self.lib.lily_metal_emu_restore(ctypes.c_void_p(self.h), ctypes.c_void_p(snap))

    def free_snapshot(self, snap):
        self.lib.lily_metal_emu_free_snapshot(ctypes.c_void_p(snap))

    def close(self):
        if self.h:
            self.lib.lily_metal_emu_free(ctypes.c_void_p(self.h))
            self.h = None

    @property
    def position(self):
        return self.lib.lily_metal_emu_position(ctypes.c_void_p(self.h))


def _cpu_logits(cfg, tensors, quant, seq):
    """Teacher-forced logits of the CPU backend; the engine (and its worker threads) is gone before the next
    test forks a child."""
    cpu = _lily.Engine(cfg.to_dict(), tensors, quant, threads=2, max_context=256)
    out = cpu.forward(cpu.new_state(), seq, logits="all")
    del cpu
    gc.collect()
    return out


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
    # the specialisations the full model uses (attn *_nd8_h8, gdn_scan_norm_nk4 with 1024 threads, topk_j8);
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
def test_model_prefill_chunks_then_decode_loop(name, prompt, chunk, steps, max_threads):
    cfg = _configs()[name]
    tensors, quant = random_weights(cfg, seed=21)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, prompt).astype(np.int32)

    def run():
        eng = EmulatedMetalEngine(cfg, tensors, quant, max_threads=max_threads)
        pre = eng.forward(toks, chunk)
        first = int(np.argmax(pre[-1]))
        gen, dec = eng.decode(first, steps)
        pos = eng.position
        eng.close()
        return pre, first, gen, dec, pos

    pre, first, gen, dec, pos = _in_child(run)
    assert pos == prompt + steps
    # CPU backend, teacher-forced on the same sequence (prompt + the tokens the Metal loop fed itself)
    seq = np.concatenate([toks, [first], gen[:-1]]).astype(np.int32)
    ref = _cpu_logits(cfg, tensors, quant, seq)
    tag = f"{name}" + (f" max_threads={max_threads}" if max_threads < 1024 else "")
    _report(f"{tag} prefill ({prompt} rows, chunks of {chunk})", pre, ref[:prompt], toks)
    _report(f"{tag} decode loop ({steps} steps)", dec, ref[prompt:], seq[prompt:])
    # the loop fed back its own greedy choices
    np.testing.assert_array_equal(gen, np.argmax(dec, -1))
    assert first == int(np.argmax(ref[prompt - 1]))


def test_chunked_equals_unchunked_and_snapshot_restore():
    """Self-consistency of the backend on the emulated device: prefill in one chunk == in chunks of 3 (to
    summation order), and decoding twice from a restored snapshot gives the same tokens and logits."""
    cfg = tiny_configs()["tiny_dk_ne_dv"]
    tensors, quant = random_weights(cfg, seed=4)
    toks = np.random.default_rng(9).integers(0, cfg.vocab_size, 11).astype(np.int32)

    def run():
        a = EmulatedMetalEngine(cfg, tensors, quant)
        whole = a.forward(toks, 0)
        b = EmulatedMetalEngine(cfg, tensors, quant)
        chunked = b.forward(toks, 3)
        snap = b.snapshot()
        t1, l1 = b.decode(int(np.argmax(chunked[-1])), 4)
        b.restore(snap)
        t2, l2 = b.decode(int(np.argmax(chunked[-1])), 4)
        b.free_snapshot(snap)
        a.close(), b.close()
        return whole, chunked, t1, l1, t2, l2

    whole, chunked, t1, l1, t2, l2 = _in_child(run)
    err = rel_rms(chunked, whole)
    print(f"metal chunked (3) vs unchunked prefill          rel_rms {err:.3e}")
    assert err <= tol("self_consistency")["rel_rms"]
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_array_equal(l1, l2)


@pytest.mark.parametrize("name", ["tiny", "mid_real_heads"])
def test_model_bf16_kv_cache(name):
    """The default on Apple: a bf16 KV cache (everything else fp32). Judged by design.md §8's bar for a
    backend that computes in fp32 (top-1 >= 99 %, relative RMS <= 1e-3); measured 6e-5 here."""
    cfg = _configs()[name]
    tensors, quant = random_weights(cfg, seed=21)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).astype(np.int32)

    def run():
        eng = EmulatedMetalEngine(cfg, tensors, quant, kv_bf16=True)
        pre = eng.forward(toks, 5)
        gen, dec = eng.decode(int(np.argmax(pre[-1])), 3)
        eng.close()
        return pre, gen, dec

    pre, gen, dec = _in_child(run)
    seq = np.concatenate([toks, [np.argmax(pre[-1])], gen[:-1]]).astype(np.int32)
    ref = _cpu_logits(cfg, tensors, quant, seq)
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
    """Logits of lily.reference with every matrix product's inputs rounded to half (design.md §8 envelope)."""
    from lily.reference import ReferenceEngine
    ref = ReferenceEngine(cfg, tensors, quant, max_context=256)
    dense = ref.weights.linear
    ref.weights.linear = lambda module: _HalfMatrix(dense(module).astype(np.float16).astype(np.float32))
    return ref.forward(ref.new_state(), seq, logits="all")


@pytest.mark.parametrize("name", ["tiny", "mid_real_heads"])
def test_model_tensor_op_gemms(name):
    """The device reports Metal 4 tensor ops: every prefill GEMM (plain, GLU, grouped experts) runs the
    tensor-op kernels of gemm_tensor.metal (half tiles, fp32 accumulation) through the shim's matmul2d.
    Judged against the rounding envelope of design.md §8 for that precision: lily.reference with every
    matrix product's inputs rounded to half, vs the CPU backend (fp32). The prefill must also differ from
    the fp32-tile run of the simdgroup path (else the flag did not select the tensor-op kernels)."""
    cfg = _configs()[name]
    tensors, quant = random_weights(cfg, seed=21)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).astype(np.int32)

    def run():
        eng = EmulatedMetalEngine(cfg, tensors, quant, tensor_ops=True)
        pre = eng.forward(toks, 7)
        gen, dec = eng.decode(int(np.argmax(pre[-1])), 2)
        eng.close()
        if name != "tiny":   # the path-selection check once is enough
            return pre, gen, dec, None
        ref_eng = EmulatedMetalEngine(cfg, tensors, quant, tensor_ops=False)
        pre32 = ref_eng.forward(toks, 7)
        ref_eng.close()
        return pre, gen, dec, pre32

    pre, gen, dec, pre32 = _in_child(run)
    seq = np.concatenate([toks, [np.argmax(pre[-1])], gen[:-1]]).astype(np.int32)
    ref = _cpu_logits(cfg, tensors, quant, seq)
    env = _half_envelope(cfg, tensors, quant, seq)
    metal = np.concatenate([pre, dec])
    err, t1, ppl = rel_rms(metal, ref), top1_agreement(metal, ref), perplexity(metal, seq) / perplexity(ref, seq)
    e_err, e_t1, e_ppl = rel_rms(env, ref), top1_agreement(env, ref), perplexity(env, seq) / perplexity(ref, seq)
    print(f"{name} tensor-op GEMMs vs CPU (fp32)   top1 {t1:.4f}  ppl ratio {ppl:.6f}  rel_rms {err:.3e}   "
          f"envelope (half products): top1 {e_t1:.4f}  ppl ratio {e_ppl:.6f}  rel_rms {e_err:.3e}")
    assert np.all(np.isfinite(metal))
    assert t1 >= e_t1 - ENVELOPE_SLACK_TOP1 and abs(ppl - 1) <= abs(e_ppl - 1) + ENVELOPE_SLACK_PPL
    assert err <= 2 * e_err, "further from fp32 than twice the half-rounding envelope"
    assert pre32 is None or not np.array_equal(pre, pre32), "tensor_ops=True ran the same kernels as the simdgroup path"

"""C++ CPU engine (lily._lily.Engine) against the NumPy reference (lily.reference.ReferenceEngine).

Whole-model logits on the tiny configs (Dk != Dv, odd heads/experts/vocab, dense modules), then the
engine contract: chunked == unchunked, prefill + decode == one prefill, snapshot/restore, bad inputs.
Engines run with LILY_DEBUG=1: every scratch buffer and the logits are NaN-poisoned before kernels
write them, so a read of an unwritten element shows up as a non-finite output.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest

os.environ["LILY_DEBUG"] = "1"

_lily = pytest.importorskip("lily._lily")
from lily.reference import ReferenceEngine  # noqa: E402
from lily.testing import random_weights, tiny_configs  # noqa: E402

from lily.testing.metrics import assert_close, top1_agreement  # noqa: E402
from lily.testing.tolerances import tol  # noqa: E402

CONFIGS = tiny_configs()
NAMES = sorted(CONFIGS)
MAX_CTX = 512


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    """(name, cfg, tensors, quant, engine, reference) for one tiny config."""
    cfg = CONFIGS[request.param]
    tensors, quant = random_weights(cfg, seed=7)
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=2, max_context=MAX_CTX)
    ref = ReferenceEngine(cfg, tensors, quant, max_context=MAX_CTX)
    return request.param, cfg, tensors, quant, eng, ref


def _tokens(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


def test_build_info():
    info = _lily.build_info()
    assert "cpu" in info["backends"]
    assert isinstance(info["cuda"], bool) and isinstance(info["simd"], str)
    assert _lily.cuda_device_count() >= 0  # 0, not an exception, without a driver


def test_engine_properties(model):
    name, cfg, *_, eng, _ref = model
    assert eng.backend == "cpu" and eng.threads == 2 and eng.max_context == MAX_CTX
    assert eng.vocab_size == cfg.vocab_size and eng.debug


def test_logits_all_vs_reference(model):
    name, cfg, *_, eng, ref = model
    toks = _tokens(cfg, 37)
    out = eng.forward(eng.new_state(), toks, logits="all")
    want = ref.forward(ref.new_state(), toks, logits="all")
    assert out.dtype == np.float32 and out.shape == (37, cfg.vocab_size)
    t = tol("model_vs_reference")
    assert_close(f"{name} logits[all]", out, want, t["rel_rms"])
    assert top1_agreement(out, want) >= t["top1"]


def test_logits_modes(model):
    name, cfg, *_, eng, _ref = model
    toks = _tokens(cfg, 9, seed=1)
    full = eng.forward(eng.new_state(), toks, logits="all")
    last = eng.forward(eng.new_state(), toks, logits="last")
    st = eng.new_state()
    none = eng.forward(st, toks, logits="none")
    assert last.shape == (1, cfg.vocab_size) and none.shape == (0, cfg.vocab_size)
    assert st.position == 9
    # S=1 rows take the GEMV path, S=9 the GEMM path: same math, other summation order
    assert_close(f"{name} logits[last] vs logits[all][-1]", last[0], full[-1], tol("self_consistency")["rel_rms"])


def test_decode_steps_vs_reference(model):
    name, cfg, *_, eng, ref = model
    toks = _tokens(cfg, 12, seed=2)
    st, rs = eng.new_state(), ref.new_state()
    eng.forward(st, toks[:8], logits="none")
    ref.forward(rs, toks[:8], logits="none")
    for i in range(8, 12):
        assert_close(f"{name} decode step {i}", eng.forward(st, toks[i:i + 1]), ref.forward(rs, toks[i:i + 1]),
                     tol("model_vs_reference")["rel_rms"])


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_equals_unchunked(model, chunk):
    name, cfg, *_, eng, _ref = model
    toks = _tokens(cfg, 41, seed=3)
    one = eng.forward(eng.new_state(), toks, logits="all", chunk_size=0)
    chunked = eng.forward(eng.new_state(), toks, logits="all", chunk_size=chunk)
    assert_close(f"{name} chunk={chunk} vs unchunked", chunked, one, tol("self_consistency")["rel_rms"])


def test_prefill_plus_decode_equals_prefill(model):
    name, cfg, *_, eng, _ref = model
    toks = _tokens(cfg, 20, seed=4)
    full = eng.forward(eng.new_state(), toks, logits="all")
    st = eng.new_state()
    rows = [eng.forward(st, toks[:13], logits="all")]
    for i in range(13, 20):
        rows.append(eng.forward(st, toks[i:i + 1], logits="last"))
    assert st.position == 20
    assert_close(f"{name} prefill+decode vs prefill", np.concatenate(rows), full, tol("self_consistency")["rel_rms"])


def test_snapshot_restore(model):
    name, cfg, *_, eng, _ref = model
    toks = _tokens(cfg, 30, seed=5)
    st = eng.new_state()
    eng.forward(st, toks[:17], logits="none")
    snap = st.snapshot()
    assert snap.position == 17 and snap.nbytes == st.nbytes
    a = eng.forward(st, toks[17:], logits="all")
    # the snapshot is independent of the state it came from
    assert snap.position == 17 and st.position == 30
    st.restore(snap)
    assert st.position == 17
    b = eng.forward(st, toks[17:], logits="all")
    np.testing.assert_array_equal(a, b)
    # restore into a fresh state, twice from the same snapshot
    fresh = eng.new_state()
    fresh.restore(snap)
    np.testing.assert_array_equal(eng.forward(fresh, toks[17:], logits="all"), a)
    fresh.restore(snap)
    assert_close(f"{name} restore then decode", eng.forward(fresh, toks[17:18]), a[:1],
                 tol("self_consistency")["rel_rms"])


def test_nbytes(model):
    name, cfg, *_, eng, _ref = model
    st = eng.new_state()
    fixed = st.nbytes
    n_deltanet = sum(not cfg.is_attention(i) for i in range(cfg.num_hidden_layers))
    n_at = cfg.num_hidden_layers - n_deltanet
    per_dn = 4 * (cfg.linear_num_value_heads * cfg.linear_value_head_dim * cfg.linear_key_head_dim
                  + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim)
    assert fixed == n_deltanet * per_dn
    eng.forward(st, _tokens(cfg, 10), logits="none")
    assert st.nbytes == fixed + n_at * 2 * 10 * cfg.num_key_value_heads * cfg.head_dim * 4


def test_kv_growth_across_chunks(model):
    # 300 tokens: past the first KV allocation (256 rows), in chunks that straddle it
    name, cfg, *_, eng, ref = model
    if name != "tiny":
        pytest.skip("one config is enough")
    toks = _tokens(cfg, 300, seed=6)
    st = eng.new_state()
    eng.forward(st, toks[:200], logits="none")
    out = eng.forward(st, toks[200:], logits="all", chunk_size=64)
    want = ref.forward(ref.new_state(), toks, logits="all")[200:]
    assert_close(f"{name} 300 tokens, KV growth", out, want, tol("model_vs_reference")["rel_rms"])


def test_threads_deterministic(model):
    name, cfg, tensors, quant, eng, _ref = model
    one = _lily.Engine(cfg.to_dict(), tensors, quant, threads=1, max_context=64)
    toks = _tokens(cfg, 23, seed=8)
    np.testing.assert_array_equal(one.forward(one.new_state(), toks, logits="all"),
                                  eng.forward(eng.new_state(), toks, logits="all"))


def test_bad_inputs(model):
    name, cfg, *_, eng, _ref = model
    st = eng.new_state()
    eng.forward(st, _tokens(cfg, 3), logits="none")
    with pytest.raises(ValueError, match="out of range"):
        eng.forward(st, np.array([0, cfg.vocab_size], np.int32))
    with pytest.raises(ValueError, match="out of range"):
        eng.forward(st, np.array([-1], np.int32))
    with pytest.raises(ValueError, match="empty"):
        eng.forward(st, np.array([], np.int32))
    with pytest.raises(ValueError, match="max_context"):
        eng.forward(st, np.zeros(MAX_CTX - 2, np.int32))
    with pytest.raises(ValueError, match="logits"):
        eng.forward(st, np.array([1], np.int32), logits="first")
    with pytest.raises(ValueError, match="1-D"):
        eng.forward(st, np.zeros((2, 2), np.int32))
    assert st.position == 3  # failed calls leave the state untouched
    # int64 and list inputs are accepted
    eng.forward(st, np.array([1, 2], np.int64), logits="none")
    eng.forward(st, [3], logits="none")
    assert st.position == 6


def test_bad_weights():
    cfg = CONFIGS["tiny"]
    tensors, quant = random_weights(cfg, seed=0)
    bad = dict(tensors)
    name = "model.layers.3.mlp.gate.scales"
    bad[name] = np.zeros((cfg.num_experts, 7), np.uint16)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.3\.mlp\.gate\.scales has shape \(8, 7\), "
                                         r"expected \(8, 2\)"):
        _lily.Engine(cfg.to_dict(), bad, quant)
    missing = dict(tensors)
    del missing["model.norm.weight"]
    with pytest.raises(ValueError, match="missing tensor model.norm.weight"):
        _lily.Engine(cfg.to_dict(), missing, quant)
    strided = dict(tensors)
    strided["model.norm.weight"] = np.zeros(2 * cfg.hidden_size, np.float32)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        _lily.Engine(cfg.to_dict(), strided, quant)


def test_dense_f32_weights_and_lifetime():
    # every linear dense float32 (the f32 path), arrays only referenced by the engine afterwards
    cfg = CONFIGS["tiny_dk_ne_dv"]
    tensors, _ = random_weights(cfg, seed=3, quantized=False)
    from lily.quant import bf16_to_f32
    tensors = {k: (bf16_to_f32(v) if v.dtype == np.uint16 else v) for k, v in tensors.items()}
    ref = ReferenceEngine(cfg, tensors, {}, max_context=64)
    toks = _tokens(cfg, 11)
    want = ref.forward(ref.new_state(), toks, logits="all")
    eng = _lily.Engine(cfg.to_dict(), tensors, {}, threads=2, max_context=64)
    del tensors, ref
    gc.collect()
    assert_close("dense f32 logits[all]", eng.forward(eng.new_state(), toks, logits="all"), want,
                 tol("model_vs_reference")["rel_rms"])


def test_bf16_small_vectors_are_upcast():
    # norms / conv taps / dt_bias / A_log given as bf16 bits give the same result as their f32 values
    cfg = CONFIGS["tiny"]
    tensors, quant = random_weights(cfg, seed=5)
    from lily.quant import f32_to_bf16
    small = {k: f32_to_bf16(v) for k, v in tensors.items()
             if v.dtype == np.float32 and not k.endswith("A_log")}
    toks = _tokens(cfg, 6)
    e32 = _lily.Engine(cfg.to_dict(), tensors, quant, threads=1)
    e16 = _lily.Engine(cfg.to_dict(), {**tensors, **small}, quant, threads=1)
    a = e32.forward(e32.new_state(), toks, logits="all")
    b = e16.forward(e16.new_state(), toks, logits="all")
    np.testing.assert_array_equal(a, b)


def test_decode_greedy_matches_forward_argmax(model):
    """Engine.decode_greedy (the CPU fallback loop) == forward + argmax, one token at a time."""
    name, cfg, tensors, quant, eng, ref = model
    st = eng.new_state()
    eng.forward(st, _tokens(cfg, 9, seed=5), logits="none")
    snap = st.snapshot()
    out = eng.decode_greedy(st, 3, 5)
    assert out.dtype == np.int32 and out.shape == (5,) and st.position == 14
    st.restore(snap)
    tok, chain = 3, []
    for _ in range(5):
        tok = int(np.argmax(eng.forward(st, [tok], logits="last")[0]))
        chain.append(tok)
    assert list(out) == chain
    assert eng.decode_greedy(st, 0, 0).shape == (0,)
    with pytest.raises(ValueError, match="max_context"):
        eng.decode_greedy(st, 0, MAX_CTX)
    with pytest.raises(ValueError, match="has no flag"):
        eng.set_backend_flag("cuda_graph", 1)

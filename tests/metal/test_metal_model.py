"""The Python API on emulated Metal: `lily.load(..., backend="metal", backend_options={"emu_kernel_libs": ...})`
runs Model.generate and Session through the engine's token loop on the Metal backend (device draws, one step
ahead, greedy and sampled), and the results must equal the CPU backend's (whose host Sampler draws: one sampling
semantics, lily.sampling). The Metal
backend computes in fp32 like the CPU one (logits within 5e-7 relative RMS, test_metal_backend.py), so the same
seed draws the same tokens; a draw that fell within that distance of a CDF boundary would show as a mismatch
(not seen on these seeds). Every Metal run happens in a forked child (test_metal_backend._in_child)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import test_metal_backend as t_be

import lily
from lily.testing import write_synthetic_checkpoint

PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("metal_model"), "tiny", seed=3)


def load_metal(folder):
    return lily.load(folder, backend="metal", max_context=160,
                     backend_options={"emu_kernel_libs": t_be.kernel_libs(), "kv_bf16": "0"})


def _stop_string(text: str) -> str:
    """A 3-character stop string from the middle of a generated text (it then completes a few tokens in)."""
    return next(text[i:i + 3] for i in range(4, len(text) - 3)
                if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])


def _cases(cpu):
    greedy = cpu.generate(PROMPT, max_tokens=16, temperature=0)
    sampled = cpu.generate(PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    return [dict(max_tokens=16, temperature=0), dict(max_tokens=16, temperature=0, stop=_stop_string(greedy.text)),
            dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=7),
            dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, stop=_stop_string(sampled.text))]


def _generate_all(model, cases):
    out = []
    for kw in cases:
        r = model.generate(PROMPT, **kw)
        streamed = "".join(c.text for c in model.generate(PROMPT, stream=True, **kw))
        out.append((r.token_ids, r.text, r.finish_reason, streamed))
    return out


def test_load_refuses_metal_on_linux_without_the_emulator_options(checkpoint):
    with pytest.raises(lily.BackendUnavailableError, match="not built"):
        lily.load(checkpoint, backend="metal")
    with pytest.raises(ValueError, match="backend_options are for backend='metal'"):
        lily.load(checkpoint, backend="cpu", backend_options={"emu_kernel_libs": "x.so"})
    assert lily.load(checkpoint, backend="auto").backend == "cpu"


def test_model_generate_on_emulated_metal_equals_cpu(checkpoint):
    cpu = lily.load(checkpoint, backend="cpu", threads=2, max_context=160)  # the host Sampler draws
    cases = _cases(cpu)
    want = _generate_all(cpu, cases)
    del cpu
    gc.collect()

    def run():
        m = load_metal(checkpoint)
        assert m.backend == "metal"
        return _generate_all(m, cases)

    got = t_be._in_child(run)
    for kw, (tok_w, text_w, fin_w, stream_w), (tok_g, text_g, fin_g, stream_g) in zip(cases, want, got):
        assert tok_g == tok_w and text_g == text_w and fin_g == fin_w, kw
        assert stream_g == stream_w == text_w, kw
        if "stop" in kw:
            assert fin_g == "stop", kw


def test_session_after_a_stop_string_equals_a_lock_step_session(checkpoint):
    """A stop string ends a device stream after the device ran the token that completed it (run ahead); the
    session's next turn must then give exactly (bitwise) the logits and tokens of a session on the same backend
    whose steps all ran lock-step (device_draw 0), and the CPU backend's tokens."""
    cpu = lily.load(checkpoint, backend="cpu", threads=2, max_context=160)
    probe = cpu.generate(PROMPT, max_tokens=12, temperature=0)
    stop = cpu.tokenizer.decode(probe.token_ids[3:5])
    s_cpu = cpu.session()
    first_cpu = s_cpu.generate(PROMPT, max_tokens=12, stop=stop, temperature=0).token_ids
    next_cpu = s_cpu.generate(" next", max_tokens=4, temperature=0).token_ids
    del cpu, s_cpu
    gc.collect()

    def run():
        dev, lock = load_metal(checkpoint), load_metal(checkpoint)
        lock.engine.set_backend_flag("device_draw", 0)
        out = []
        for m in (dev, lock):
            s = m.session()
            s.device_sampling = m is dev  # lock: every draw on the host (else the extension draws, holding no row)
            r = s.generate(PROMPT, max_tokens=12, stop=stop, temperature=0)
            s.flush()  # a token still pending (lock-step) runs now, as the run-ahead step did on the device
            row = np.array(s._last_logits)
            n = s.generate(" next", max_tokens=4, temperature=0)
            out.append((r.finish_reason, r.token_ids, list(s.tokens), row, n.token_ids, np.array(s._last_logits)))
        # the first session really drew on the device (one step ahead), the second never did
        assert dev.engine.backend_counters()["sampler_begins"] >= 2 and lock.engine.backend_counters()["sampler_begins"] == 0
        # safetensors aligns tensors to 8 bytes only: the 16-byte-load kernels get aligned copies of those
        assert dev.engine.backend_counters()["copied_weight_bytes"] > 0
        return out

    (fin, toks, ctx, row, nxt, last), (fin_l, toks_l, ctx_l, row_l, nxt_l, last_l) = t_be._in_child(run)
    assert fin == fin_l == "stop" and toks == toks_l == first_cpu
    assert ctx == ctx_l
    np.testing.assert_array_equal(row, row_l)
    assert nxt == nxt_l == next_cpu
    np.testing.assert_array_equal(last, last_l)

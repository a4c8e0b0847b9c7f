"""Device sampling on emulated Metal (metal/sample.metal through MetalBackend::sampler_begin / head_step): a
device-mode token stream draws, at every step, the host sampler's token (lily.sampling.draw_token) from that step's
logits with the stream's uniform sequence (lily.sampling.stream_uniforms), seen / counts following the drawn
tokens, the draws running one step ahead; and Model.generate sampled on Metal gives, for the same seeds and
options, the tokens of the CPU backend, whose host Sampler draws them (one sampling semantics, lily.sampling). The
Metal sampler sums in fp32, so a draw within CDF_TOL of a CDF step of the host's float64 weights counts as the
host's (the CUDA rule, lily.testing.stream_checks). Every Metal run happens in a forked child
(test_metal_backend._in_child)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import test_metal_backend as t_be

import lily
from lily.sampling import SamplingParams
from lily.testing import random_weights, tiny_configs, write_synthetic_checkpoint
from lily.testing.stream_checks import draws_vs_host, host_record, run_and_replay

STEPS = 8
SEEDS = (0, 7, 123456789)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                   logit_bias={1: 2.0, 5: -3.0}),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.4,
                   frequency_penalty=0.2, logit_bias={1: 2.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4, logit_bias={3: 1.0}),
], ids=["topp+penalties+bias", "all", "greedy+penalties"])
def test_device_stream_draws_are_the_host_samplers_with_the_stream_uniforms(params):
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=3)
    V = cfg.vocab_size
    prompt = np.arange(3, 12, dtype=np.int32)

    def run():
        eng = t_be.metal_engine(cfg, tensors, quant)
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
        snap = st.snapshot()
        seen0, counts0 = host_record(V, prompt, first)
        out = [run_and_replay(eng, st, snap, first, STEPS, params, seen0, counts0, seed) for seed in SEEDS]
        # the draws ran one step ahead: no step waited for an older one, two command buffers were in flight
        return out, seen0, counts0, eng.backend_counters()["step_waits"], eng.backend_counters()["max_inflight"]

    out, seen0, counts0, step_waits, max_inflight = t_be._in_child(run)
    assert step_waits == 0 and max_inflight == 2
    boundary = 0
    for seed, run in zip(SEEDS, out):
        assert run.device and run.position == len(prompt) + STEPS, "the Metal backend declined the sampler"
        np.testing.assert_array_equal(run.held, run.rows[-1])  # the last step's row, held on the device
        bad, near = draws_vs_host(run, params, seen0, counts0, seed, exact=False)
        assert not bad, (seed, bad)
        boundary += near
    assert boundary <= 1, f"{boundary} draws within CDF_TOL of a step: expected (almost) none"


def test_two_streams_pulled_in_turn_draw_what_each_draws_alone():
    """Two device streams on two states take the engine's one device sampler from each other at every token:
    each resume uploads its host record (seen / counts) again, and each stream draws what it draws alone."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=4)
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.3,
                       logit_bias={2: 1.0})
    prompt = np.arange(5, 14, dtype=np.int32)

    def run():
        eng = t_be.metal_engine(cfg, tensors, quant)
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
        snap = st.snapshot()
        solo = []
        for seed in (3, 4):
            st.restore(snap)
            s = eng.open_stream(st, first, STEPS, device=True, seed=seed, **p.draw_options())
            solo.append([s.next() for _ in range(STEPS)])
            s.close()
        st.restore(snap)
        st2 = snap.snapshot()
        begins = eng.backend_counters()["sampler_begins"]
        a = eng.open_stream(st, first, STEPS, device=True, seed=3, **p.draw_options())
        b = eng.open_stream(st2, first, STEPS, device=True, seed=4, **p.draw_options())
        inter = [[], []]
        for _ in range(STEPS):
            inter[0].append(a.next())
            inter[1].append(b.next())
        a.close()
        b.close()
        return solo, inter, eng.backend_counters()["sampler_begins"] - begins

    solo, inter, begins = t_be._in_child(run)
    assert inter == solo
    assert begins > STEPS, "the streams did not take the sampler from each other"


PROMPT = "Hello world! How are you today?"
CASES = [dict(temperature=0.8, top_p=0.9, seed=7), dict(temperature=0.8, top_p=0.9, seed=8),
         dict(temperature=1.1, top_k=20, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.3,
              frequency_penalty=0.2, logit_bias={5: 1.5}, seed=3)]


def _generate_all(model):
    return [model.generate(PROMPT, max_tokens=16, **kw).token_ids for kw in CASES]


def test_model_generate_sampled_on_metal_equals_the_cpu_backend(tmp_path):
    """One seed, one text: the CPU backend's host Sampler (lock-step: each step's row on the host) and Metal's
    device sampler (one step ahead) draw the same tokens for the same seed and options; so does the CPU backend's
    device twin (backend flag device_draw = 1)."""
    folder = write_synthetic_checkpoint(tmp_path, "tiny", seed=3)
    cpu = lily.load(folder, backend="cpu", threads=2, max_context=160)
    want = _generate_all(cpu)
    assert cpu.engine.backend_counters()["sampler_begins"] == 0  # the host drew every token
    cpu.engine.set_backend_flag("device_draw", 1)
    assert _generate_all(cpu) == want
    assert cpu.engine.backend_counters()["sampler_begins"] >= len(CASES)
    del cpu
    gc.collect()

    def run():
        m = lily.load(folder, backend="metal", max_context=160,
                      backend_options={"emu_kernel_libs": t_be.kernel_libs(), "kv_bf16": "0"})
        return _generate_all(m), m.engine.backend_counters()["sampler_begins"]

    got, begins = t_be._in_child(run)
    assert begins >= len(CASES), "Model.generate did not sample on the device"
    for kw, w, g in zip(CASES, want, got):
        assert g == w and len(g) > 1, kw

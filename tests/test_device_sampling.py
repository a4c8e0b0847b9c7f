"""One sampling semantics (lily.sampling): the draw walks the kept tokens in vocab order with the uniform numbers of the
seed, ties at the top-k / top-p boundary all kept; the host Sampler's steps take the seed's numbers in turn; and
the session's tokens are the same whether the host or a device draws them: here the CPU backend's device twin
(Engine flag "device_draw", csrc/core/sampling.cpp), which also runs the engine's device-mode token loop without a
GPU (emulated Metal: tests/metal/test_metal_sampling.py; CUDA: tests/test_cuda_backend.py and
lily.testing.cuda_sampling_checks, run by benchmarks/cuda_check.py).
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from lily.sampling import Sampler, SamplingParams, draw_token, resolve_sampling, stream_uniform
from lily.testing.stream_checks import (draws_vs_host, host_record, parting_explained, precision_cases,
                                        run_and_replay, teacher_forced_draws)

_lily = pytest.importorskip("lily._lily")

GRID = 4000  # draws on a uniform grid: each token's share is its probability to within 1/GRID


def _shares(x, params, seen=None, counts=None):
    us = (np.arange(GRID) + 0.5) / GRID
    c = collections.Counter(draw_token(x, params, seen, counts, u) for u in us)
    return {k: v / GRID for k, v in c.items()}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(min_p=0.08),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.85, min_p=0.01, logit_bias={4: 3.0, 9: -50.0}),
], ids=["t1", "topk", "topp", "minp", "all"])
def test_draws_follow_the_kept_distribution(params):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(301) * 2.5).astype(np.float32)
    host = Sampler(params, x.size)
    ids, probs = host.candidates(host.process(x))
    want = dict(zip(ids.tolist(), probs.tolist()))
    got = _shares(x, params)
    assert set(got) <= set(want)  # never a token outside the kept set
    assert max(abs(got.get(k, 0.0) - p) for k, p in want.items()) <= 1.5 / GRID


def test_draw_applies_the_penalties_of_its_record():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(97) * 2).astype(np.float32)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.5)
    host = Sampler(p, x.size, prompt_tokens=[3, 5, 7])
    for t in (11, 11, 13):
        host.accept(t)
    want = int(np.argmax(host.process(x)))
    assert draw_token(x, p, host.seen, host.counts, 0.3) == want
    # the penalised row really changes the choice here (else the check above could not fail)
    x2 = x.copy()
    x2[want] = x.max() + 1
    host2 = Sampler(p, x.size)
    assert draw_token(x2, p, host2.seen, host2.counts, 0.3) == want


def test_ties_at_the_boundary_are_all_kept():
    x = np.array([1.0, 3.0, 3.0, 3.0, 0.5], np.float32)
    got = _shares(x, SamplingParams(top_k=2))  # the 2nd largest value is tied three ways: all three stay
    assert set(got) == {1, 2, 3} and all(abs(v - 1 / 3) < 2 / GRID for v in got.values())
    got = _shares(x, SamplingParams(top_p=0.1))
    assert set(got) == {1, 2, 3}
    assert draw_token(x, SamplingParams(temperature=0.0), None, None, 0.5) == 1  # lowest index


def test_draw_is_the_vocab_order_cdf():
    x = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float64))
    p = SamplingParams()
    assert [draw_token(x, p, None, None, u) for u in (0.0, 0.0999, 0.1001, 0.2999, 0.3001, 0.5999, 0.6001, 0.9999)] \
        == [0, 0, 1, 1, 2, 2, 3, 3]
    # the first index whose inclusive cumulative weight *exceeds* u * total (equal weights: exact sums)
    assert [draw_token(np.zeros(4, np.float32), p, None, None, u) for u in (0.0, 0.25, 0.5, 0.75)] == [0, 1, 2, 3]
    # the best token last in vocab order: a draw in any other order (e.g. best first) gives other tokens here
    y = np.log(np.array([0.05, 0.15, 0.8], np.float64))
    assert [draw_token(y, SamplingParams(top_p=0.9), None, None, u) for u in (0.01, 0.1, 0.3)] == [1, 1, 2]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=5),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.4,
                   frequency_penalty=0.2, logit_bias={1: 2.0}, seed=123456789),
], ids=["t0.9", "all"])
def test_sampler_step_i_draws_with_the_seeds_number_i(params):
    """The host Sampler's i-th draw takes the seed's i-th uniform number (the one a device stream's step takes), its
    record following the drawn tokens; stream_seed() continues the numbers after the draws made."""
    rng = np.random.default_rng(3)
    V = 500
    rows = (rng.standard_normal((12, V)) * 2.0).astype(np.float32)
    host = Sampler(params, V, prompt_tokens=[2, 3])
    seen = np.zeros(V, bool)
    seen[[2, 3]] = True
    counts = np.zeros(V, np.int32)
    for i, row in enumerate(rows):
        want = draw_token(row, params, seen, counts, stream_uniform(params.seed, i))
        assert host.sample(row) == want, i
        seen[want], counts[want] = True, counts[want] + 1
    assert host.stream_seed() == params.seed + len(rows)
    assert stream_uniform(host.stream_seed(), 0) == stream_uniform(params.seed, len(rows))


def test_parting_explained_accepts_rounding_and_refuses_another_draw():
    """The rule tests/test_cuda_backend.py applies where the CPU's and CUDA's texts for one seed part: a token the
    other row's draw reaches by moving the number within the rows' distance is explained, another one is not."""
    rng = np.random.default_rng(4)
    V = 400
    a = (rng.standard_normal(V) * 2).astype(np.float32)
    b = a + (rng.standard_normal(V) * 1e-2).astype(np.float32)  # a few rounding-sized differences
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    seen, counts = np.zeros(V, bool), np.zeros(V, np.int32)
    parts = [u for u in np.linspace(0, 1, 4001)[:-1]
             if draw_token(a, p, seen, counts, u) != draw_token(b, p, seen, counts, u)]
    assert parts  # the rows do part somewhere
    for u in parts:
        ok, delta = parting_explained(a, b, p, seen, counts, u, draw_token(a, p, seen, counts, u))
        assert ok and delta < 0.05
    assert not parting_explained(a, b, p, seen, counts, 0.1, draw_token(a, p, seen, counts, 0.9))[0]


PRECISION = precision_cases()


@pytest.mark.parametrize("case", PRECISION, ids=[c.name for c in PRECISION])
def test_cpu_twin_draws_the_hosts_tokens_on_precision_cases(case):
    """The CPU backend's device twin (lily._lily.sample_draw, csrc/core/sampling.cpp) on the crafted rows where a
    precision choice decides the kept set (float32 options, float32 processing rounded per operation: a double
    processing or a fused multiply-add breaks the ties there, the greedy limit): the host's token at every u."""
    us = sorted({u for u, _ in case.draws} | set(((np.arange(256) + 0.5) / 256).tolist()))
    twin, host = [], []
    for u in us:
        twin.append(_lily.sample_draw(case.x, u, **case.params.draw_options(), seen=case.seen.astype(np.uint8),
                                      counts=case.counts.copy()))
        host.append(draw_token(case.x, case.params, case.seen, case.counts, u))
    assert twin == host
    assert set(twin) <= case.kept
    for u, token in case.draws:
        assert twin[us.index(u)] == token


# ---- the engine's token streams: input checks, and the device mode on the CPU backend's twin ----------------

@pytest.fixture(scope="module")
def cpu_engine():
    from lily.testing import random_weights, tiny_configs
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=3)
    return cfg, _lily.Engine(cfg.to_dict(), tensors, quant, threads=1, max_context=64)


def test_stream_option_checks(cpu_engine):
    cfg, eng = cpu_engine
    V = cfg.vocab_size
    st = eng.new_state()
    assert not eng.open_stream(st, 1, 4, temperature=0.7).device  # the CPU backend draws on the host by default
    bad = [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(bias_ids=[V], bias_vals=[1.0]), "bias id"),
        (dict(bias_ids=[2, 2], bias_vals=[1.0, 2.0]), "twice"),
        (dict(bias_ids=[2]), "same length"),
        (dict(seen=np.zeros(V - 1, np.uint8)), "seen"),
        (dict(counts=np.zeros(V + 1, np.int32)), "counts"),
        (dict(stop_ids=[V]), "stop id"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            eng.open_stream(st, 1, 4, **kw)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.open_stream(st, 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        eng.open_stream(st, V, 4)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.4,
                   frequency_penalty=0.2, logit_bias={1: 2.0}),
], ids=["t1", "all"])
def test_device_stream_draws_are_the_host_samplers_with_the_stream_uniforms(cpu_engine, params):
    """Each token a device-mode stream draws is the host sampler's draw from that step's logits (replayed lock-step)
    with the stream's documented uniform sequence, seen / counts following the drawn tokens."""
    cfg, eng = cpu_engine
    V = cfg.vocab_size
    eng.set_backend_flag("device_draw", 1)
    try:
        prompt = np.arange(3, 12, dtype=np.int32)
        st = eng.new_state()
        first = int(np.argmax(eng.forward(st, prompt, logits="last")[-1]))
        snap = st.snapshot()
        seen0, counts0 = host_record(V, prompt, first)
        for seed in (0, 7, 123456789):
            run = run_and_replay(eng, st, snap, first, 8, params, seen0, counts0, seed)
            assert run.device and run.position == len(prompt) + 8  # the 8th token stays pending
            np.testing.assert_array_equal(run.held, run.rows[-1])
            assert draws_vs_host(run, params, seen0, counts0, seed, exact=True) == ([], 0), seed
    finally:
        eng.set_backend_flag("device_draw", 0)


def test_parked_stream_resumes_with_its_parked_draw_counted(cpu_engine):
    """A stream parked by another one resumes from its host record; that record must already count the draw that
    waited on the host, or the step after it draws without the penalty (here: a token biased to win, which a
    presence penalty must then forbid, would be drawn twice in a row)."""
    cfg, eng = cpu_engine
    V = cfg.vocab_size
    eng.set_backend_flag("device_draw", 1)
    kw = dict(temperature=0.0, presence_penalty=50.0, bias_ids=[42], bias_vals=[20.0])
    prompts = (np.arange(3, 12, dtype=np.int32), np.arange(20, 30, dtype=np.int32))
    try:
        solo = []
        for p, first in zip(prompts, (5, 7)):
            st = eng.new_state()
            eng.forward(st, p, logits="none")
            s = eng.open_stream(st, first, 6, counts=np.zeros(V, np.int32), **kw)
            solo.append([s.next() for _ in range(6)])
            s.close()
        assert solo[0][0] == 42 and 42 not in solo[0][1:]
        states = []
        for p in prompts:
            states.append(eng.new_state())
            eng.forward(states[-1], p, logits="none")
        a = eng.open_stream(states[0], 5, 6, counts=np.zeros(V, np.int32), **kw)
        b = eng.open_stream(states[1], 7, 6, counts=np.zeros(V, np.int32), **kw)  # parks a at once
        got = [[], []]
        for _ in range(6):
            got[0].append(a.next())
            got[1].append(b.next())
        assert got == solo
    finally:
        eng.set_backend_flag("device_draw", 0)


def _lock_step(model):
    """The model's sessions draw every token on the host (lily.sampling.Sampler, lock-step): a CPU stream otherwise
    draws in the extension (the same rule; test_one_seed_one_text_whether_the_host_or_the_device_draws compares
    the three)."""
    opened = model.session

    def session(*args, **kwargs):
        s = opened(*args, **kwargs)
        s.device_sampling = False
        return s
    model.session = session
    return model


@pytest.fixture(scope="module")
def models():
    import lily
    # without the bundled model's MTP head: these are the plain token loop's modes (a speculative stream draws in
    # the extension by the same rule; tests/test_speculative.py)
    host = _lock_step(lily.load(backend="cpu", mtp=False))
    dev = lily.load(backend="cpu", mtp=False)
    dev.engine.set_backend_flag("device_draw", 1)
    return host, dev


@pytest.fixture(scope="module")
def extension_model():
    """The CPU's default plain stream: drawn in the extension on the host (no device sampler)."""
    import lily
    return lily.load(backend="cpu", mtp=False)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.5,
                                                             frequency_penalty=0.4)], ids=["greedy", "penalised"])
def test_session_device_greedy_equals_host(models, kw):
    host, dev = models
    a = host.session().generate("The list type", max_tokens=24, stream=False, **kw)
    s = dev.session()
    b = s.generate("The list type", max_tokens=24, stream=False, **kw)
    assert a.token_ids == b.token_ids and len(b.token_ids) > 1
    # max_tokens ended it: the stream did not run ahead past the last token, which stays pending
    assert s.tokens[-len(b.token_ids):] == b.token_ids and len(s._pending) == 1
    ref = host.session()
    ref.generate("The list type", max_tokens=24, stream=False, **kw)
    np.testing.assert_array_equal(s._last_logits, ref._last_logits)
    # the session continues: the pending token runs at the start of the next turn
    c = s.generate(" and", max_tokens=4, stream=False, **kw)
    d = ref.generate(" and", max_tokens=4, stream=False, **kw)
    assert c.token_ids == d.token_ids


def test_stop_string_run_ahead_leaves_the_exact_state(models):
    """A stop string ends a device stream after the device already ran the token that completed it (run ahead):
    the session then holds exactly the state of a session that fed the same tokens one step at a time."""
    host, dev = models
    probe = host.session().generate("The list type", max_tokens=12, stream=False, temperature=0.0)
    stop = host.tokenizer.decode(probe.token_ids[3:5])  # a stop string that completes at the 5th token
    s = dev.session()
    r = s.generate("The list type", max_tokens=12, stop=stop, stream=False, temperature=0.0)
    assert r.finish_reason == "stop" and len(r.token_ids) <= 6
    assert not s._pending  # the token that completed the stop string already ran on the device
    ref = host.session()
    ref.generate("The list type", max_tokens=len(r.token_ids), stream=False, temperature=0.0)
    ref.flush()  # the last token runs as one decode step, as the run-ahead step did
    assert ref.tokens == s.tokens
    np.testing.assert_array_equal(s._last_logits, ref._last_logits)
    a = s.generate(" next", max_tokens=3, stream=False, temperature=0.0)
    b = ref.generate(" next", max_tokens=3, stream=False, temperature=0.0)
    assert a.token_ids == b.token_ids
    np.testing.assert_array_equal(dev.logits(s.tokens), host.logits(ref.tokens))


@pytest.mark.parametrize("kw", [
    dict(temperature=0.9, seed=3),
    dict(temperature=1.2, top_p=0.95, seed=2**64 - 1),  # the stream's seed wraps past 2^64
    dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.4,
         frequency_penalty=0.2, logit_bias={5: 1.5}, seed=13),
], ids=["t0.9", "topp", "all"])
def test_one_seed_one_text_whether_the_host_or_the_device_draws(models, extension_model, kw):
    """The same seed and options give the same tokens from the host Sampler (lock-step), from a device-mode
    stream (the CPU backend's device twin) and from a stream drawn in the extension (the CPU's default): the first
    token is the host's draw with number 0, the stream's steps take numbers 1, 2, ... as the host's would."""
    host, dev = models
    a = host.generate("The list type", max_tokens=32, **kw)
    begins = dev.engine.backend_counters()["sampler_begins"]
    b = dev.generate("The list type", max_tokens=32, **kw)
    assert dev.engine.backend_counters()["sampler_begins"] > begins  # the device drew them
    assert b.token_ids == a.token_ids and len(a.token_ids) > 8
    s = extension_model.session()
    c = s.generate("The list type", max_tokens=32, stream=True, **kw)
    head = [next(c), next(c)]  # (the first token is the prompt's draw; the stream opens for the second)
    assert s.stream is not None and s.stream.draws and not s.stream.device  # drawn in the extension
    assert [x.token_id for x in head + list(c)] == a.token_ids


def test_session_device_sampling_seeded_and_interleaved(models):
    _, dev = models
    kw = dict(temperature=0.9, top_p=0.9, repetition_penalty=1.3, seed=11, max_tokens=20)
    solo = [dev.session().generate(p, stream=False, **kw).token_ids for p in ("The list", "A dict")]
    assert solo[0] == dev.session().generate("The list", stream=False, **kw).token_ids  # seeded: repeats
    assert solo[0] != dev.session().generate("The list", stream=False, **{**kw, "seed": 12}).token_ids
    # two streams pulled in turn take the engine's one device sampler from each other: each is parked (its
    # launched step finishes, its draw waits on the host) and resumes with its own record (seen / counts)
    begins = dev.engine.backend_counters()["sampler_begins"]
    g = [dev.session().generate(p, stream=True, **kw) for p in ("The list", "A dict")]
    got = [[], []]
    live = [True, True]
    while any(live):
        for i in (0, 1):
            if live[i]:
                c = next(g[i], None)
                if c is None:
                    live[i] = False
                else:
                    got[i].append(c.token_id)
    assert got == solo
    assert dev.engine.backend_counters()["sampler_begins"] - begins > 4  # they really did take it from each other


def test_session_host_paths_when_device_sampling_is_off(models):
    _, dev = models
    s = dev.session()
    s.device_sampling = False
    begins = dev.engine.backend_counters()["sampler_begins"]
    s.generate("The list type", max_tokens=5, stream=False, temperature=0.0)
    dev.session().generate("The list type", max_tokens=5, stream=False, temperature=0.7, logprobs=True)
    assert dev.engine.backend_counters()["sampler_begins"] == begins  # off, and logprobs need the host row


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8, top_p=0.9, seed=1),
    dict(temperature=1.1, top_k=20, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.2,
         logit_bias={5: 1.5}, seed=2**64 - 3),
], ids=["topp", "all"])
def test_every_step_of_a_seeded_text_is_the_device_draw_at_its_context(models, kw):
    """Teacher forced (lily.testing.stream_checks.teacher_forced_draws): at every step i of the host's seeded text, a
    device-mode stream of the CPU twin opened at that context with seed + i and the host's record draws the host's
    token i. This pins the handover at any step (a session opens its stream with Sampler.stream_seed() = seed + 1
    after its first draw): stream step j takes the seed's number j, host draw i takes number i, so a stream seeded
    seed + i continues at the host's draw i; with the seed near 2^64 the sum wraps."""
    host, dev = models
    _, _, steps = teacher_forced_draws(host, dev, "The list type", 24, **kw)
    assert len(steps) == 24
    assert [s.got for s in steps] == [s.want for s in steps]
    # and the other numbers give other draws at many steps (else the test could not see a shifted step number)
    params = resolve_sampling(host.generation_config, **kw)
    shifted = [draw_token(s.row, params, s.seen, s.counts, stream_uniform(kw["seed"], s.step + 1)) for s in steps]
    assert sum(a != s.want for a, s in zip(shifted, steps)) >= 3


def test_second_turn_after_a_stop_string_draws_the_same_on_host_and_device(models):
    """A seeded turn that a stop string ends (the device stream ran one step ahead and drew a token that is dropped),
    then a second seeded turn: the device session's two texts are the host session's (each turn's Sampler starts at
    the seed's number 0, the first token of a turn is the host's draw, the stream continues at seed + 1, and the
    dropped run-ahead draw consumes nothing the next turn uses)."""
    host, dev = models
    kw = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=7)
    probe = host.session().generate("The list type", max_tokens=12, stream=False, **kw)
    stop = host.tokenizer.decode(probe.token_ids[4:6])
    texts = []
    for model in (host, dev):
        s = model.session()
        begins = model.engine.backend_counters()["sampler_begins"]
        a = s.generate("The list type", max_tokens=12, stop=stop, stream=False, **kw)
        b = s.generate(" and then", max_tokens=16, stream=False, **kw)
        texts.append((a.finish_reason, a.token_ids, b.token_ids, model.engine.backend_counters()["sampler_begins"] - begins))
    (ra, a0, b0, n0), (rb, a1, b1, n1) = texts
    assert ra == rb == "stop" and (a0, b0) == (a1, b1) and len(b0) > 8
    assert n0 == 0 and n1 >= 2  # the host drew every token of the first, the twin the device's of the second

"""Sampling on the device: the NumPy twin (lily.sampling.device_sample_reference) against the host Sampler's
distribution; the engine API's input checks; and the session's device-sampling loop, driven here by a stand-in
engine that implements the device sampler API with the twin on the CPU engine (the CUDA kernel itself is
checked against the twin on the GPU by lily.testing.cuda_sampling_checks, run by benchmarks/cuda_check.py, and
by benchmarks/kernels/check_sample.cu).
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

from lily.sampling import Sampler, SamplingParams, device_sample_reference

_lily = pytest.importorskip("lily._lily")

GRID = 4000  # draws on a uniform grid: each token's share is its probability to within 1/GRID


def _shares(x, params, seen=None, counts=None):
    us = (np.arange(GRID) + 0.5) / GRID
    c = collections.Counter(device_sample_reference(x, params, seen, counts, u) for u in us)
    return {k: v / GRID for k, v in c.items()}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(min_p=0.08),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.85, min_p=0.01, logit_bias={4: 3.0, 9: -50.0}),
], ids=["t1", "topk", "topp", "minp", "all"])
def test_twin_matches_host_distribution(params):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(301) * 2.5).astype(np.float32)
    host = Sampler(params, x.size)
    ids, probs = host.candidates(host.process(x))
    want = dict(zip(ids.tolist(), probs.tolist()))
    got = _shares(x, params)
    assert set(got) <= set(want)  # never a token the host would not keep
    assert max(abs(got.get(k, 0.0) - p) for k, p in want.items()) <= 1.5 / GRID


def test_twin_penalties_match_host_processing():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(97) * 2).astype(np.float32)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.7, frequency_penalty=0.5)
    host = Sampler(p, x.size, prompt_tokens=[3, 5, 7])
    for t in (11, 11, 13):
        host.accept(t)
    want = int(np.argmax(host.process(x)))
    assert device_sample_reference(x, p, host._seen, host._counts, 0.3) == want
    # the penalised row really changes the choice here (else the check above could not fail)
    x2 = x.copy()
    x2[want] = x.max() + 1
    host2 = Sampler(p, x.size)
    assert device_sample_reference(x2, p, host2._seen, host2._counts, 0.3) == want


def test_twin_keeps_ties_at_the_boundary():
    x = np.array([1.0, 3.0, 3.0, 3.0, 0.5], np.float32)
    got = _shares(x, SamplingParams(top_k=2))  # the 2nd largest value is tied three ways: all three stay
    assert set(got) == {1, 2, 3} and all(abs(v - 1 / 3) < 2 / GRID for v in got.values())
    got = _shares(x, SamplingParams(top_p=0.1))
    assert set(got) == {1, 2, 3}
    assert device_sample_reference(x, SamplingParams(temperature=0.0), None, None, 0.5) == 1  # lowest index


def test_twin_draw_is_vocab_order_cdf():
    x = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float64))
    p = SamplingParams()
    assert [device_sample_reference(x, p, None, None, u) for u in (0.0, 0.0999, 0.1001, 0.2999, 0.3001, 0.6, 0.9999)] \
        == [0, 0, 1, 1, 2, 3, 3]


# ---- the engine API's checks (validation runs before the backend; the CPU backend has no device sampler) ----

@pytest.fixture(scope="module")
def cpu_engine():
    from lily.testing import random_weights, tiny_configs
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=3)
    return cfg, _lily.Engine(cfg.to_dict(), tensors, quant, threads=1, max_context=64)


def _begin(eng, V, **kw):
    a = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, bias_ids=np.zeros(0, np.int32), bias_vals=np.zeros(0, np.float32),
             seen=np.zeros(0, np.uint8), counts=np.zeros(0, np.int32))
    a.update(kw)
    return eng.sampler_begin(**a)


def test_engine_sampler_checks(cpu_engine):
    cfg, eng = cpu_engine
    V = cfg.vocab_size
    assert _begin(eng, V) == 0  # the CPU backend samples on the host
    bad = [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(bias_ids=np.array([V], np.int32), bias_vals=np.array([1.0], np.float32)), "bias id"),
        (dict(bias_ids=np.array([2, 2], np.int32), bias_vals=np.array([1.0, 2.0], np.float32)), "twice"),
        (dict(bias_ids=np.array([2], np.int32)), "same length"),
        (dict(seen=np.zeros(V - 1, np.uint8)), "seen"),
        (dict(counts=np.zeros(V + 1, np.int32)), "counts"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _begin(eng, V, **kw)
    with pytest.raises(ValueError, match="sampler id"):
        eng.decode_sample(eng.new_state(), 1, 0.5, 0)
    assert eng.decode_logits(eng.new_state()) is None


# ---- the session's device-sampling loop, on a stand-in engine -------------------------------------------

class TwinDeviceEngine:
    """The CPU engine plus the device sampler API, implemented with the twin (what the CUDA backend does)."""

    def __init__(self, eng):
        self._eng = eng
        self.current = self.issued = self.begins = 0
        self._held = None

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def forward(self, st, tokens, **kw):
        self._held = None
        return self._eng.forward(st, tokens, **kw)

    def sampler_begin(self, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                      frequency_penalty, bias_ids, bias_vals, seen, counts):
        V = self._eng.vocab_size
        self.params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                                     min_p=float(min_p), repetition_penalty=float(repetition_penalty),
                                     presence_penalty=float(presence_penalty),
                                     frequency_penalty=float(frequency_penalty),
                                     logit_bias=dict(zip(bias_ids.tolist(), bias_vals.tolist())))
        self.seen = seen.astype(bool) if seen.size else np.zeros(V, bool)
        self.counts = counts.astype(np.int32) if counts.size else np.zeros(V, np.int32)
        self.issued += 1
        self.begins += 1
        self.current = self.issued
        return self.current

    def decode_sample(self, st, token, uniform, sampler_id):
        assert 0 <= uniform < 1
        if sampler_id != self.current:
            return -1
        lg = self._eng.forward(st, np.array([token], np.int32), logits="last")[0]
        nxt = device_sample_reference(lg, self.params, self.seen, self.counts, uniform)
        self.seen[nxt] = True
        self.counts[nxt] += 1
        self._held = (st, st.position, lg)
        return nxt

    def decode_logits(self, st):
        if self._held is None or self._held[0] is not st or self._held[1] != st.position:
            return None
        return self._held[2].copy()


@pytest.fixture(scope="module")
def models():
    import lily
    host = lily.load(backend="cpu")
    dev = lily.load(backend="cpu")
    dev.engine = TwinDeviceEngine(dev.engine)
    return host, dev


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.5,
                                                             frequency_penalty=0.4)], ids=["greedy", "penalised"])
def test_session_device_greedy_equals_host(models, kw):
    host, dev = models
    a = host.session().generate("The list type", max_tokens=24, stream=False, **kw)
    s = dev.session()
    b = s.generate("The list type", max_tokens=24, stream=False, **kw)
    assert a.token_ids == b.token_ids and len(b.token_ids) > 1
    # the state holds every token but the last (pending); the logits row it came from was fetched
    assert s.tokens[-len(b.token_ids):] == b.token_ids and len(s._pending) == 1
    ref = host.session()
    ref.generate("The list type", max_tokens=24, stream=False, **kw)
    np.testing.assert_allclose(s._last_logits, ref._last_logits, rtol=0, atol=1e-4)
    # the session continues: the pending token runs at the start of the next turn
    c = s.generate(" and", max_tokens=4, stream=False, **kw)
    d = ref.generate(" and", max_tokens=4, stream=False, **kw)
    assert c.token_ids == d.token_ids


def test_session_device_sampling_seeded_and_interleaved(models):
    _, dev = models
    kw = dict(temperature=0.9, top_p=0.9, repetition_penalty=1.3, seed=11, max_tokens=20)
    solo = [dev.session().generate(p, stream=False, **kw).token_ids for p in ("The list", "A dict")]
    assert solo[0] == dev.session().generate("The list", stream=False, **kw).token_ids  # seeded: repeats
    # two streams pulled in turn take the engine's one device sampler from each other: each begins again from
    # its own host record (seen / counts) and must draw exactly what it drew alone
    begins = dev.engine.begins
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
    assert dev.engine.begins - begins > 4  # the streams really did take the sampler from each other


def test_session_host_paths_unchanged(models):
    _, dev = models
    s = dev.session()
    s.device_sampling = False
    begins = dev.engine.begins
    s.generate("The list type", max_tokens=5, stream=False, temperature=0.0)
    dev.session().generate("The list type", max_tokens=5, stream=False, temperature=0.7, logprobs=True)
    assert dev.engine.begins == begins  # switched off, and logprobs need the host row: no device sampler

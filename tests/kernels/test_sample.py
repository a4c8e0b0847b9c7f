"""Sample family: the device sampler's draw on every backend against the host sampler's (lily.sampling.draw_token,
one step of lily.sampling.Sampler: one semantics everywhere): greedy (temperature 0, ties to the lower index)
everywhere, every sampling option where the backend draws them (CPU, and Metal's sample.metal: fp32 sums, so a
Metal draw within CDF_TOL of a CDF step of the host's counts as the host's, the CUDA rule); then the Metal argmax
kernel."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from ops_metal import argmax

from lily.sampling import SamplingParams, draw_token
from lily.testing.stream_checks import near_boundary


@pytest.mark.parametrize("V", [1, 2, 63, 64, 65, 5003])
def test_greedy_draw(backend, rng, V):
    logits = rng.standard_normal(V).astype(np.float32)
    assert backend.sample_draw(logits, 0.5, temperature=0.0) == int(np.argmax(logits))
    if V > 2:
        logits[[1, V - 1]] = 100.0   # tie: the lower index wins, as np.argmax
        assert backend.sample_draw(logits, 0.5, temperature=0.0) == 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(min_p=0.08),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.85, min_p=0.01, logit_bias={4: 3.0, 0: -50.0},
                   repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
], ids=["t1", "topk", "topp", "minp", "all"])
@pytest.mark.parametrize("V", [1, 2, 5, 63, 65, 301, 5003])
def test_sampled_draw(backend, rng, V, params):
    if backend.SAMPLER != "full":
        pytest.skip(f"the {backend.NAME} backend draws greedy only")
    if params.logit_bias:  # the bias entries inside a small vocab
        params = dataclasses.replace(params, logit_bias={k: v for k, v in params.logit_bias.items() if k < V})
    x = (rng.standard_normal(V) * 2.5).astype(np.float32)
    x[rng.integers(0, V, 3)] = x.max()  # ties at the top
    seen = (rng.random(V) < 0.1).astype(np.uint8)
    counts = (rng.random(V) < 0.05).astype(np.int32) * rng.integers(1, 4, V).astype(np.int32)
    _check_draws(backend, x, params, seen, counts, rng.random(_draws(backend, 40)).astype(np.float32))


def _draws(backend, n: int) -> int:
    """Uniform numbers per case: a quarter on emulated Metal, where one draw runs sample.metal's kernels in the CPU
    emulator (~0.3 s; 40 draws made each case 10-17 s, 7 minutes of CI); every option and size keeps its case."""
    return max(n // 4, 5) if backend.NAME == "metal" else n


def _check_draws(backend, x, params, seen, counts, uniforms):
    for u in uniforms:
        want = draw_token(x, params, seen, counts, float(u))
        got = backend.sample_draw(x, float(u), seen=seen, counts=counts, **params.draw_options())
        if got != want:  # the CPU twin weighs in float64 as the host; a GPU's fp32 sums may step over within CDF_TOL
            assert backend.NAME != "cpu" and near_boundary(x, params, seen, counts, float(u), got), (u, got, want)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=9),
    SamplingParams(temperature=1.1, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.85, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.5),
], ids=["topk", "topp", "all"])
@pytest.mark.parametrize("V", [63, 5003])
def test_sampled_draw_on_tied_values(backend, rng, V, params):
    """Few distinct values: ties at the top-k and top-p boundaries, all kept (the one semantics' rule)."""
    if backend.SAMPLER != "full":
        pytest.skip(f"the {backend.NAME} backend draws greedy only")
    x = np.round(rng.standard_normal(V) * 2.0).astype(np.float32) / 2
    seen = (rng.random(V) < 0.1).astype(np.uint8)
    counts = (rng.random(V) < 0.05).astype(np.int32)
    _check_draws(backend, x, params, seen, counts, rng.random(_draws(backend, 20)).astype(np.float32))


# ---- Metal: the argmax kernel, both output slots ----

def test_argmax(rng):
    V = 5003
    logits = rng.standard_normal(V).astype(np.float32)
    assert argmax(logits) == int(np.argmax(logits))
    logits[[7, 4000]] = 100.0   # tie: the lower index wins, as np.argmax
    assert argmax(logits, slot=0) == 7

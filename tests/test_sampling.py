"""Sampler options, each checked against an independent (loop / sort based) NumPy computation."""
import numpy as np
import pytest

from lily.sampling import Sampler, SamplingParams, SamplingParamsError, draw_token, log_softmax
from lily.testing.stream_checks import precision_cases

V = 2000


def logits_row(seed=0, n=V, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def distribution(sampler, x):
    """Sampler's final distribution as {id: p}."""
    ids, probs = sampler.candidates(sampler.process(x))
    assert abs(probs.sum() - 1) < 1e-9
    return dict(zip(ids.tolist(), probs.tolist()))


def reference_distribution(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward HF-warper semantics on a full sorted row."""
    z = x.astype(np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: -z[i])
    alive = set(order[:top_k] if top_k > 0 else order)
    p = {i: np.exp(z[i]) for i in alive}
    s = sum(p.values())
    p = {i: v / s for i, v in p.items()}
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in order:
            if i not in p:
                continue
            if mass < top_p:
                kept.add(i)
            mass += p[i]
        p = {i: p[i] for i in kept}
        s = sum(p.values())
        p = {i: v / s for i, v in p.items()}
    if min_p > 0.0:
        pmax = max(p.values())
        p = {i: v for i, v in p.items() if v >= min_p * pmax}
        s = sum(p.values())
        p = {i: v / s for i, v in p.items()}
    return p


def assert_same_distribution(got, want):
    assert set(got) == set(want)
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=1e-6, abs=1e-12)


def test_greedy_is_argmax():
    x = logits_row()
    s = Sampler(SamplingParams(temperature=0.0), V)
    assert s.sample(x) == int(np.argmax(x))
    assert s.sample(x.reshape(1, -1)) == int(np.argmax(x))  # [1, vocab] rows are accepted


def test_temperature_scales_distribution():
    x = logits_row(1)
    got = distribution(Sampler(SamplingParams(temperature=0.5), V), x)
    want = softmax(x.astype(np.float64) / 0.5)
    assert len(got) == V
    np.testing.assert_allclose([got[i] for i in range(V)], want, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 5, 40, V - 1])
def test_top_k_keeps_exactly_k(k):
    x = logits_row(2)
    got = distribution(Sampler(SamplingParams(temperature=0.7, top_k=k), V), x)
    assert len(got) == k
    assert set(got) == set(np.argsort(-x)[:k].tolist())
    assert_same_distribution(got, reference_distribution(x, 0.7, top_k=k))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat rows exercise the full-sort path, peaked ones the fast path
def test_top_p_nucleus(top_p, scale):
    x = logits_row(3, scale=scale)
    got = distribution(Sampler(SamplingParams(top_p=top_p), V), x)
    assert_same_distribution(got, reference_distribution(x, 1.0, top_p=top_p))


def test_top_p_large_vocab_fast_path_matches_full_sort():
    x = logits_row(4, n=50_000, scale=6.0)
    got = distribution(Sampler(SamplingParams(top_p=0.8), 50_000), x)
    z = x.astype(np.float64)
    order = np.argsort(-z, kind="stable")
    p = softmax(z)[order]
    keep = int(np.count_nonzero(np.cumsum(p) - p < 0.8))
    assert set(got) == set(order[:keep].tolist())


@pytest.mark.parametrize("scale,k", [(0.05, 50), (1.0, 20), (1.0, 3000), (8.0, 40)])
def test_top_k_long_rows(scale, k):
    """Long rows narrow to a pool first (within 8 of the max, or above the k-th largest block maximum on a flat
    row): the kept set is the k largest, and so is the distribution."""
    n = 120_001  # not a multiple of the 64-entry blocks
    x = logits_row(10, n=n, scale=scale)
    got = distribution(Sampler(SamplingParams(top_k=k), n), x)
    want = np.argsort(-x.astype(np.float64), kind="stable")[:k]
    assert sorted(x[list(got)].tolist()) == sorted(x[want].tolist()) and len(got) == k
    p = softmax(x[want].astype(np.float64))
    np.testing.assert_allclose(sorted(got.values()), sorted(p.tolist()), rtol=1e-9)


@pytest.mark.parametrize("scale,top_p,min_p", [(0.5, 0.3, 0.0), (1.0, 0.9, 0.0), (1.0, 0.95, 0.2), (0.05, 0.5, 0.0)])
def test_top_p_long_flat_row_by_histogram(scale, top_p, min_p):
    """Long flat rows take the histogram path (no likely pool, no short candidate list): same set as a full sort,
    in vocab order (the order the draw walks), ties and underflowed (-inf) logits included."""
    n = 100_000
    x = logits_row(9, n=n, scale=scale)
    x[::997] = -np.inf
    x[5:9] = x.max()  # a tie at the top
    s = Sampler(SamplingParams(top_p=top_p, min_p=min_p), n)
    ids, probs = s.candidates(s.process(x))
    z = x.astype(np.float64)
    p = softmax(z)
    order = np.argsort(-p, kind="stable")
    keep = order[:int(np.count_nonzero(np.cumsum(p[order]) - p[order] < top_p))]
    if min_p:
        keep = keep[p[keep] >= min_p * p.max()]
    assert set(ids.tolist()) == set(keep.tolist()) and len(ids) == len(set(ids.tolist()))
    assert (np.diff(ids) > 0).all()
    np.testing.assert_allclose(probs, p[ids] / p[ids].sum(), rtol=1e-9)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p(min_p):
    x = logits_row(5)
    got = distribution(Sampler(SamplingParams(min_p=min_p, temperature=1.3), V), x)
    p = softmax(x.astype(np.float64) / 1.3)
    assert set(got) == set(np.flatnonzero(p >= min_p * p.max()).tolist())
    assert_same_distribution(got, reference_distribution(x, 1.3, min_p=min_p))


def test_filters_compose_in_order():
    x = logits_row(6)
    got = distribution(Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.7, min_p=0.05), V), x)
    assert_same_distribution(got, reference_distribution(x, 0.8, top_k=50, top_p=0.7, min_p=0.05))


def test_repetition_penalty_formula_prompt_and_output():
    x = logits_row(7)
    prompt = [3, 10, 10, 42]
    s = Sampler(SamplingParams(repetition_penalty=1.3), V, prompt_tokens=prompt)
    s.accept(99)
    got = s.process(x)
    want = x.copy()
    for t in {3, 10, 42, 99}:
        want[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_presence_and_frequency_penalties_count_output_only():
    x = logits_row(8)
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), V, prompt_tokens=[1, 2, 3])
    for t in [5, 5, 5, 7]:
        s.accept(t)
    want = x.copy()
    want[5] -= 0.5 + 3 * 0.25
    want[7] -= 0.5 + 1 * 0.25
    np.testing.assert_allclose(s.process(x), want, rtol=1e-6)


def test_logit_bias_applied_first_and_steers_greedy():
    x = logits_row(9)
    worst = int(np.argmin(x))
    s = Sampler(SamplingParams(temperature=0, logit_bias={worst: 100.0}), V)
    assert s.sample(x) == worst
    # bias before the repetition penalty: (x + b) / rp for a positive result
    s = Sampler(SamplingParams(logit_bias={4: 50.0}, repetition_penalty=2.0), V, prompt_tokens=[4])
    assert s.process(x)[4] == pytest.approx((x[4] + 50.0) / 2.0, rel=1e-6)


def test_seed_reproducible_and_sensitive():
    rows = [logits_row(i, scale=1.0) for i in range(30)]

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=seed), V)
        return [s.sample(r) for r in rows]

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_sampling_frequencies_follow_distribution():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingParams(seed=0, top_k=3), 4)
    counts = np.bincount([s.sample(x) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], atol=0.015)


def test_two_level_draw_on_a_large_row_follows_distribution():
    n = 50_000
    x = np.full(n, -30.0, np.float32)
    hot = {7: 0.5, 20_000: 0.3, 49_999: 0.2}  # first block, a middle block, the ragged tail block
    for i, p in hot.items():
        x[i] = np.log(p)
    s = Sampler(SamplingParams(seed=1), n)
    draws = np.array([s.sample(x) for _ in range(6000)])
    for i, p in hot.items():
        assert abs(np.mean(draws == i) - p) < 0.03


def test_logprobs_are_raw_log_softmax():
    x = logits_row(10)
    s = Sampler(SamplingParams(temperature=0.5, top_logprobs=5, logprobs=True, logit_bias={0: 30.0}), V)
    token = s.sample(x)
    lp = s.logprobs(x, token)
    ref = x.astype(np.float64) - np.log(np.sum(np.exp(x.astype(np.float64))))
    assert lp.logprob == pytest.approx(ref[token], abs=1e-5)
    assert list(lp.top) == np.argsort(-ref)[:5].tolist()
    np.testing.assert_allclose(list(lp.top.values()), np.sort(ref)[::-1][:5], atol=1e-5)
    np.testing.assert_allclose(log_softmax(x), ref, atol=1e-5)


@pytest.mark.parametrize("field,value,expected", [
    ("temperature", -0.1, ">= 0"), ("top_p", 0.0, "0 < top_p <= 1"), ("top_p", 1.5, "0 < top_p <= 1"),
    ("min_p", 2.0, "0 <= min_p <= 1"), ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 3.0, "-2 <= value <= 2"), ("frequency_penalty", -2.5, "-2 <= value <= 2"),
    ("seed", -1, "integer >= 0"), ("max_tokens", 0, "integer >= 1"), ("top_logprobs", 21, "0..20"),
    ("top_k", 2.5, "integer"), ("temperature", float("nan"), "number"),
])
def test_validation_names_field_and_range(field, value, expected):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and expected in str(e.value)
    assert isinstance(e.value, ValueError)


def test_validation_of_stop_and_bias_and_vocab():
    with pytest.raises(SamplingParamsError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={1: 200.0})
    with pytest.raises(SamplingParamsError, match="0..9"):
        Sampler(SamplingParams(stop_token_ids=[10]), 10)
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.parametrize("top_p,min_p", [(0.9, 0.0), (1.0, 0.02), (0.95, 0.001)])
def test_large_row_pool_matches_full_row(top_p, min_p):
    """The float32 pre-selection of likely tokens (a 248k-row speed path) keeps the exact float64 result."""
    n = 60_000
    x = logits_row(11, n=n, scale=5.0)
    got = distribution(Sampler(SamplingParams(temperature=0.7, top_p=top_p, min_p=min_p), n), x)
    z = x.astype(np.float64) / 0.7
    order = np.argsort(-z, kind="stable")
    p = softmax(z)[order]
    keep = order[: int(np.count_nonzero(np.cumsum(p) - p < top_p))] if top_p < 1.0 else order
    pk = softmax(z)[keep]
    keep = keep[pk >= min_p * pk.max()]
    want = softmax(z)[keep]
    assert_same_distribution(got, dict(zip(keep.tolist(), (want / want.sum()).tolist())))


def test_top_k_widens_its_threshold_and_handles_masked_rows():
    n = 5000
    x = (-100.0 - np.arange(n) * 1e-3).astype(np.float32)
    x[7] = 0.0  # one token far above the rest: the first thresholds hold fewer than k
    got = distribution(Sampler(SamplingParams(top_k=10), n), x)
    assert sorted(got) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    x[:] = -100.0
    x[7] = 0.0  # the 10th largest value is shared by 4999 tokens: ties at the k-th value are all kept
    assert len(distribution(Sampler(SamplingParams(top_k=10), n), x)) == n
    y = np.full(n, -np.inf, np.float32)
    y[[3, 9]] = [1.0, 2.0]  # a grammar left two tokens: top_k larger than the finite ones
    got = distribution(Sampler(SamplingParams(top_k=20, seed=0), n), y)
    assert {i for i, q in got.items() if q > 0} == {3, 9}
    assert got[9] == pytest.approx(np.e / (np.e + 1))


# ---- one semantics with the devices: the options and the processed row as the devices have them -----------------
PRECISION = precision_cases()


@pytest.mark.parametrize("case", PRECISION, ids=[c.name for c in PRECISION])
def test_precision_cases_keep_and_draw_what_the_device_rule_does(case):
    """Crafted rows where the float32 options, the float32 processing (each operation rounded, no fused
    multiply-add) or the greedy limit decide the kept set: the host keeps and draws what csrc/cuda/sample.cuh's rule
    keeps and draws (with float64 options or processing it would not)."""
    s = Sampler(case.params, case.x.size)
    s.seen[:], s.counts[:] = case.seen, case.counts
    ids, probs = s.candidates(s.process(case.x))
    assert set(ids.tolist()) == case.kept and np.all(probs > 0)
    for u, token in case.draws:
        assert draw_token(case.x, case.params, case.seen, case.counts, u) == token, (u, token)


def test_processed_row_is_float32_arithmetic_rounded_per_operation():
    """bias, x / rp or x * rp, x - (freq * count + pres): each a float32 operation (the devices' and the CPU twin's
    row, bit for bit), on awkward values."""
    rng = np.random.default_rng(21)
    n = 4000
    x = (rng.standard_normal(n) * 7).astype(np.float32)
    p = SamplingParams(repetition_penalty=1.37, presence_penalty=0.31, frequency_penalty=0.17,
                       logit_bias={3: 0.1, 7: -1.7})
    s = Sampler(p, n, prompt_tokens=rng.integers(0, n, 300))
    for t in rng.integers(0, n, 500):
        s.accept(int(t))
    got = s.process(x)
    f = np.float32
    want = x.copy()
    for k, v in p.logit_bias.items():
        want[k] = f(want[k] + f(v))
    for i in range(n):
        v = want[i]
        if s.seen[i]:
            v = f(v / f(1.37)) if v > 0 else f(v * f(1.37))
        if s.counts[i]:
            v = f(v - f(f(f(0.17) * f(s.counts[i])) + f(0.31)))
        want[i] = v
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_options_beyond_float32_are_refused():
    """The devices take the options as float32: a temperature or repetition penalty that is inf there, a top_p or
    repetition penalty that is 0 there, is refused here (the engine would refuse it at open_stream)."""
    for kw in (dict(temperature=1e39), dict(repetition_penalty=1e39), dict(repetition_penalty=1e-50),
               dict(top_p=1e-50)):
        with pytest.raises(SamplingParamsError):
            SamplingParams(**kw)
    SamplingParams(temperature=1e-40, top_p=1e-40)  # representable (subnormal) float32 values are fine

"""Speculative decoding with the MTP head on the CPU engine (issue 39): exactly plain decoding's output.

Greedy: token for token over >= 1,000 tokens, with heads that draft well, partly and not at all; the state after
rejected drafts equals a plain run's bit for bit (main arrays and the head's cache). Around it: stop strings and
max_tokens inside an accepted draft, sessions, snapshots, the prefix cache, saved sessions, cancellation. Sampling:
the speculative stream's token distribution equals the plain sampler's (chi-square, every sampling option on). The
head's drafts against lily.reference on awkward shapes. Bad input.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import spec_models
from spec_models import engine, greedy_prompt_and_first, stream_tokens
from lily.testing.tolerances import tol

from lily.errors import LilyError
from lily.sampling import SamplingParamsError

N_GREEDY = 1000


@pytest.mark.parametrize("name,head,scale,k", [
    ("tiny", "drafting", 0.0, 4), ("tiny", "drafting", 0.4, 3), ("tiny", "random", 0.0, 2),
    ("tiny_dk_ne_dv", "drafting", 0.4, 1), ("tiny_odd", "drafting", 0.3, 4), ("tiny_odd", "random", 0.0, 3)])
def test_greedy_is_plain_decoding_token_for_token(name, head, scale, k):
    cfg, _, _, eng = engine(name, head, scale)
    prompt, st, first = greedy_prompt_and_first(eng, cfg)
    plain = list(eng.decode_greedy(st, first, N_GREEDY))
    st2 = eng.new_state()
    eng.forward(st2, prompt, logits="none")
    s = eng.open_stream(st2, first, N_GREEDY, speculative=k, adaptive=False, temperature=0.0)
    spec = stream_tokens(s)
    assert spec == plain
    stats = s.spec_stats
    assert stats["status"] == f"speculative k={k}" and stats["drafted"] > 0
    if head == "drafting":  # the head drafts tokens the trunk keeps (and, above scale 0, some it does not)
        assert stats["accepted"] > stats["drafted"] // 3, stats
        if scale > 0:
            assert stats["accepted"] < stats["drafted"], stats
    else:
        assert stats["accepted"] < stats["drafted"] // 4, stats
    assert st2.position == st.position


def _arrays(state) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in state.export_arrays().items()}


@pytest.mark.parametrize("k,state_rows", [(1, 1), (4, 1), (3, 0)])
def test_state_after_rejected_drafts_equals_plain_bit_for_bit(k, state_rows):
    """After every length (some ending on a rejected draft, some inside an accepted run) the state holds exactly
    what plain decoding leaves: KV rows, DeltaNet states, and the head's cache and last hidden state; rolled back
    from the verify's kept DeltaNet rows, or (state_rows 0, the path of backends that do not keep them) by replay."""
    cfg, _, _, eng = engine("tiny", "drafting", 0.4)
    eng.set_backend_flag("state_rows", state_rows)
    prompt, st, first = greedy_prompt_and_first(eng, cfg)
    rejected = 0
    for n in (1, 2, 5, 9, 40):
        a, b = eng.new_state(), eng.new_state()
        for s_ in (a, b):
            eng.forward(s_, prompt, logits="none")
        plain = list(eng.decode_greedy(a, first, n))
        s = eng.open_stream(b, first, n, speculative=k, adaptive=False, temperature=0.0)
        assert stream_tokens(s) == plain
        rejected += s.spec_stats["drafted"] - s.spec_stats["accepted"]
        pa, pb = _arrays(a), _arrays(b)
        assert sorted(pa) == sorted(pb) and "mtp.k" in pa
        for key in pa:
            assert np.array_equal(pa[key], pb[key]), f"n={n}: {key} differs"
    assert rejected > 0


def test_close_mid_run_gives_back_the_drafts_the_host_never_took():
    """A stream closed after m tokens leaves the state with [first, t_1 .. t_m] at most: the same state as feeding
    those tokens, and a plain continuation from there equals the uninterrupted plain run."""
    cfg, _, _, eng = engine("tiny", "drafting", 0.0)
    prompt, st, first = greedy_prompt_and_first(eng, cfg)
    plain = list(eng.decode_greedy(st, first, 60))
    for m in (1, 2, 3, 7):
        b = eng.new_state()
        eng.forward(b, prompt, logits="none")
        start = b.position
        s = eng.open_stream(b, first, 60, speculative=4, adaptive=False, temperature=0.0)
        got = [s.next() for _ in range(m)]
        s.close()
        assert got == plain[:m]
        fed = b.position - start
        assert 1 <= fed <= m + 1  # first and the returned tokens, never one the host did not get
        rest = list(eng.decode_greedy(b, ([first] + plain)[fed], 60 - fed))
        assert ([first] + plain)[:fed] + [([first] + plain)[fed]] + rest == [first] + plain[:60]


def test_adaptive_falls_back_when_drafting_does_not_pay():
    """A random head drafts nothing that verifies: the stream measures that and goes on with plain steps, saying
    so; the output stays plain decoding's."""
    cfg, _, _, eng = engine("tiny", "random")
    prompt, st, first = greedy_prompt_and_first(eng, cfg)
    plain = list(eng.decode_greedy(st, first, 300))
    b = eng.new_state()
    eng.forward(b, prompt, logits="none")
    s = eng.open_stream(b, first, 300, speculative=4, temperature=0.0)
    assert stream_tokens(s) == plain
    stats = s.spec_stats
    assert stats["status"].startswith("plain: drafting did not pay"), stats
    assert stats["plain_steps"] > 200 and stats["verifies"] < 60
    # the engine remembers: the next 7 generations begin plain, the 8th drafts again (and falls back again)
    statuses = []
    for _ in range(9):
        b = eng.new_state()
        eng.forward(b, prompt, logits="none")
        s = eng.open_stream(b, first, 120, speculative=4, temperature=0.0)
        assert stream_tokens(s) == plain[:120]
        statuses.append((s.spec_stats["status"], s.spec_stats["verifies"]))
    began_plain = [v == 0 and st.startswith("plain: drafting did not pay") and "8th generation drafts again" in st
                   for st, v in statuses]
    assert began_plain == [True] * 7 + [False, True], statuses
    assert statuses[7][0].startswith("plain: drafting did not pay") and 0 < statuses[7][1] <= 8, statuses


# ---- the session: stop strings, max_tokens, turns, snapshots, the prefix cache, files ------------------------


def _pair(tmp_path, scale=0.0):
    return spec_models.model(tmp_path, trunk_scale=scale)


def _no_stop(m) -> dict:
    """A bias that keeps the model's stop tokens out (the bigram trunk reaches one soon otherwise); the bias is
    a sampling option, so both paths apply it alike."""
    return {"logit_bias": {int(t): -100.0 for t in m.stop_token_ids}}


def _same(r1, r2):
    assert r1.token_ids == r2.token_ids
    assert (r1.text, r1.finish_reason, r1.stop_reason) == (r2.text, r2.finish_reason, r2.stop_reason)


def test_session_greedy_1000_tokens_and_stats(tmp_path):
    m = _pair(tmp_path, 0.4)
    s_plain, s_spec = m.session(), m.session()
    s_spec.speculative_adaptive = False
    r1 = s_plain.generate("a b c", max_tokens=N_GREEDY, temperature=0, speculative=False, **_no_stop(m))
    r2 = s_spec.generate("a b c", max_tokens=N_GREEDY, temperature=0, speculative=3, **_no_stop(m))
    _same(r1, r2)
    assert len(r1.token_ids) == N_GREEDY
    assert r1.stats.speculative is None and r1.stats.drafted_tokens == 0
    assert r2.stats.speculative == "speculative k=3" and 0 < r2.stats.accepted_tokens <= r2.stats.drafted_tokens
    assert r2.stats.tokens_per_verify > 1.0 and "drafts accepted" in r2.stats.summary()
    assert s_plain.tokens == s_spec.tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 11])
def test_max_tokens_inside_a_draft(tmp_path, max_tokens):
    m = _pair(tmp_path, 0.0)  # every draft verifies: max_tokens cuts through accepted runs of k = 4
    a, b = m.session(), m.session()
    b.speculative_adaptive = False
    _same(a.generate("x y", max_tokens=max_tokens, temperature=0, speculative=False),
          b.generate("x y", max_tokens=max_tokens, temperature=0, speculative=4))
    assert a.tokens == b.tokens
    assert np.array_equal(a._state.export_arrays()["kv.0.k"], b._state.export_arrays()["kv.0.k"])


def test_stop_string_inside_an_accepted_draft(tmp_path):
    m = _pair(tmp_path, 0.0)
    nb = _no_stop(m)
    ref = m.session().generate("hello", max_tokens=80, temperature=0, speculative=False, **nb)
    assert len(ref.token_ids) > 20, "the test needs a long plain reply"
    # a stop string that ends inside the reply, at a token far from the first (inside an accepted run of k = 4)
    piece = m.detokenize(ref.token_ids[13:15])
    assert piece.strip(), "need visible text for a stop string"
    a, b = m.session(), m.session()
    b.speculative_adaptive = False
    r1 = a.generate("hello", max_tokens=80, temperature=0, stop=[piece], speculative=False, **nb)
    r2 = b.generate("hello", max_tokens=80, temperature=0, stop=[piece], speculative=4, **nb)
    _same(r1, r2)
    assert r1.finish_reason == "stop" and r1.stop_reason == piece
    assert r2.stats.accepted_tokens > 0
    assert a.tokens == b.tokens and a.position == b.position
    # the next turn continues identically (the state holds exactly the session's tokens)
    _same(a.generate(" more", max_tokens=40, temperature=0, speculative=False, **nb),
          b.generate(" more", max_tokens=40, temperature=0, speculative=4, **nb))


def test_turns_snapshots_prefix_cache_and_files(tmp_path):
    from lily.prefix_cache import PrefixCache
    m = _pair(tmp_path, 0.3)
    chat = [{"role": "user", "content": "tell me a story"}]
    sessions = {}
    for spec in (False, 3):
        s = m.session(PrefixCache(max_bytes=1 << 26))
        s.speculative_adaptive = False
        out = []
        r = s.generate(chat, max_tokens=60, temperature=0, speculative=spec)
        out.append(r.token_ids)
        snap = s.snapshot()
        turn = chat + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "and then?"}]
        out.append(s.generate(turn, max_tokens=60, temperature=0, speculative=spec).token_ids)
        s.restore(snap)  # back mid-conversation
        out.append(s.generate(" again", max_tokens=40, temperature=0, speculative=spec).token_ids)
        # a fresh session with the prefix cache continues the second turn from a cached snapshot
        s2 = m.session(s.prefix_cache)
        s2.speculative_adaptive = False
        r2 = s2.generate(turn, max_tokens=60, temperature=0, speculative=spec)
        assert r2.stats.cached_tokens > 0
        out.append(r2.token_ids)
        path = tmp_path / f"s{spec}.safetensors"
        s.save(path)
        s3 = m.load_session(path)
        s3.speculative_adaptive = False
        out.append(s3.generate(" and", max_tokens=40, temperature=0, speculative=spec).token_ids)
        sessions[spec] = (out, s3.tokens)
    assert sessions[False] == sessions[3]


def test_generator_closed_early_leaves_a_consistent_session(tmp_path):
    m = _pair(tmp_path, 0.0)
    a, b = m.session(), m.session()
    b.speculative_adaptive = False
    for s, spec in ((a, False), (b, 4)):
        it = s.generate("once", max_tokens=100, temperature=0, stream=True, speculative=spec)
        for _, _c in zip(range(7), it):
            pass
        it.close()
    assert a.tokens == b.tokens
    _same(a.generate(" upon", max_tokens=50, temperature=0, speculative=False),
          b.generate(" upon", max_tokens=50, temperature=0, speculative=4))


# ---- sampling: the same distribution -------------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty: the chi-square quantile at the standard normal quantile z (3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _two_sample_chi2(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic of two equal-size count vectors (cells with < 10 in both pooled away), and its df."""
    keep = (a + b) >= 10
    a2, b2 = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
    cells = (a2 + b2) > 0
    a2, b2 = a2[cells], b2[cells]
    stat = float((((a2 - b2) ** 2) / (a2 + b2)).sum())
    return stat, len(a2) - 1


def test_sampling_distribution_equals_plain():
    """V = 16, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties and a bias all on;
    4 tokens per sample after a fixed prompt and first token, 3,000 samples each way; the speculative stream's
    tokens at every position, and pairs of neighbours, match the plain sampler's (chi-square at p = 1e-4, fixed
    seeds). The head drafts some tokens the rule keeps and some it rejects."""
    from lily import _lily
    cfg, _, _, eng = engine("tiny", "drafting", 0.5, vocab=16)
    prompt = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    base = eng.new_state()
    eng.forward(base, prompt, logits="none")
    snap = base.snapshot()
    opts = dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.4,
                frequency_penalty=0.3, bias_ids=[7], bias_vals=[1.5])
    n, T, first = 3000, 4, 5
    V = cfg.vocab_size
    rng = np.random.default_rng(11)
    plain = np.zeros((n, T), np.int64)
    spec = np.zeros((n, T), np.int64)
    drafted = accepted = 0

    def history() -> tuple[np.ndarray, np.ndarray]:  # the prompt and `first` seen, `first` generated once
        seen, counts = np.zeros(V, np.uint8), np.zeros(V, np.int32)
        seen[prompt], seen[first], counts[first] = 1, 1, 1
        return seen, counts

    for i in range(n):
        base.restore(snap)
        seen, counts = history()
        s = eng.open_stream(base, first, T, device=False, seed=i, **opts)
        tok = first
        for t in range(T):
            row = s.step(tok)
            tok = _lily.sample_draw(row, float(rng.random()), seen=seen, counts=counts, **opts)
            seen[tok] = 1  # (sample_draw reads the history; the caller records the draw)
            counts[tok] += 1
            plain[i, t] = tok
        s.close()
        base.restore(snap)
        seen, counts = history()
        s = eng.open_stream(base, first, T, seed=i, seen=seen, counts=counts, speculative=3, adaptive=False, **opts)
        spec[i] = stream_tokens(s)
        drafted += s.spec_stats["drafted"]
        accepted += s.spec_stats["accepted"]
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    for t in range(T):
        stat, df = _two_sample_chi2(np.bincount(plain[:, t], minlength=V), np.bincount(spec[:, t], minlength=V))
        assert stat < _chi2_critical(df), f"position {t}: chi2 {stat:.1f} on {df} df"
    for t in range(T - 1):
        pa = np.bincount(plain[:, t] * V + plain[:, t + 1], minlength=V * V)
        pb = np.bincount(spec[:, t] * V + spec[:, t + 1], minlength=V * V)
        stat, df = _two_sample_chi2(pa, pb)
        assert stat < _chi2_critical(df), f"pair {t}: chi2 {stat:.1f} on {df} df"


def test_chi2_check_sees_a_different_distribution():
    """The check above can fail: a sampler at another temperature is told apart."""
    rng = np.random.default_rng(0)
    p = np.exp(np.linspace(0, 2, 16))
    q = np.exp(np.linspace(0, 3.0, 16))
    a = np.bincount(rng.choice(16, 3000, p=p / p.sum()), minlength=16)
    b = np.bincount(rng.choice(16, 3000, p=q / q.sum()), minlength=16)
    stat, df = _two_sample_chi2(a, b)
    assert stat > _chi2_critical(df)


# ---- the head against lily.reference, and bad input ---------------------------------------------------------


@pytest.mark.parametrize("name,n,chunk", [("tiny", 1, 0), ("tiny_dk_ne_dv", 7, 3), ("tiny_odd", 13, 5),
                                          ("tiny", 20, 4)])
def test_drafts_match_the_reference(name, n, chunk, monkeypatch):
    """The engine's head (its cache filled by a chunked prefill and one plain step) drafts what lily.reference's
    mtp_forward drafts: logits at the fp32 model bar, the same greedy drafts. Scratch poisoned (LILY_DEBUG)."""
    from lily import _lily
    from lily.reference import MtpState, ReferenceState, Weights, forward_hidden, mtp_forward
    monkeypatch.setenv("LILY_DEBUG", "1")
    cfg, t, q = spec_models.weights(name, "random")
    eng = _lily.Engine(cfg.to_dict(), t, q, threads=2, max_context=256)
    assert eng.debug
    prompt = np.random.default_rng(n).integers(0, cfg.vocab_size, n + 1).astype(np.int32)
    st = eng.new_state()
    eng.forward(st, prompt[:n], logits="none", chunk_size=chunk)
    eng.forward(st, prompt[n:], logits="none")  # a one-row step (the head's row made in a decode step)
    token = int(prompt[-1] * 7 % cfg.vocab_size)
    k = 3
    drafts, logits = eng.draft(st, token, k)
    assert st.position == n + 1  # unchanged

    main = {kk: v for kk, v in t.items() if not kk.startswith("mtp.")}
    head = {kk: v for kk, v in t.items() if kk.startswith("mtp.")}
    w = Weights(main, {kk: v for kk, v in q.items() if not kk.startswith("mtp.")})
    m = Weights(head, {kk: v for kk, v in q.items() if kk.startswith("mtp.")})
    hidden = forward_hidden(w, cfg, ReferenceState(cfg), prompt)
    ms = MtpState(cfg)
    if n > 0:
        mtp_forward(w, m, cfg, ms, hidden[:-1], prompt[1:])
    ref_logits, h, tok = [], hidden[-1][None], token
    for j in range(k):
        lg, h = mtp_forward(w, m, cfg, ms, h, np.array([tok]))
        ref_logits.append(lg[0])
        tok = int(drafts[j])  # chain on the engine's drafts, so one near-tie cannot derail the comparison
    ref_logits = np.stack(ref_logits)
    bar = tol("model_vs_reference")
    err = np.linalg.norm(logits - ref_logits) / np.linalg.norm(ref_logits)
    assert err < bar["rel_rms"], err
    assert list(drafts) == [int(np.argmax(r)) for r in ref_logits]
    arrays = st.export_arrays()  # the head's cache: n rows, as the reference's
    assert int(arrays["mtp.rows"]) == n
    assert np.linalg.norm(np.asarray(arrays["mtp.k"]).reshape(ms.k[:n].shape) - ms.k[:n]) <= \
        bar["rel_rms"] * np.linalg.norm(ms.k[:n]) + 1e-30


def test_bad_input(tmp_path):
    from spec_models import model
    cfg, t, q, eng = engine("tiny", "drafting", 0.0)
    prompt, st, first = greedy_prompt_and_first(eng, cfg)
    with pytest.raises(ValueError, match="speculative must be 0"):
        eng.open_stream(st, first, 5, speculative=9)
    with pytest.raises(ValueError, match="speculative must be 0"):
        eng.open_stream(st, first, 5, speculative=-1)
    with pytest.raises(ValueError, match="draft: the state needs"):
        eng.draft(eng.new_state(), first, 2)
    m = model(tmp_path)
    with pytest.raises(SamplingParamsError, match="speculative"):
        m.generate("x", max_tokens=3, speculative=9)
    with pytest.raises(SamplingParamsError, match="speculative"):
        m.generate("x", max_tokens=3, speculative="yes")
    # no head: plain decoding by default, a clear error when asked for
    from lily import _lily
    from lily.testing import random_weights
    t2, q2 = random_weights(cfg, 1)
    plain_eng = _lily.Engine(cfg.to_dict(), t2, q2, threads=2, max_context=256)
    assert not plain_eng.has_mtp
    with pytest.raises(ValueError, match="needs the MTP head"):
        plain_eng.open_stream(plain_eng.new_state(), 1, 3, speculative=2)
    m.engine = plain_eng
    assert m.generate("x", max_tokens=3, temperature=0).stats.speculative is None
    with pytest.raises(LilyError, match="needs the model's MTP head"):
        m.generate("x", max_tokens=3, speculative=True)


def test_bundled_model_drafts_exactly():
    """The bundled model's trained head: greedy speculative replies equal plain ones, and its drafts verify
    (the acceptance figures: benchmarks/results/README.md)."""
    import lily
    m = lily.load(backend="cpu")
    if m.mtp is None:
        pytest.skip("this install's bundled model has no MTP head")
    assert m.engine.has_mtp
    for prompt in ("def fibonacci(n):\n", "import os\n"):
        a, b = m.session(), m.session()
        b.speculative_adaptive = False
        r1 = a.generate(prompt, max_tokens=120, temperature=0, speculative=False)
        r2 = b.generate(prompt, max_tokens=120, temperature=0, speculative=3)
        _same(r1, r2)
        assert r2.stats.accepted_tokens > 0.25 * r2.stats.drafted_tokens, r2.stats.summary()


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_seeded_sampling_is_plain_sampling_token_for_token(k):
    """A seed gives one text with speculation on or off (issue 44): drafts are greedy and each verified row draws
    with the uniform number plain decoding uses for that token, so the sampled reply is plain's, token for token,
    for three seeds and options that shape the rows (top-k/p, min-p, penalties)."""
    import lily
    m = lily.load(backend="cpu")
    if m.mtp is None:
        pytest.skip("this install's bundled model has no MTP head")
    opts = dict(max_tokens=80, temperature=0.8, top_p=0.95, top_k=40, min_p=0.01, repetition_penalty=1.1)
    drafted = accepted = 0
    for seed in (7, 11, 2026):
        r1 = m.session().generate("def fibonacci(n):\n", seed=seed, speculative=False, **opts)
        r2 = m.session().generate("def fibonacci(n):\n", seed=seed, speculative=k, **opts)
        assert r2.token_ids == r1.token_ids, (seed, k, r2.stats.summary())
        drafted += r2.stats.drafted_tokens
        accepted += r2.stats.accepted_tokens
    assert drafted > 0 and accepted > 0.1 * drafted, (accepted, drafted)  # the drafts ran and some stayed


@pytest.mark.parametrize("adaptive", [True, False])  # the plain probe step's row, or a verify's
def test_non_finite_logits_stop_a_speculative_generation(tmp_path, adaptive):
    """As plain decoding does: NaN in a row the stream would draw from is lily.NonFiniteLogitsError, and the
    session holds only tokens it was given."""
    import lily
    m = _pair(tmp_path, 0.0)
    s = m.session()
    s.speculative_adaptive = adaptive
    s.prefill("hello there")
    arrays = s._state.export_arrays()
    arrays["dn.0.ssm"] = np.full_like(np.asarray(arrays["dn.0.ssm"]), np.nan)  # the next forward's rows are NaN
    s._state.import_arrays(arrays)
    with pytest.raises(lily.NonFiniteLogitsError, match="non-finite logits"):
        s.generate(max_tokens=8, temperature=0, speculative=2)
    assert s._state.position <= len(s.tokens)

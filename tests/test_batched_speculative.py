"""Speculative streams decoded together with others (issue 45: "a stream's speculative rows (1 + k) are a segment
like any other"). Engine.step_streams drafts an explicit-k stream's k tokens with its head, runs its verify's 1 + k
rows in the same forward as the other streams' rows, then accepts, rolls back and runs its head rows as its lone
verify does. Each stream returns exactly the tokens it returns alone (greedy and seeded; heads that draft well and
partly), and leaves exactly the state it leaves alone (every array, the head's cache, the logits of one more
forward): a stop token inside an accepted draft, max_tokens cutting a verify short, a stream closed with accepted
drafts still queued. The rows step_streams reports are what the streams' own counters say the forward carried."""
from __future__ import annotations

import numpy as np
import pytest

import spec_models

GREEDY = dict(temperature=0.0)
SEEDED = [dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=0.8, repetition_penalty=1.2, seed=5),
          dict(temperature=1.0, min_p=0.05, seed=2026)]


def _weights(scale: float, hidden: float = 0.1):
    """lily.testing.drafting_weights (trunk_scale `scale`: 0 drafts well, 0.4 partly) with the head's fc reading the
    hidden state too (its hidden half, zero there, set to random * hidden / sqrt(H)): the head's rows then depend on
    which kept hidden row each one reads."""
    cfg, t, q = spec_models.weights("tiny", "drafting", scale)
    H = cfg.hidden_size
    fc = (t["mtp.fc.weight"].astype(np.uint32) << 16).view(np.float32).copy()  # bf16 bits -> fp32, [H, 2H]
    fc[:, H:] = np.random.default_rng(1).standard_normal((H, H)) * hidden / np.sqrt(H)
    t = {**t, "mtp.fc.weight": (fc.view(np.uint32) >> 16).astype(np.uint16)}
    return cfg, t, q


def engine(scale: float, hidden: float = 0.1):
    from lily import _lily
    cfg, t, q = _weights(scale, hidden)
    return cfg, t, q, _lily.Engine(cfg.to_dict(), t, q, threads=2, max_context=2048)


def _prompts(cfg, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, cfg.vocab_size, 4 + 5 * i).astype(np.int32) for i in range(n)]


def _open(eng, prompt, max_tokens: int, k: int, opts: dict, stop_ids=()):
    """A stream after prompt[:-1], feeding prompt[-1]; k = 0: plain (batch: drawn in the extension, also where the
    backend has a device sampler), else explicit k."""
    st = eng.new_state()
    eng.forward(st, prompt[:-1], logits="none")
    s = eng.open_stream(st, int(prompt[-1]), max_tokens, stop_ids=list(stop_ids), device=True, batch=True,
                        speculative=k, adaptive=False, **opts)
    assert s.draws and s.speculative == (k > 0)
    return st, s


def _end(eng, st) -> tuple[dict, np.ndarray]:
    """The state's arrays (main, DeltaNet, KV, the head's cache and last hidden state) and one more forward's
    logits."""
    arrays = {name: np.array(v) for name, v in st.export_arrays().items()}
    return arrays, np.array(eng.forward(st, np.asarray([3], np.int32), logits="last"))


def _alone(eng, prompt, max_tokens, k, opts, stop_ids=(), close_after=None):
    st, s = _open(eng, prompt, max_tokens, k, opts, stop_ids)
    out = []
    while (close_after is None or len(out) < close_after) and (t := s.next()) >= 0:
        out.append(t)
    stats = s.spec_stats
    s.close()
    return out, stats, _end(eng, st)


def _counters(s) -> np.ndarray:
    st = s.spec_stats
    return np.array([st["plain_steps"], st["verifies"], st["drafted"]])


def _together(eng, cases: list[dict]):
    """Every case's stream opened, then rounds of one step_streams and one next() each. A case's close_after: closed
    right after its next() returned that many tokens; close_after_step: closed in the round after that, after
    step_streams (which may have run its next step) and before its next(). Returns each stream's tokens, stats, end
    state, (position before close, after), and per round step_streams' rows, each stream's counter increments
    inside step_streams (plain steps, verifies, drafts) and the tokens each had returned before it."""
    opened = [_open(eng, c["prompt"], c["max_tokens"], c["k"], c["opts"], c.get("stop_ids", ())) for c in cases]
    streams = [s for _, s in opened]
    got: list[list[int]] = [[] for _ in cases]
    stats: list[dict | None] = [None] * len(cases)
    closed: list[tuple[int, int] | None] = [None] * len(cases)

    def close(i):
        st, s = opened[i]
        stats[i], before = s.spec_stats, st.position
        s.close()
        closed[i] = (before, st.position)

    rounds = []
    while not all(s.ended for s in streams):
        before = [_counters(s) for s in streams]
        returned = [len(g) for g in got]
        rows = eng.step_streams(streams)
        rounds.append((rows, [_counters(s) - b for s, b in zip(streams, before)], returned))
        for i, s in enumerate(streams):
            if s.ended:
                continue
            if cases[i].get("close_after_step") == len(got[i]):
                close(i)
                continue
            if (t := s.next()) >= 0:
                got[i].append(t)
            if cases[i].get("close_after") == len(got[i]):
                close(i)
    for i in range(len(cases)):
        if closed[i] is None:
            close(i)
    return got, stats, [_end(eng, st) for st, _ in opened], rounds, closed


def _same_end(name: str, got, alone) -> None:
    (a_got, l_got), (a_alone, l_alone) = got, alone
    assert sorted(a_got) == sorted(a_alone), name
    for key in a_alone:
        assert np.array_equal(a_got[key], a_alone[key]), f"{name}: {key} differs from the stream's run alone"
    assert np.array_equal(l_got, l_alone), f"{name}: the next forward's logits differ"


def _check_rounds(rounds, cases) -> int:
    """Each round's rows are what the streams' counters say ran inside step_streams: one per plain step, 1 + k per
    verify of k drafts; returns how many verify rows went into forwards beside other streams' rows."""
    beside = 0
    for rows, inc, _ in rounds:
        carried = sum(int(d[0] + d[1] + d[2]) for d in inc)
        assert rows == carried, (rows, inc)
        stepped = sum(1 for d in inc if d[0] + d[1] > 0)
        assert rows == 0 or stepped >= 2, (rows, inc)  # a forward of several streams, or none
        if stepped >= 2:
            beside += sum(int(d[1] + d[2]) for d in inc)
    return beside


def _plain_tokens(eng, prompt, n: int, opts: dict) -> list[int]:
    return _alone(eng, prompt, n, 0, opts)[0]


@pytest.mark.parametrize("scale", [0.0, 0.4], ids=["drafts_well", "drafts_partly"])
@pytest.mark.parametrize("ks", [(1,), (4,), (2, 3)], ids=["k1", "k4", "k2_k3"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_verify_rows_join_the_forward_and_each_stream_is_as_alone(scale, ks, sampling):
    cfg, _, _, eng = engine(scale)
    spec_opts = [GREEDY if sampling == "greedy" else SEEDED[j] for j in range(len(ks))]
    prompts = _prompts(cfg, 2 + len(ks))
    # two plain streams (greedy, seeded) that outlast the speculative ones, so every verify has company
    cases = [dict(prompt=prompts[0], max_tokens=40, k=0, opts=GREEDY),
             dict(prompt=prompts[1], max_tokens=40, k=0, opts=SEEDED[0])]
    cases += [dict(prompt=prompts[2 + j], max_tokens=[30, 23][j], k=k, opts=spec_opts[j]) for j, k in enumerate(ks)]
    alone = [_alone(eng, c["prompt"], c["max_tokens"], c["k"], c["opts"]) for c in cases]
    got, stats, ends, rounds, _ = _together(eng, cases)
    for i, c in enumerate(cases):
        assert got[i] == alone[i][0], f"stream {i} (k={c['k']}): tokens differ from its run alone"
        _same_end(f"stream {i} (k={c['k']})", ends[i], alone[i][2])
        if c["k"]:  # and they are plain decoding's (speculation never changes the tokens)
            assert got[i] == _plain_tokens(eng, c["prompt"], c["max_tokens"], c["opts"])
            assert (stats[i]["drafted"], stats[i]["accepted"]) == (alone[i][1]["drafted"], alone[i][1]["accepted"])
    spec = [i for i, c in enumerate(cases) if c["k"]]
    verifies_in_forwards = sum(int(inc[i][1]) for _, inc, _ in rounds for i in spec)
    assert verifies_in_forwards == sum(stats[i]["verifies"] for i in spec) > 0  # none ran alone in next()
    beside = _check_rounds(rounds, cases)
    assert beside >= sum(stats[i]["verifies"] + stats[i]["drafted"] for i in spec)
    if sampling == "greedy":  # drafts kept, and drafts rolled back (by replay: the verify had company)
        drafted = sum(stats[i]["drafted"] for i in spec)
        accepted = sum(stats[i]["accepted"] for i in spec)
        assert 0 < accepted < drafted and (scale > 0 or accepted > drafted / 2), (accepted, drafted)


def test_a_stop_token_inside_an_accepted_draft():
    """Every draft verifies (k = 4: groups of four drafts and a draw); the stop id is a draft followed by more
    accepted drafts, so the stream ends with fed tokens the host never took, and close() gives them back."""
    cfg, _, _, eng = engine(0.0, hidden=0.0)  # the head drafts the trunk's own next token: every draft verifies
    prompts = _prompts(cfg, 3)
    ref = _alone(eng, prompts[2], 40, 4, GREEDY)[0]
    at = next((i for i in range(5, len(ref)) if i % 5 in (0, 1) and ref[i] not in ref[:i]), None)
    assert at is not None, ref
    stop = [ref[at]]
    cases = [dict(prompt=prompts[0], max_tokens=40, k=0, opts=GREEDY),
             dict(prompt=prompts[1], max_tokens=40, k=0, opts=SEEDED[1]),
             dict(prompt=prompts[2], max_tokens=40, k=4, opts=GREEDY, stop_ids=stop)]
    alone = [_alone(eng, c["prompt"], c["max_tokens"], c["k"], c["opts"], c.get("stop_ids", ())) for c in cases]
    assert alone[2][0] == ref[:at + 1]
    got, stats, ends, rounds, closed = _together(eng, cases)
    for i in range(3):
        assert got[i] == alone[i][0]
        _same_end(f"stream {i}", ends[i], alone[i][2])
    assert stats[2]["accepted"] == stats[2]["drafted"] > 0
    # the accepted drafts after the stop id were fed, then given back: the state holds first and the returned tokens
    before, after = closed[2]
    assert before > after and after - (len(prompts[2]) - 1) <= 1 + len(got[2])
    _check_rounds(rounds, cases)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 9])
@pytest.mark.parametrize("scale", [0.0, 0.4])
def test_max_tokens_ends_inside_a_verify(max_tokens, scale):
    """k = 4 with max_tokens leaving fewer than 4 drafts to make: the last verify is cut to fit (or, one token
    left, a plain row in the forward); tokens and state as alone, and as plain decoding."""
    cfg, _, _, eng = engine(scale)
    prompts = _prompts(cfg, 3)
    cases = [dict(prompt=prompts[0], max_tokens=12, k=0, opts=GREEDY),
             dict(prompt=prompts[1], max_tokens=max_tokens, k=4, opts=GREEDY),
             dict(prompt=prompts[2], max_tokens=max_tokens + 1, k=3, opts=SEEDED[2])]
    alone = [_alone(eng, c["prompt"], c["max_tokens"], c["k"], c["opts"]) for c in cases]
    got, stats, ends, rounds, _ = _together(eng, cases)
    for i, c in enumerate(cases):
        assert got[i] == alone[i][0] == _plain_tokens(eng, c["prompt"], c["max_tokens"], c["opts"])
        assert len(got[i]) == c["max_tokens"]
        _same_end(f"stream {i}", ends[i], alone[i][2])
    for i in (1, 2):  # each verify drafts no token past max_tokens: k cut to the tokens left, less the draw
        for _, inc, returned in rounds:
            left = cases[i]["max_tokens"] - returned[i]
            assert inc[i][2] <= max(0, min(cases[i]["k"], left - 1)), (i, inc[i], returned[i])
    if max_tokens == 1:  # no room for a draft: a plain row in the forward
        assert rounds[0][1][1].tolist() == [1, 0, 0] and stats[1]["verifies"] == 0
    elif max_tokens <= 4:  # the first verify, cut to max_tokens - 1 drafts, ran in the forward
        assert rounds[0][1][1].tolist() == [0, 1, max_tokens - 1]
    _check_rounds(rounds, cases)


def _fed_one_by_one(eng, prompt, tokens) -> tuple[dict, np.ndarray]:
    """The state after prompt[:-1] and then `tokens` fed as one-row steps (lock-step)."""
    st = eng.new_state()
    eng.forward(st, prompt[:-1], logits="none")
    s = eng.open_stream(st, tokens[0], len(tokens), device=False)
    for t in tokens:
        s.step(t)
    s.close()
    return _end(eng, st)


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("scale", [0.0, 0.4])
def test_a_speculative_stream_closed_mid_way(m, scale):
    """Closed right after its m-th token (accepted drafts may still be queued): its state is what its lone run
    closed there leaves. Closed a round later, after step_streams may have run its next verify, before its next():
    the state holds first and the returned tokens (the last one maybe not), as if fed one by one. The other
    streams go on as alone."""
    cfg, _, _, eng = engine(scale)
    prompts = _prompts(cfg, 4)
    cases = [dict(prompt=prompts[0], max_tokens=16, k=0, opts=SEEDED[0]),
             dict(prompt=prompts[1], max_tokens=30, k=4, opts=GREEDY, close_after=m),
             dict(prompt=prompts[2], max_tokens=16, k=2, opts=SEEDED[1]),
             dict(prompt=prompts[3], max_tokens=30, k=3, opts=GREEDY, close_after_step=m)]
    alone = [_alone(eng, c["prompt"], c["max_tokens"], c["k"], c["opts"], close_after=c.get("close_after"))
             for c in cases]
    got, _, ends, rounds, closed = _together(eng, cases)
    for i in range(3):
        assert got[i] == alone[i][0]
        _same_end(f"stream {i}", ends[i], alone[i][2])
    assert len(got[1]) == m and closed[1][1] - (len(prompts[1]) - 1) <= m + 1  # first and the returned tokens at most
    assert got[3] == alone[3][0][:m]
    fed = closed[3][1] - (len(prompts[3]) - 1)
    assert fed in (m, m + 1), (closed[3], m)
    _same_end("stream 3", ends[3], _fed_one_by_one(eng, prompts[3], [int(prompts[3][-1])] + got[3][:fed - 1]))
    _check_rounds(rounds, cases)


def test_one_speculative_stream_alone_still_verifies_in_next():
    """step_streams needs two streams to join: a lone explicit-k stream is left to its next()."""
    cfg, _, _, eng = engine(0.0)
    st, s = _open(eng, _prompts(cfg, 1)[0], 10, 3, GREEDY)
    assert eng.step_streams([s]) == 0 and s.spec_stats["verifies"] == 0
    assert s.next() >= 0 and s.spec_stats["verifies"] == 1
    s.close()


def test_verify_rows_together_on_emulated_metal():
    """The Metal backend keeps no DeltaNet state rows and runs head rows one by one (no mtp_embed_each): the
    batched verify rolls back by replay and feeds the head copies of its kept hidden rows; still as alone."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "metal"))
    import test_metal_backend as t_be  # (skips where the build has no emulated Metal)

    cfg, t, q = _weights(0.4)
    prompts = _prompts(cfg, 3)
    cases = [dict(prompt=prompts[0], max_tokens=14, k=0, opts=GREEDY),
             dict(prompt=prompts[1], max_tokens=12, k=3, opts=GREEDY),
             dict(prompt=prompts[2], max_tokens=10, k=2, opts=SEEDED[0])]

    def run():
        eng = t_be.metal_engine(cfg, t, q)
        assert eng.batches_streams and eng.has_mtp
        alone = [_alone(eng, c["prompt"], c["max_tokens"], c["k"], c["opts"]) for c in cases]
        return alone, _together(eng, cases)

    alone, (got, stats, ends, rounds, _) = t_be._in_child(run)
    for i in range(3):
        assert got[i] == alone[i][0]
        _same_end(f"stream {i}", ends[i], alone[i][2])
    assert _check_rounds(rounds, cases) > 0
    accepted, drafted = (sum(stats[i][key] for i in (1, 2)) for key in ("accepted", "drafted"))
    assert 0 < accepted < drafted, stats  # drafts kept, and drafts rolled back (by replay)

"""Concurrent streams decoded together (issue 45): Engine.step_streams runs one plain step for several streams in
one forward, and each stream returns exactly what it returns alone (greedy and seeded sampling, different prompt
lengths, streams that end at different steps, one closed mid-way, one speculative whose verify rows join the
forward), leaving exactly the state it leaves alone; Model.batch_generate gives each prompt its own generate call's
result. More on speculative streams together: test_batched_speculative.py."""
from __future__ import annotations

import numpy as np
import pytest

import lily

PROMPTS = ["The list type", "A dictionary maps keys to values, and the", "x", "Once upon a time there was a small"]


@pytest.fixture(scope="module")
def model():
    return lily.load(backend="cpu")  # the bundled model, with its MTP head (states keep the head's cache current)


def _options(i: int) -> dict:
    """A different sampler per stream: greedy, seeded top-p, penalised, min-p with a bias."""
    return [dict(temperature=0.0),
            dict(temperature=0.9, top_p=0.9, seed=11),
            dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.2, counts=True, seed=5),
            dict(temperature=1.1, min_p=0.05, bias_ids=[7], bias_vals=[2.0], seed=2**64 - 3)][i % 4]


def _open(model, i: int, max_tokens: int, speculative: int = 0, adaptive: bool = False):
    eng = model.engine
    ids = model.tokenize(PROMPTS[i])
    st = eng.new_state()
    logits = eng.forward(st, np.asarray(ids[:-1], np.int32), logits="none") if len(ids) > 1 else None
    del logits
    o = dict(_options(i))
    counts = np.zeros(model.vocab_size, np.int32) if o.pop("counts", False) else None
    seed = o.pop("seed", 0)
    stream = eng.open_stream(st, ids[-1], max_tokens, stop_ids=[], device=True, counts=counts, seed=seed,
                             speculative=speculative, adaptive=adaptive, **o)
    return st, stream


HEAD = ("mtp.rows", "mtp.k", "mtp.v", "mtp.hidden")  # the MTP head's cache and last hidden state


def _head(st) -> dict:
    a = st.export_arrays()
    return {k: np.asarray(a[k]) for k in HEAD}


def _solo(model, i: int, max_tokens: int, speculative: int = 0) -> tuple[list[int], np.ndarray, dict]:
    st, s = _open(model, i, max_tokens, speculative)  # (an explicit k: drafts to the end)
    out = []
    while (t := s.next()) >= 0:
        out.append(t)
    s.close()
    head = _head(st)
    after = model.engine.forward(st, np.asarray([3], np.int32), logits="last")
    return out, np.asarray(after), head


def test_streams_stepped_together_return_what_they_return_alone(model):
    lengths = [14, 9, 14, 5]  # streams end at different steps
    solo = [_solo(model, i, n) for i, n in enumerate(lengths)]
    solo_spec = _solo(model, 0, 12, speculative=2)
    opened = [_open(model, i, n) for i, n in enumerate(lengths)]
    spec_state, spec = _open(model, 0, 12, speculative=2)  # an explicit k: its verify rows join the forward
    states, streams = [o[0] for o in opened], [o[1] for o in opened]
    got: list[list[int]] = [[] for _ in streams]
    spec_got: list[int] = []
    together = []
    while not all(s.ended for s in streams) or not spec.ended:
        together.append(model.engine.step_streams(streams + [spec]))
        for i, s in enumerate(streams):
            if not s.ended and (t := s.next()) >= 0:
                got[i].append(t)
        if not spec.ended and (t := spec.next()) >= 0:
            spec_got.append(t)
    assert [g for g in got] == [s[0] for s in solo]
    assert spec_got == solo_spec[0]
    # really stepped together: the first round carries the four plain rows and the verify's 1 + 2
    assert together[0] == 7 and spec.spec_stats["verifies"] > 0 and together.count(0) <= 2, together
    for st, s, (_, after, head) in zip(states + [spec_state], streams + [spec], solo + [solo_spec]):
        s.close()
        got_head = _head(st)  # the head rows of the batched steps ran together (mtp_embed_each), as alone
        for k in HEAD:
            np.testing.assert_array_equal(got_head[k], head[k], err_msg=k)
        np.testing.assert_array_equal(np.asarray(model.engine.forward(st, np.asarray([3], np.int32))), after)


def test_a_stream_drafting_with_speculative_auto_joins_the_others(model):
    solo = [_solo(model, i, 10)[0] for i in range(2)]
    plain = _open(model, 0, 10)[1]
    auto = _open(model, 1, 10, speculative=2, adaptive=True)[1]
    got: list[list[int]] = [[], []]
    rows = []
    for _ in range(10):
        rows.append(model.engine.step_streams([plain, auto]))
        got[0].append(plain.next())
        got[1].append(auto.next())
    assert got == solo and rows == [2] * 10
    assert auto.spec_stats["status"] == "plain: decoded together with other streams" and auto.spec_stats["verifies"] == 0


def test_a_stream_closed_mid_way_leaves_the_others_as_they_are_alone(model):
    solo = [_solo(model, i, 10)[0] for i in range(3)]
    streams = [_open(model, i, 10)[1] for i in range(3)]
    got: list[list[int]] = [[], [], []]
    for step in range(10):
        model.engine.step_streams(streams)
        for i, s in enumerate(streams):
            if not s.ended:
                got[i].append(s.next())
        if step == 3:
            streams[1].close()  # the client hung up: its queued draw is dropped, the others go on
    assert got[0] == solo[0] and got[2] == solo[2] and got[1] == solo[1][:4]


def test_step_streams_refuses_two_streams_over_one_state(model):
    st, a = _open(model, 0, 4)
    other = model.engine.new_state()
    model.engine.forward(other, np.asarray([1, 2], np.int32), logits="none")
    b = model.engine.open_stream(other, 3, 4, device=True)
    assert model.engine.step_streams([a]) == 0  # one stream: its next() steps it
    c = model.engine.open_stream(st, 3, 4, device=True)
    with pytest.raises(ValueError, match="one state"):
        model.engine.step_streams([a, b, c])


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=3)],
                         ids=["greedy", "seeded"])
def test_batch_generate_equals_each_prompt_alone(model, kw):
    prompts = [PROMPTS[0], [{"role": "user", "content": "Hi there"}], PROMPTS[3]]
    alone = [model.generate(p, max_tokens=12, **kw) for p in prompts]
    together = model.batch_generate(prompts, max_tokens=12, **kw)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.text for r in together] == [r.text for r in alone]
    assert all(r.stats.generated_tokens == len(r.token_ids) for r in together)


def test_model_stream_is_generate_streaming(model):
    chunks = list(model.stream(PROMPTS[0], max_tokens=6, temperature=0.0))
    whole = model.generate(PROMPTS[0], max_tokens=6, temperature=0.0)
    assert [c.token_id for c in chunks] == whole.token_ids and chunks[-1].finish_reason == whole.finish_reason
    assert chunks[-1].stats is not None

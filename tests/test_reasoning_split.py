"""Reasoning as data: a chat reply split into `GenerationResult.reasoning` / `.text` and per-chunk
`channel`, on the bundled model, compared against the same generation left unsplit."""
from __future__ import annotations

import pytest

import lily
from lily.generation import collect, split_reasoning

MESSAGES = [{"role": "user", "content": "Hi!"}]
GREEDY = dict(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return lily.load()


def _run(model, prompt_text: str, **sampling):
    """The same greedy generation twice: as raw chunks and as the chunks split_reasoning gives."""
    ids = model.tokenizer.encode(prompt_text)
    raw = list(model.session().generate(ids, whole=True, stream=True, **sampling))
    split = list(split_reasoning(model.session().generate(ids, whole=True, stream=True, **sampling), prompt_text))
    return raw, split


def _no_stop_bias(model, *extra: int) -> dict[int, float]:
    eos = model.generation_config.get("eos_token_id") or []
    return {t: -100.0 for t in [*([eos] if isinstance(eos, int) else eos), *extra]}


def test_thinking_reply_splits_into_reasoning_and_answer(model):
    prompt = model.apply_chat_template(MESSAGES)
    assert prompt.rstrip().endswith("<think>")  # thinking is on by default: the reply starts as reasoning
    raw, split = _run(model, prompt, **GREEDY)
    raw_text = "".join(c.text for c in raw)
    assert "</think>" in raw_text  # the bundled model closes its (empty) think block
    head, _, tail = raw_text.partition("</think>")
    result = collect(iter(split))
    assert result.reasoning == head.strip("\n")
    assert result.text == tail.lstrip() and result.text and "<think>" not in result.text
    assert str(result) == result.text
    assert result.token_ids == [c.token_id for c in raw]


def test_chunks_carry_their_channel(model):
    prompt = model.apply_chat_template(MESSAGES)
    raw, split = _run(model, prompt, **GREEDY)
    assert len(split) == len(raw)  # still one chunk per sampled token
    channels = [c.channel for c in split]
    first_content = channels.index("content")
    assert set(channels[:first_content]) == {"reasoning"} and set(channels[first_content:]) == {"content"}
    end = next(i for i, c in enumerate(raw) if c.token_id == model.tokenizer.think_end_id)
    assert split[end].channel == "reasoning" and split[end].text == ""  # the closing tag is not answer text
    assert all(not c.reasoning for c in split[first_content:])
    assert "".join(c.text for c in split) == collect(iter(split)).text
    assert split[-1].finish_reason == raw[-1].finish_reason == "length"
    assert split[-1].stats.generated_tokens == len(raw)


def test_reply_cut_inside_reasoning_is_reasoning_not_answer(model):
    """max_tokens reached before </think> (banned here): everything is reasoning, the answer is empty."""
    prompt = model.apply_chat_template(MESSAGES)
    sampling = dict(max_tokens=12, temperature=0.0, logit_bias=_no_stop_bias(model, model.tokenizer.think_end_id))
    raw, split = _run(model, prompt, **sampling)
    result = collect(iter(split))
    assert result.finish_reason == "length"
    assert result.text == ""
    assert result.reasoning == "".join(c.text for c in raw) and result.reasoning.strip()
    assert {c.channel for c in split} == {"reasoning"}


def test_thinking_off_reply_is_all_answer(model):
    prompt = model.apply_chat_template(MESSAGES, enable_thinking=False)
    raw, split = _run(model, prompt, **GREEDY)
    result = collect(iter(split))
    assert result.reasoning == "" and result.text == "".join(c.text for c in raw)
    assert {c.channel for c in split} == {"content"}


def test_collect_splits_when_given_the_prompt(model):
    prompt = model.apply_chat_template(MESSAGES)
    ids = model.tokenizer.encode(prompt)
    by_collect = collect(model.session().generate(ids, whole=True, stream=True, **GREEDY), prompt)
    _, split = _run(model, prompt, **GREEDY)
    assert (by_collect.reasoning, by_collect.text) == (collect(iter(split)).reasoning, collect(iter(split)).text)


def test_raw_prompt_stream_is_not_split_and_splitting_twice_is_harmless(model):
    chunks = list(model.session().generate("The engine", stream=True, **GREEDY))
    assert {c.channel for c in chunks} == {None} and not any(c.reasoning for c in chunks)
    prompt = model.apply_chat_template(MESSAGES)
    _, split = _run(model, prompt, **GREEDY)
    again = list(split_reasoning(iter(split), True))
    assert [(c.text, c.reasoning, c.channel) for c in again] == [(c.text, c.reasoning, c.channel) for c in split]


def test_model_generate_on_messages_returns_the_split(model):
    result = model.generate(MESSAGES, **GREEDY)
    assert "</think>" not in result.text and result.text == result.text.lstrip()

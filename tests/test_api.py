"""End-to-end Python API on a tiny random model (reference engine): generate, stream, stop conditions,
sessions, context errors, cancellation, load()."""
import importlib

import numpy as np
import pytest

import lily
from lily import BackendUnavailableError, CheckpointError, ContextLengthError
from tiny_model_fixtures import tiny_model

PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"), max_context=96)


def greedy(model, prompt=PROMPT, n=12, **kw):
    return model.generate(prompt, max_tokens=n, temperature=0, **kw)


def test_greedy_matches_teacher_forced_argmax(model):
    r = greedy(model)
    assert r.finish_reason == "length" and len(r.token_ids) == 12
    prompt = model.tokenize(PROMPT)
    logits = model.logits(prompt + r.token_ids)
    assert logits.shape == (len(prompt) + 12, model.vocab_size) and logits.dtype == np.float32
    assert r.token_ids == np.argmax(logits[len(prompt) - 1:-1], axis=-1).tolist()


def test_result_text_and_stats(model):
    r = greedy(model)
    assert str(r) == r.text == model.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    s = r.stats
    assert s.prompt_tokens == len(model.tokenize(PROMPT)) and s.cached_tokens == 0 and s.generated_tokens == 12
    assert s.ttft_s > 0 and s.prefill_tokens_per_s > 0 and s.decode_tokens_per_s > 0
    line = s.summary()
    assert line.startswith(f"prompt {s.prompt_tokens} tok, prefill ") and line.endswith("12 tok")


def test_stream_matches_non_stream(model):
    kw = dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, logprobs=True)
    r = model.generate(PROMPT, **kw)
    chunks = list(model.generate(PROMPT, stream=True, **kw))
    assert [c.token_id for c in chunks] == r.token_ids
    assert "".join(c.text for c in chunks) == r.text
    assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats.generated_tokens == 10
    assert [c.logprob for c in chunks] == [lp.logprob for lp in r.logprobs]


def test_seeded_sampling_is_reproducible(model):
    a = model.generate(PROMPT, max_tokens=8, temperature=1.0, seed=1)
    b = model.generate(PROMPT, max_tokens=8, temperature=1.0, seed=1)
    c = model.generate(PROMPT, max_tokens=8, temperature=1.0, seed=2)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_logprobs_match_log_softmax_of_logits(model):
    r = greedy(model, n=4, logprobs=3)
    prompt = model.tokenize(PROMPT)
    logits = model.logits(prompt + r.token_ids).astype(np.float64)
    for i, lp in enumerate(r.logprobs):
        row = logits[len(prompt) - 1 + i]
        ref = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert lp.logprob == pytest.approx(ref[r.token_ids[i]], abs=1e-4)
        assert list(lp.top) == np.argsort(-ref)[:3].tolist()


def test_stop_string_truncates_and_is_never_streamed(model):
    full = greedy(model, n=30)
    text = full.text
    # a stop string from the middle of the greedy text (at least 2 characters)
    stop = next(text[i:i + 3] for i in range(3, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    cut = text.index(stop)
    r = greedy(model, n=30, stop=[stop, "never-appears"])
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.text == text[:cut]
    chunks = list(model.generate(PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert "".join(c.text for c in chunks) == text[:cut]
    assert all(stop not in c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"


def test_stop_token_ends_generation(model):
    full = greedy(model, n=8)
    r = greedy(model, n=8, stop_token_ids=[full.token_ids[3]])
    first = full.token_ids.index(full.token_ids[3])
    assert r.token_ids == full.token_ids[:first + 1]  # the stop token is reported, not rendered
    assert r.finish_reason == "stop" and r.stop_reason == full.token_ids[3]
    assert r.text == model.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)


def test_im_end_is_a_stop_token(model):
    im_end = model.tokenizer.im_end_id
    assert im_end in model.stop_token_ids
    r = greedy(model, n=8, logit_bias={im_end: 100.0})
    assert r.token_ids == [im_end] and r.text == "" and r.finish_reason == "stop"


def test_chat_messages_use_template(model):
    msgs = [{"role": "user", "content": "Hi"}]
    assert model.apply_chat_template(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    r = model.generate(msgs, max_tokens=4, temperature=0, enable_thinking=False)
    ids = model.apply_chat_template(msgs, enable_thinking=False, tokenize=True)
    assert r.stats.prompt_tokens == len(ids)
    assert r.token_ids == greedy(model, prompt=ids, n=4).token_ids
    with pytest.raises(TypeError, match="only apply to chat messages"):
        model.generate("plain", max_tokens=2, enable_thinking=False)


def test_session_continues_like_one_long_prompt(model):
    s = model.session()
    pre = s.prefill(PROMPT)
    assert s.position == pre.prompt_tokens == len(model.tokenize(PROMPT))
    r1 = s.generate(max_tokens=5, temperature=0)
    assert s.tokens == model.tokenize(PROMPT) + r1.token_ids
    r2 = s.generate(" And then", max_tokens=5, temperature=0)
    assert r2.stats.cached_tokens == len(model.tokenize(PROMPT)) + 4  # the last sampled token was pending
    ref = greedy(model, prompt=model.tokenize(PROMPT) + r1.token_ids + model.tokenize(" And then"), n=5)
    assert r2.token_ids == ref.token_ids
    assert s.position == len(s.tokens)


def test_model_prefill_returns_a_ready_session(model):
    s = model.prefill([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert s.position == len(model.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False,
                                                        tokenize=True))
    r = s.generate(max_tokens=3, temperature=0)
    assert r.stats.cached_tokens == r.stats.prompt_tokens  # nothing recomputed
    assert r.token_ids == model.generate([{"role": "user", "content": "Hi"}], enable_thinking=False,
                                         max_tokens=3, temperature=0).token_ids


def test_session_snapshot_restore(model):
    s = model.session()
    s.prefill(PROMPT)
    snap = s.snapshot()
    a = s.generate(max_tokens=6, temperature=0.8, seed=3)
    s.restore(snap)
    assert s.position == snap.position
    b = s.generate(max_tokens=6, temperature=0.8, seed=3)
    assert a.token_ids == b.token_ids
    s.reset()
    assert s.position == 0 and s.tokens == []
    with pytest.raises(lily.LilyError, match="empty"):
        s.generate(max_tokens=1)


def test_session_reuses_chat_prefix(model):
    turn1 = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    turn2 = turn1 + [{"role": "user", "content": "How are you?"}]
    s = model.session()
    s.prefill(turn1, add_generation_prompt=False, preserve_thinking=True)
    n1 = s.position
    r = s.generate(turn2, max_tokens=3, temperature=0, preserve_thinking=True)
    assert r.stats.cached_tokens == n1
    assert r.token_ids == model.generate(turn2, max_tokens=3, temperature=0, preserve_thinking=True).token_ids
    # a conversation that does not extend the session starts over (honest cached_tokens)
    r = s.generate([{"role": "user", "content": "Other"}], max_tokens=2, temperature=0)
    assert r.stats.cached_tokens == 0


def test_context_overflow_is_an_error_naming_the_numbers(model):
    n = len(model.tokenize(PROMPT))
    with pytest.raises(ContextLengthError) as e:
        model.generate(PROMPT, max_tokens=200)
    msg = str(e.value)
    assert f"prompt is {n} tokens" in msg and "max_tokens is 200" in msg and "context size 96" in msg
    with pytest.raises(ContextLengthError, match="context size 96"):
        model.generate(list(range(10)) * 10, max_tokens=1)


def test_default_max_tokens_fills_the_context(model):
    ids = list(range(5, 95))
    r = model.generate(ids, temperature=0, stop_token_ids=[], logit_bias={t: -100.0 for t in model.stop_token_ids})
    assert r.finish_reason == "length" and len(r.token_ids) == 96 - 90


def test_closing_a_stream_stops_generation(model):
    s = model.session()
    it = s.generate(PROMPT, max_tokens=50, temperature=0, stream=True)
    got = [next(it) for _ in range(3)]
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    assert s.tokens == model.tokenize(PROMPT) + [c.token_id for c in got]


def test_interrupt_inside_a_step_keeps_the_session_consistent(model):
    s = model.session()
    engine = model.engine
    calls = {"n": 0}
    real = engine.forward

    def flaky(state, tokens, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(state, tokens, **kw)

    engine.forward = flaky
    try:
        with pytest.raises(KeyboardInterrupt):
            s.generate(PROMPT, max_tokens=10, temperature=0)
    finally:
        del engine.forward
    assert s.position == len(model.tokenize(PROMPT)) + 3
    assert s._state.position == len(s._tokens)
    more = s.generate(max_tokens=2, temperature=0)  # and it can carry on
    assert len(more.token_ids) == 2


@pytest.mark.parametrize("bad_call", [1, 3])  # the prompt's logits, or a later decode step's
def test_non_finite_logits_stop_generation_with_a_clear_error(model, bad_call):
    engine = model.engine
    calls = {"n": 0}
    real = engine.forward

    def broken(state, tokens, **kw):
        calls["n"] += 1
        out = real(state, tokens, **kw)
        if calls["n"] == bad_call:
            out = out.copy()
            out[..., 5] = np.nan
        return out

    engine.forward = broken
    try:
        with pytest.raises(lily.NonFiniteLogitsError, match="non-finite logits"):
            model.generate(PROMPT, max_tokens=8, temperature=0.7, seed=1)
    finally:
        del engine.forward


def test_generation_config_supplies_defaults(tmp_path):
    m = tiny_model(tmp_path, generation_config={"temperature": 0.0, "top_k": 20})
    assert m.generate(PROMPT, max_tokens=5).token_ids == m.generate(PROMPT, max_tokens=5, temperature=0).token_ids


def test_bytes_prompt_is_refused_not_read_as_token_ids(model):
    with pytest.raises(TypeError, match="bytes"):
        model.generate(b"Hello", max_tokens=2)


def test_bad_prompts(model):
    with pytest.raises(TypeError, match="prompt must be"):
        model.generate(3.5, max_tokens=1)
    with pytest.raises(ValueError, match="out of range"):
        model.generate([model.vocab_size], max_tokens=1)
    with pytest.raises(lily.SamplingParamsError, match="top_p"):
        model.generate(PROMPT, max_tokens=1, top_p=2.0)


def test_repr_and_info(model):
    assert "backend='reference'" in repr(model) and "max_context=96" in repr(model)
    info = model.info()
    assert info["backend"] == "reference" and info["max_context"] == 96 and info["bytes"] > 0


def test_load_errors():
    with pytest.raises(BackendUnavailableError, match="expected one of"):
        lily.load("x", backend="tpu")
    try:
        importlib.import_module("lily._lily")
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="backend='reference'"):
            lily.load("x", backend="cpu")
    from lily.model import BUNDLED_MODEL_DIR
    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        with pytest.raises(CheckpointError, match="bundled"):
            lily.load(backend="reference")


def _backends():
    try:
        importlib.import_module("lily._lily")
        return ["reference", "cpu"]
    except ImportError:
        return ["reference"]


@pytest.mark.parametrize("backend", _backends())
def test_load_synthetic_checkpoint(tmp_path, backend):
    writer = pytest.importorskip("lily.testing.checkpoint_writer")
    pytest.importorskip("lily.checkpoint")
    from lily.testing import random_weights, tiny_configs
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=0)
    writer.write_mlx_checkpoint(tmp_path, cfg, tensors, quant)
    writer.write_tokenizer(tmp_path, vocab_size=cfg.vocab_size)
    m = lily.load(tmp_path, backend=backend, max_context=64)
    assert m.backend == backend and m.max_context == 64 and m.params > 0
    assert m.chat_template.available
    r = m.generate([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert len(r.token_ids) >= 1 and r.stats.prompt_tokens > 0
    s = m.session()
    s.prefill("Hello")
    snap = s.snapshot()
    a = s.generate(max_tokens=3, temperature=0).token_ids
    s.restore(snap)
    assert s.generate(max_tokens=3, temperature=0).token_ids == a
    with pytest.raises(ContextLengthError, match="max_position_embeddings"):
        lily.load(tmp_path, backend="reference", max_context=10**7)

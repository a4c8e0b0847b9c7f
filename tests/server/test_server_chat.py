"""Chat and text completions through the official openai client against a live `lily serve`: streaming and
not, stop strings, logprobs, thinking on/off, json_schema, usage/timings, prefix reuse across turns."""
from __future__ import annotations

import json

import pytest
from _http import httpx
from _live import NO_THINK

USER = [{"role": "user", "content": "Hello there, how are you today?"}]


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    h = server.health()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["max_context"] == 4096


def test_non_streaming_chat_usage_and_timings(client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0, extra_body=NO_THINK)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    u = r.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    t = r.model_extra["timings"]
    assert t["prompt_n"] + t["cache_n"] == u.prompt_tokens and t["predicted_n"] == u.completion_tokens
    assert t["ttft_ms"] > 0 and t["prompt_per_second"] >= 0


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", messages=USER, max_tokens=16, temperature=0.8, seed=11, extra_body=NO_THINK)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_strings(client):
    base = dict(model="tiny", messages=USER, max_tokens=40, temperature=0, extra_body=NO_THINK)
    full = client.chat.completions.create(**base).choices[0].message.content
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    r = client.chat.completions.create(stop=[stop, "never-appears"], **base)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stop=stop, stream=True, **base) if c.choices)
    assert streamed == full[:full.index(stop)]


def test_logprobs(client, tokenizer):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NO_THINK)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens
    for it in items:
        assert it.logprob <= 0 and len(it.top_logprobs) == 3
        assert it.top_logprobs[0].token == it.token  # greedy: the best raw logit is the one chosen
        assert it.top_logprobs[0].logprob == pytest.approx(it.logprob, abs=1e-5)
        assert it.top_logprobs[0].logprob >= it.top_logprobs[1].logprob >= it.top_logprobs[2].logprob
        assert bytes(it.bytes).decode("utf-8", "replace") == it.token
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True, extra_body=NO_THINK))
    streamed = [it for c in chunks if c.choices and c.choices[0].logprobs for it in c.choices[0].logprobs.content]
    assert [it.token for it in streamed] == [it.token for it in items]


def test_thinking_on_and_off(client):
    on = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    m = on.choices[0].message
    assert m.model_extra["reasoning_content"] == m.model_extra["reasoning"] and m.model_extra["reasoning_content"]
    assert not m.content  # the tiny model never closes </think> in 8 tokens: all of it is reasoning
    assert on.usage.completion_tokens_details.reasoning_tokens == 8
    for extra in (NO_THINK, {"reasoning_effort": "none"}):
        off = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0, extra_body=extra)
        assert off.choices[0].message.content and "reasoning_content" not in off.choices[0].message.model_extra
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
        assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty <think></think> block
    stream = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in stream if c.choices)
    assert reasoning == m.model_extra["reasoning_content"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}


def test_json_schema_response_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2):
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, temperature=1.0, seed=seed,
                                           response_format=fmt, extra_body=NO_THINK)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # any JSON object: the noise model may ramble inside a key, so only a finished reply is parsed
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"}, extra_body=NO_THINK)
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_second_turn_reuses_first_turn(client):
    """Turn 2 reports cached_tokens >= turn 1's prompt + reply: the reply's exact tokens and its final
    <|im_end|> are in the state (preserve_thinking keeps the history identical to what was generated)."""
    kw = {"chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    msgs = [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Describe someone."}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=120, temperature=0.7, seed=5,
                                        response_format=fmt, extra_body=kw)
    assert r1.choices[0].finish_reason == "stop"
    msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "Another one."}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs2, max_tokens=4, temperature=0, extra_body=kw)
    first = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens >= first
    assert r2.model_extra["timings"]["prompt_n"] == r2.usage.prompt_tokens - r2.usage.prompt_tokens_details.cached_tokens
    # the same conversation again: everything but the generation is cached
    r3 = client.chat.completions.create(model="tiny", messages=msgs2, max_tokens=4, temperature=0, extra_body=kw)
    assert r3.usage.prompt_tokens_details.cached_tokens >= first
    # another conversation in between, then back: the snapshots bring it back
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Unrelated"}], max_tokens=3)
    r4 = client.chat.completions.create(model="tiny", messages=msgs2, max_tokens=4, temperature=0, extra_body=kw)
    assert r4.usage.prompt_tokens_details.cached_tokens >= first


def test_text_completions(client):
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                  logprobs=2, echo=True)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text.startswith("The quick brown fox")
    # echo with logprobs (legacy OpenAI): the prompt's tokens (the first has no logprob) and then the completion's
    lp = c.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # top alternatives keyed by text: two ids with the same text (partial UTF-8) share one key
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:]) and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == c.text and lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text[len("The quick brown fox"):]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # a longer prompt that extends the last one reuses it
    r2 = client.completions.create(model="tiny", prompt="The quick brown fox" + c.text[19:] + " and more",
                                   max_tokens=2, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_progress_and_keepalive_comments(server, tokenizer):
    """A long prefill sends `: prefill done/total` SSE comments (the server was started with
    --progress-tokens 64); the openai client ignores them."""
    long = [{"role": "user", "content": "hello world, " * 120}]
    body = {"model": "tiny", "messages": long, "max_tokens": 2, "stream": True, **NO_THINK}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {server.api_key}"}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    progress = [ln for ln in lines if ln.startswith(": prefill ")]
    assert len(progress) >= 3
    done, total = map(int, progress[-1].split()[2].split("/"))
    assert done == total and total > 192
    assert lines[-1] == "data: [DONE]"

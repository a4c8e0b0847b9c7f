"""Ollama's API on `lily serve` (issue 38 item 12), through the official `ollama` Python client: chat and
generate, streamed (NDJSON) and not, list, show, options mapped to lily's sampling, errors in Ollama's shape."""
from __future__ import annotations

import json

import pytest
from _http import httpx

ollama = pytest.importorskip("ollama")

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=60)


def test_list_show_and_version(server, client):
    models = client.list().models
    assert [m.model for m in models] == ["tiny:latest"]
    assert models[0].details.family == "qwen3moe" and models[0].size > 0 and models[0].digest
    shown = client.show("tiny")
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert shown.modelinfo["qwen3moe.context_length"] == 4096 and shown.template
    assert client.show("tiny:latest").details.family == "qwen3moe"
    v = httpx.get(server.url + "/api/version", timeout=5)  # open without the key, as health probes need
    assert v.status_code == 200 and v.json()["version"]
    assert httpx.get(server.url + "/", timeout=5).text.startswith("Ollama is running")


def test_chat_whole_and_streamed(client):
    opts = {"temperature": 0, "num_predict": 6, "seed": 3}
    whole = client.chat(model="tiny", messages=MSGS, options=opts, think=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert 1 <= whole.eval_count <= 6 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    parts = list(client.chat(model="tiny", messages=MSGS, options=opts, think=False, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == whole.eval_count
    assert "".join(p.message.content or "" for p in parts) == whole.message.content  # greedy: the same text


def test_options_map_to_lily_sampling(server, client):
    """num_predict is max_tokens, temperature 0 is greedy, repeat_penalty reaches the sampler."""
    bias_free = {"temperature": 0, "num_predict": 12}
    a = client.chat(model="tiny", messages=MSGS, options=bias_free, think=False)
    b = client.chat(model="tiny", messages=MSGS, options={**bias_free, "repeat_penalty": 3.0}, think=False)
    c = client.chat(model="tiny", messages=MSGS, options={**bias_free, "num_ctx": 8192, "num_thread": 2}, think=False)
    assert a.message.content == c.message.content  # load-time options change nothing
    assert a.eval_count <= 12 and (a.message.content != b.message.content or a.eval_count != b.eval_count)


def test_thinking_and_format(client):
    thinking = client.chat(model="tiny", messages=MSGS, think=True, options={"num_predict": 8, "temperature": 0})
    plain = client.chat(model="tiny", messages=MSGS, think=False, options={"num_predict": 8, "temperature": 0})
    assert thinking.message.thinking and not plain.message.thinking
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 10}}}
    r = client.chat(model="tiny", messages=MSGS, format=schema, think=False,
                    options={"num_predict": 120, "temperature": 1.0, "seed": 1})
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content)["city"], str), r.message.content


def test_generate_whole_streamed_raw_and_context(client):
    r = client.generate(model="tiny", prompt="Once upon a time", options={"num_predict": 5, "temperature": 0},
                        think=False)
    assert r.done and isinstance(r.response, str) and 1 <= r.eval_count <= 5 and r.context
    parts = list(client.generate(model="tiny", prompt="Once upon a time", stream=True, think=False,
                                 options={"num_predict": 5, "temperature": 0}))
    assert parts[-1].done and "".join(p.response for p in parts) == r.response
    raw = client.generate(model="tiny", prompt="The engine", raw=True, options={"num_predict": 4, "temperature": 0})
    assert raw.done and raw.eval_count <= 4
    more = client.generate(model="tiny", prompt=" and then", raw=True, context=raw.context,
                           options={"num_predict": 3, "temperature": 0})
    assert more.context[:len(raw.context)] == raw.context
    assert more.prompt_eval_count < len(more.context) - more.eval_count  # the earlier context was reused
    assert client.generate(model="tiny").done_reason == "load"  # no prompt: Ollama's "load the model"


def test_errors_in_ollamas_shape(server, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=MSGS)
    assert e.value.status_code == 404 and "'nope' not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=MSGS, options={"temprature": 0.5})
    assert e.value.status_code == 400 and "'temprature'" in e.value.error and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=MSGS, options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=[{"role": "user"}])
    assert e.value.status_code == 400 and "content" in e.value.error
    r = httpx.post(server.url + "/api/chat", content=b"{not json", headers=server.headers())
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.get(server.url + "/api/tags")  # the API key applies to /api/ as to /v1/
    assert r.status_code == 401 and set(r.json()) == {"error"}

"""Bad input keeps the connection usable (4xx OpenAI errors on one keep-alive connection), truncated tool
calls say so, /tokenize and /detokenize, /metrics as Prometheus text, prompt logprobs against Model.logits,
suffix, the typed OpenAPI schema."""
from __future__ import annotations

import http.client
import json
import math
import re

import numpy as np
import pytest
from _http import httpx
from _live import NO_THINK, backend

from test_server_tools import TOOLS

MSG = [{"role": "user", "content": "Hello"}]


def _post(conn: http.client.HTTPConnection, path: str, body: bytes, key: str) -> tuple[int, dict, dict]:
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())


def test_bad_input_gets_400_and_the_connection_stays_usable(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    ok = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 2, **NO_THINK}).encode()
    status, _, body = _post(conn, "/v1/chat/completions", ok, server.api_key)
    assert status == 200
    sock = conn.sock
    bad = {
        # a lone surrogate, as JSON allows it to be written
        "surrogate": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "surrogate_in_tool": json.dumps({"model": "tiny", "messages": MSG, "tools": [
            {"type": "function", "function": {"name": "f", "description": "x\\ud800"}}]}).encode().replace(
            b"x\\\\ud800", b"x\\ud800"),
        "tool_without_name": json.dumps({"model": "tiny", "messages": MSG, "tools": [
            {"type": "function", "function": {"parameters": {"type": "object"}}}]}).encode(),
        "tool_with_empty_name": json.dumps({"model": "tiny", "messages": MSG, "tools": [
            {"type": "function", "function": {"name": ""}}]}).encode(),
        "user_without_content": json.dumps({"model": "tiny", "messages": [{"role": "user"}]}).encode(),
        "system_null_content": json.dumps({"model": "tiny", "messages": [{"role": "system", "content": None},
                                                                         *MSG]}).encode(),
        "assistant_empty": json.dumps({"model": "tiny", "messages": [*MSG, {"role": "assistant"}, *MSG]}).encode(),
        "tool_without_call_id": json.dumps({"model": "tiny", "messages": [*MSG, {"role": "tool",
                                                                                 "content": "1"}]}).encode(),
    }
    for name, raw in bad.items():
        status, headers, body = _post(conn, "/v1/chat/completions", raw, server.api_key)
        assert status == 400, (name, body)
        assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"], name
        assert headers.get("connection", "").lower() != "close", name
    status, _, body = _post(conn, "/v1/completions", b'{"model": "tiny", "prompt": "\\udfff", "max_tokens": 1}',
                            server.api_key)
    assert status == 400 and body["error"]["code"] == "invalid_unicode" and body["error"]["param"] == "prompt"
    status, _, body = _post(conn, "/v1/chat/completions", ok, server.api_key)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert conn.sock is sock, "the keep-alive connection was closed and reopened"
    conn.close()


def test_error_messages_name_the_problem(server):
    h = {"Authorization": f"Bearer {server.api_key}"}
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json={"model": "tiny", "messages": MSG, "tools": [
        {"type": "function", "function": {"description": "no name"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.name"
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json={"model": "tiny", "messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"


@pytest.mark.parametrize("stream", [False, True])
def test_truncated_tool_call_is_not_returned_as_complete(client, stream):
    """Forced call cut off by max_tokens: finish_reason 'length', and arguments are the partial JSON text
    (not parseable), never a closed object with parameters silently missing."""
    req = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=14,
               temperature=0.7, seed=3, extra_body=NO_THINK)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **req))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert deltas and deltas[0].function.name == "get_weather"
        arguments = "".join(d.function.arguments or "" for d in deltas)
    else:
        r = client.chat.completions.create(**req)
        finish = [r.choices[0].finish_reason]
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        arguments = calls[0].function.arguments
    assert finish == ["length"]
    assert arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(arguments)


def test_tokenize_and_detokenize(server, tokenizer):
    h = {"Authorization": f"Bearer {server.api_key}"}
    text = "Tokenize me, please."
    r = httpx.post(server.url + "/tokenize", headers=h, json={"model": "tiny", "prompt": text})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096
    r = httpx.post(server.url + "/detokenize", headers=h, json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == text
    r = httpx.post(server.url + "/tokenize", headers=h, json={"messages": MSG, **NO_THINK})
    assert r.status_code == 200 and tokenizer.decode(r.json()["tokens"]).startswith("<|im_start|>user\nHello")
    assert httpx.post(server.url + "/detokenize", headers=h, json={"tokens": [10 ** 9]}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401  # the key is needed


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def _parse_prometheus(text: str) -> dict[str, dict]:
    """A strict reader of the text exposition format: every sample belongs to a family declared by # TYPE
    before it; values are floats; histogram buckets are cumulative and end with +Inf == _count."""
    families: dict[str, dict] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            families[name] = {"type": kind, "samples": []}
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        base = re.sub(r"_(bucket|sum|count)$", "", name) if name not in families else name
        assert base in families, f"{name} has no # TYPE line before it"
        families[base]["samples"].append((name, labels, value))
    for name, fam in families.items():
        if fam["type"] == "histogram":
            buckets = [(lab, v) for n, lab, v in fam["samples"] if n == name + "_bucket"]
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and buckets[-1][0] == '{le="+Inf"}', name
            (count,) = [v for n, _, v in fam["samples"] if n == name + "_count"]
            assert count == counts[-1], name
    return families


def _value(fams: dict, name: str) -> float:
    return sum(v for n, _, v in fams[name]["samples"] if n == name)


def test_metrics_is_prometheus_text(server, client):
    h = {"Authorization": f"Bearer {server.api_key}"}
    before = _parse_prometheus(httpx.get(server.url + "/metrics", headers=h).text)
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, extra_body=NO_THINK)
    resp = httpx.get(server.url + "/metrics", headers=h)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    after = _parse_prometheus(resp.text)
    assert _value(after, "lily_generation_tokens_total") - _value(before, "lily_generation_tokens_total") == \
        r.usage.completion_tokens
    assert _value(after, "lily_prompt_tokens_total") - _value(before, "lily_prompt_tokens_total") == \
        r.usage.prompt_tokens
    ttft = lambda f: [v for n, _, v in f["lily_time_to_first_token_seconds"]["samples"] if n.endswith("_count")][0]
    assert ttft(after) == ttft(before) + 1
    for name in ("lily_requests_queued", "lily_requests_running", "lily_prefix_cache_hits_total",
                 "lily_decode_seconds", "lily_requests_total"):
        assert name in after, name
    ok = [v for n, lab, v in after["lily_requests_total"]["samples"]
          if 'endpoint="/v1/chat/completions"' in lab and 'status="200"' in lab]
    assert ok and ok[0] >= 1


def test_prompt_logprobs_match_model_logits(server, tiny_ckpt, tokenizer):
    import lily
    model = lily.load(tiny_ckpt, backend=backend(), max_context=4096, threads=1)
    ids = tokenizer.encode("Scoring a prompt token by token, as lm-evaluation-harness does.")
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                   json={"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3}, timeout=60)
    body = r.json()
    assert r.status_code == 200, body
    lp = body["choices"][0]["logprobs"]
    assert body["usage"]["completion_tokens"] == 0 and len(lp["token_logprobs"]) == len(ids)
    logits = model.logits(ids).astype(np.float64)
    ref = logits - (logits.max(1, keepdims=True) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1,
                                                                                                  keepdims=True)))
    assert lp["token_logprobs"][0] is None
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    assert np.allclose(lp["token_logprobs"][1:], want, atol=1e-4, rtol=0)
    for i in range(1, len(ids)):  # the best three alternatives, by value
        best = sorted(ref[i - 1])[-3:]
        got = sorted(lp["top_logprobs"][i].values())
        assert len(got) <= 3 and all(any(math.isclose(g, b, abs_tol=1e-4) for b in best) for g in got)
    assert body["choices"][0]["text"] == tokenizer.decode(ids)


def test_suffix_without_fim_template_is_refused(client):
    import openai
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle") as e:
        client.completions.create(model="tiny", prompt="def f(", suffix="    return x", max_tokens=4)
    assert e.value.param == "suffix"


def test_openapi_has_typed_request_bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "properties" in schema, path
    assert "messages" in spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]

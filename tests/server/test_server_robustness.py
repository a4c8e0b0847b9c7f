"""The server under misuse: concurrent clients (queued, all answered), a client that disconnects
mid-stream (its request is cancelled within one decode step), bad requests (OpenAI-style 4xx errors, the
server keeps serving), API keys."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from _http import httpx
from _live import NO_THINK

MSG = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def slow_server(tiny_ckpt, tmp_path_factory):
    """A server whose decode steps take 20 ms (LILY_TEST_STEP_DELAY, a test hook read from the environment
    only): the tiny model would otherwise finish a long generation before a client can hang up. No parking
    (--park-gib 0): the second request queues behind the first."""
    from _live import LiveServer
    srv = LiveServer(tiny_ckpt, tmp_path_factory.mktemp("slow") / "serve.log", "--keepalive", "0.2", "--parallel", "1",
                     "--park-gib", "0", env={"LILY_TEST_STEP_DELAY": "0.02"})
    yield srv
    srv.stop()


def test_twenty_concurrent_clients_are_all_answered(server, client):
    def ask(i: int):
        msgs = [{"role": "user", "content": f"Client {i} says hello."}]
        if i % 2:
            chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                                         stream=True, extra_body=NO_THINK))
            return "stream", sum(1 for c in chunks if c.choices and c.choices[0].finish_reason)
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body=NO_THINK)
        return "whole", r.usage.completion_tokens

    before = server.health()["stats"]["completed"]
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(ask, range(20)))
    assert len(results) == 20
    assert all(n == 1 for kind, n in results if kind == "stream")
    assert all(1 <= n <= 6 for kind, n in results if kind == "whole")
    assert server.health()["stats"]["completed"] - before == 20


def test_disconnect_mid_stream_frees_the_engine(slow_server):
    """A client reads a few tokens of a long generation and hangs up: the worker stops after at most the
    decode step in flight (last_cancel_steps <= 1) and the queued request runs at once."""
    server = slow_server
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3800, "temperature": 1.0, "stream": True,
            "logit_bias": {str(i): -100 for i in (503, 504, 505)}, **NO_THINK}  # no end-of-turn tokens
    headers = {"Authorization": f"Bearer {server.api_key}"}
    before = server.health()["stats"]["cancelled"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as resp:
        lines, got = resp.iter_lines(), 0  # keep the iterator: dropping it closes the connection
        while got < 5:
            got += next(lines).startswith("data: {")
        # a second client queues behind the running generation
        result = {}

        def second():
            t0 = time.perf_counter()
            r = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=30,
                           json={"model": "tiny", "messages": MSG, "max_tokens": 3, **NO_THINK})
            result.update(status=r.status_code, seconds=time.perf_counter() - t0, body=r.json())

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.2)
        assert server.health()["busy"]
    # leaving the `with` closes the connection
    t.join(30)
    assert result["status"] == 200
    h = server.health()
    assert h["stats"]["cancelled"] == before + 1
    assert h["stats"]["last_cancel_steps"] is not None and h["stats"]["last_cancel_steps"] <= 1
    assert not h["busy"] and h["queued"] == 0
    # the long generation (3800 tokens, 76 s) was not run to its end before the second request was served
    assert result["seconds"] < 5


def test_disconnect_of_a_non_streaming_request(slow_server):
    server = slow_server
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3800, "temperature": 1.0,
            "logit_bias": {str(i): -100 for i in (503, 504, 505)}, **NO_THINK}
    before = server.health()["stats"]["cancelled"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3,
                   headers={"Authorization": f"Bearer {server.api_key}"})
    for _ in range(100):
        h = server.health()
        if not h["busy"]:
            break
        time.sleep(0.05)
    assert not h["busy"] and h["stats"]["cancelled"] == before + 1


def test_queued_stream_gets_keepalive_comments(slow_server):
    """A stream waiting behind another request hears `: queued, 1 request(s) ahead` and `: keep-alive`
    comments (every --keepalive seconds) until its turn comes."""
    server = slow_server
    headers = {"Authorization": f"Bearer {server.api_key}"}
    first = threading.Thread(target=lambda: httpx.post(
        server.url + "/v1/chat/completions", headers=headers, timeout=30,
        json={"model": "tiny", "messages": MSG, "max_tokens": 40, "logit_bias": {"505": -100, "503": -100},
              **NO_THINK}))
    first.start()
    time.sleep(0.3)
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2, "stream": True, **NO_THINK}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    first.join(30)
    assert lines[0] == ": queued, 1 request(s) ahead"
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"


def _error(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    headers = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers=headers)
    assert r.status_code == 400 and "not valid JSON" in _error(r)["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny"}, headers=headers)
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MSG, max_tokens=2)
    assert e.value.code == "model_not_found" and "'tiny'" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=-5)
    assert e.value.param == "max_tokens" and "max_tokens=-5" in e.value.message and ">= 1" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 5000}],
                                       max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "4096" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, extra_body=NO_THINK, top_p=3.0)
    assert "top_p" in e.value.message
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="may not set tools"):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    r = httpx.get(server.url + "/v1/nothing-here", headers=headers)
    assert r.status_code == 404 and _error(r)["message"]
    # still serving
    ok = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, extra_body=NO_THINK)
    assert ok.choices[0].message.content is not None


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # health stays open for probes

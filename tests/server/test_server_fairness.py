"""Fair serving against a live `lily serve`: interleaved decode steps (a short request does not wait for a
long one), the queue limit (503 + Retry-After), a 4 MB prompt that stalls nobody, the body size limit,
limits shown in /health.

Decode steps are slowed to 20 ms each with LILY_TEST_STEP_DELAY (a test hook read from the environment
only), so that "a long request" is long on the tiny model: 2000 tokens take 40 s alone."""
from __future__ import annotations

import json
import threading
import time

import pytest
from _http import httpx
from _live import NO_THINK, LiveServer

MSG = [{"role": "user", "content": "Tell me a long story."}]
NO_END = {str(i): -100 for i in (503, 504, 505)}  # the tiny model's end-of-turn tokens never come


@pytest.fixture(scope="module")
def fair_server(tiny_ckpt, tmp_path_factory):
    srv = LiveServer(tiny_ckpt, tmp_path_factory.mktemp("fair") / "serve.log", "--keepalive", "0.2",
                     "--parallel", "4", "--cors-origins", "http://localhost:5173",
                     env={"LILY_TEST_STEP_DELAY": "0.02"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tight_server(tiny_ckpt, tmp_path_factory):
    srv = LiveServer(tiny_ckpt, tmp_path_factory.mktemp("tight") / "serve.log", "--keepalive", "0.2",
                     "--parallel", "1", "--max-queue", "1", "--max-tokens", "50", "--park-gib", "0",
                     env={"LILY_TEST_STEP_DELAY": "0.02"})
    yield srv
    srv.stop()


def _headers(srv) -> dict:
    return {"Authorization": f"Bearer {srv.api_key}"}


class Stream(threading.Thread):
    """A streaming chat request in a thread, recording when each content chunk arrived."""

    def __init__(self, srv, max_tokens: int, stop_after: int | None = None, **extra):
        super().__init__(daemon=True)
        self.srv, self.stop_after = srv, stop_after
        self.body = {"model": "tiny", "messages": MSG, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1,
                     "stream": True, "logit_bias": NO_END, **NO_THINK, **extra}
        self.sent = self.first = None
        self.times: list[float] = []
        self.lines: list[str] = []
        self.status = None

    def run(self) -> None:
        self.sent = time.perf_counter()
        with httpx.stream("POST", self.srv.url + "/v1/chat/completions", json=self.body, headers=_headers(self.srv),
                          timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line:
                    continue
                self.lines.append(line)
                if line.startswith("data: {") and '"content":' in line and '"content":""' not in line.replace(" ", ""):
                    self.times.append(time.perf_counter())
                    if self.first is None:
                        self.first = self.times[-1]
                    if self.stop_after is not None and len(self.times) >= self.stop_after:
                        return  # hang up: the server cancels the request


def test_short_request_does_not_wait_for_a_long_one(fair_server):
    long = Stream(fair_server, max_tokens=2000, stop_after=150)
    long.start()
    time.sleep(0.3)
    short = Stream(fair_server, max_tokens=3)
    short.start()
    short.join(30)
    assert short.status == 200 and short.first is not None
    assert short.first - short.sent < 1.0, f"the short request's first token came after {short.first - short.sent:.2f} s"
    assert short.lines[-1] == "data: [DONE]"
    assert long.is_alive(), "the long request should still be running when the short one is done"
    long.join(60)


def test_huge_prompt_stalls_no_other_stream(fair_server):
    """A 4 MB message is refused from its byte length alone (it cannot fit 4096 tokens), without tokenizing
    it, while another stream keeps its pace; a body over --max-body-mb (4 MiB) is refused with 413."""
    other = Stream(fair_server, max_tokens=80)
    other.start()
    while other.first is None and other.is_alive():
        time.sleep(0.01)
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 800_000}], "max_tokens": 4}
    t0 = time.perf_counter()
    r = httpx.post(fair_server.url + "/v1/chat/completions", json=huge, headers=_headers(fair_server), timeout=30)
    refused_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    health = httpx.get(fair_server.url + "/health", timeout=5)
    health_s = time.perf_counter() - t0
    other.join(60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert refused_s < 1.0 and health_s < 0.5 and health.status_code == 200
    gaps = [b - a for a, b in zip(other.times, other.times[1:])]
    assert other.status == 200 and len(other.times) > 10 and max(gaps) < 0.5, f"largest gap {max(gaps):.2f} s"
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}'
    r = httpx.post(fair_server.url + "/v1/chat/completions", content=big, timeout=30,
                   headers={**_headers(fair_server), "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert fair_server.health()["limits"]["max_body_bytes"] == 4 << 20


def test_full_queue_gets_503_with_retry_after(tight_server):
    """--parallel 1 --max-queue 1: one running, one waiting (told its place), the third is refused."""
    srv = tight_server
    running = Stream(srv, max_tokens=2000, stop_after=40)
    running.start()
    while running.first is None and running.is_alive():
        time.sleep(0.01)
    waiting = Stream(srv, max_tokens=3)
    waiting.start()
    time.sleep(0.3)
    h = srv.health()
    assert h["running"] == 1 and h["queued"] == 1
    r = httpx.post(srv.url + "/v1/chat/completions", headers=_headers(srv), timeout=10,
                   json={"model": "tiny", "messages": MSG, "max_tokens": 3, **NO_THINK})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    running.join(60)
    waiting.join(60)
    assert waiting.lines[0] == ": queued, 1 request(s) ahead" and waiting.lines[-1] == "data: [DONE]"
    assert srv.health()["stats"]["rejected"] >= 1


def test_max_tokens_cap_and_limits_in_health(tight_server):
    """--max-tokens 50: a request without max_tokens (or asking more) stops at 50 tokens, finish 'length'."""
    srv = tight_server
    for extra in ({}, {"max_tokens": 5000}):
        r = httpx.post(srv.url + "/v1/chat/completions", headers=_headers(srv), timeout=60,
                       json={"model": "tiny", "messages": MSG, "logit_bias": NO_END, **NO_THINK, **extra})
        body = r.json()
        assert r.status_code == 200, body
        assert body["usage"]["completion_tokens"] == 50 and body["choices"][0]["finish_reason"] == "length"
    limits = srv.health()["limits"]
    assert limits["max_tokens"] == 50 and limits["parallel"] == 1 and limits["max_queue"] == 1
    assert limits["request_timeout_s"] == 600 and limits["max_context"] == 4096


def test_serve_help_lists_the_limits():
    from lily.cli import build_parser
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--max-tokens", "--parallel", "--max-queue", "--request-timeout", "--max-body-mb",
                 "--cors-origins", "--prefill-slice"):
        assert flag in text, flag


def test_cors_preflight(fair_server, server):
    origin = "http://localhost:5173"
    pre = {"Origin": origin, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(fair_server.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(fair_server.url + "/v1/models", headers={"Origin": origin, **_headers(fair_server)})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    # another origin: no CORS grant (server/cors.py; test_server_lifecycle.py has the defaults)
    r = httpx.options(fair_server.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_queue_position_json_errors_are_parseable(fair_server):
    """Every error body of the limits is an OpenAI error object."""
    r = httpx.post(fair_server.url + "/v1/chat/completions", content=b"\xff\xfe", headers=_headers(fair_server))
    assert r.status_code == 400 and set(json.loads(r.text)["error"]) >= {"message", "type", "param", "code"}

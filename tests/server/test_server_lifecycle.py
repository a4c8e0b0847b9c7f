"""Issue 38 against a live `lily serve`: a SIGTERM ends every job before the server exits, a request timeout
is one run with the official client, Retry-After follows the measured drain rate, a 413 reaches async
clients, and browsers on this machine may call the server while other web pages may not.

Decode steps are slowed with LILY_TEST_STEP_DELAY (a test hook read from the environment only), so that a
long request is long on the tiny model."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import openai
import pytest
from _http import httpx
from _live import NO_THINK, LiveServer

MSG = [{"role": "user", "content": "Tell me a long story."}]
NO_END = {str(i): -100 for i in (503, 504, 505)}  # the tiny model's end-of-turn tokens never come
SLOW = {"LILY_TEST_STEP_DELAY": "0.02"}


def _body(max_tokens: int, stream: bool) -> dict:
    return {"model": "tiny", "messages": MSG, "max_tokens": max_tokens, "temperature": 1.0, "stream": stream,
            "logit_bias": NO_END, **NO_THINK}


class Call(threading.Thread):
    """A chat request in a thread: its status, and its SSE lines or its JSON body."""

    def __init__(self, srv: LiveServer, max_tokens: int, stream: bool):
        super().__init__(daemon=True)
        self.srv, self.body = srv, _body(max_tokens, stream)
        self.status, self.lines, self.json, self.tokens = None, [], None, 0
        self.headers, self.done_at = {}, 0.0

    def run(self) -> None:
        url = self.srv.url + "/v1/chat/completions"
        if not self.body["stream"]:
            r = httpx.post(url, json=self.body, headers=self.srv.headers(), timeout=60)
            self.status, self.json, self.headers = r.status_code, r.json(), r.headers
            self.done_at = time.perf_counter()
            return
        with httpx.stream("POST", url, json=self.body, headers=self.srv.headers(), timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                    self.tokens += line.startswith("data: {") and '"content":' in line

    def events(self) -> list[dict]:
        return [json.loads(ln[6:]) for ln in self.lines if ln.startswith("data: {")]


def _wait(cond, timeout: float = 20.0) -> None:
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.02)


def test_sigterm_ends_every_job_then_exits_with_the_sessions_saved(tiny_ckpt, tmp_path):
    sessions = tmp_path / "sessions"
    srv = LiveServer(tiny_ckpt, tmp_path / "serve.log", "--session-dir", str(sessions), "--parallel", "3",
                     "--park-gib", "0", "--shutdown-grace", "5", env=SLOW)
    try:
        running = [Call(srv, 3000, True), Call(srv, 3000, True), Call(srv, 3000, False)]
        for c in running:
            c.start()
        _wait(lambda: srv.health()["running"] == 3 and all(c.tokens >= 3 for c in running[:2]))
        queued = [Call(srv, 3000, True), Call(srv, 3000, True), Call(srv, 3000, False)]
        for c in queued:
            c.start()
        _wait(lambda: srv.health()["queued"] == 3)
        # a request whose body is still coming when the signal arrives
        late = socket.create_connection(("127.0.0.1", srv.port))
        body = json.dumps(_body(4, False)).encode()
        late.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {srv.api_key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        time.sleep(0.2)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late.sendall(body[10:])
        late.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            part = late.recv(65536)
            if not part:
                break
            answer += part
        srv.proc.wait(timeout=15)
        exit_s = time.time() - t0
        for c in running + queued:
            c.join(10)
    finally:
        srv.stop()
    assert exit_s < 5.5, f"exited {exit_s:.1f} s after SIGTERM (grace 5 s)"
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    # the SDKs would retry a 503 into the closed port: told not to, they show the user this message instead
    assert b"\r\nx-should-retry: false\r\n" in answer.split(b"\r\n\r\n", 1)[0].lower() + b"\r\n", answer[:400]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "server_shutting_down"
    for c in running[:2]:  # text so far, a finish_reason, an OpenAI error event, [DONE]
        ev = c.events()
        finish = [e for e in ev if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert c.tokens >= 3 and len(finish) == 1, c.lines[-4:]
        assert finish[0]["choices"][0]["finish_reason"] == "length"
        assert finish[0]["choices"][0]["stop_reason"] == "server_shutdown"
        assert ev[-1]["error"]["code"] == "server_shutting_down" and c.lines[-1] == "data: [DONE]"
    for c in queued[:2]:  # never started: the error event and [DONE]
        ev = c.events()
        assert ev[-1]["error"]["code"] == "server_shutting_down" and c.lines[-1] == "data: [DONE]", c.lines
    for c in (running[2], queued[2]):  # not streamed: a 503 in the OpenAI shape
        assert c.status == 503 and c.json["error"]["code"] == "server_shutting_down", c.json
    assert list(sessions.glob("*.safetensors")), "the sessions were not saved"


def test_a_request_timeout_is_one_run_with_the_official_client(tiny_ckpt, tmp_path):
    """The openai SDK retries a 408 twice: the answer is a final one, with what was generated."""
    srv = LiveServer(tiny_ckpt, tmp_path / "serve.log", "--request-timeout", "1", env=SLOW)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, timeout=30)  # default retries
        t0 = time.perf_counter()
        r = client.chat.completions.create(**{k: v for k, v in _body(3000, False).items()
                                              if k not in ("logit_bias", "chat_template_kwargs")},
                                           logit_bias=NO_END, extra_body=NO_THINK)
        took = time.perf_counter() - t0
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.model_extra["stop_reason"] == "request_timeout"
        assert r.usage.completion_tokens > 5 and choice.message.content
        stream = list(client.chat.completions.create(**{k: v for k, v in _body(3000, True).items()
                                                         if k not in ("logit_bias", "chat_template_kwargs")},
                                                      logit_bias=NO_END, extra_body=NO_THINK))
        assert stream[-1].choices[0].finish_reason == "length"
        assert stream[-1].choices[0].model_extra["stop_reason"] == "request_timeout"
        stats = srv.health()["stats"]
        assert took < 3 and stats["requests"] == 2 and stats["timeouts"] == 2, stats
    finally:
        srv.stop()


def test_retry_after_follows_the_measured_drain_rate(tiny_ckpt, tmp_path):
    srv = LiveServer(tiny_ckpt, tmp_path / "serve.log", "--parallel", "1", "--max-queue", "6", "--park-gib", "0",
                     env=SLOW)
    try:
        def burst(n: int) -> list[Call]:
            calls = [Call(srv, 15, False) for _ in range(n)]
            for c in calls:
                c.start()
                time.sleep(0.005)
            for c in calls:
                c.join(60)
            return calls

        burst(7)  # the server measures how fast its queue drains
        calls = burst(10)  # 1 running + 6 waiting: the others are refused
    finally:
        srv.stop()
    refused = sorted((c for c in calls if c.status == 503), key=lambda c: c.done_at)
    served = [c for c in calls if c.status == 200]
    assert refused and len(served) == 7, [c.status for c in calls]
    first = refused[0]
    assert first.json["error"]["code"] == "queue_full"
    drained = max(c.done_at for c in served) - first.done_at  # what a client told to wait would have waited
    estimate = int(first.headers["retry-after-ms"]) / 1000
    assert drained / 2 <= estimate <= drained * 2, f"Retry-After {estimate:.2f} s, the queue drained in {drained:.2f} s"
    assert 1 <= int(first.headers["retry-after"]) <= max(1.0, 2 * drained) + 1


def test_a_413_reaches_async_clients(server):
    """The body is read (and dropped) before the 413 goes out, so AsyncOpenAI and httpx.AsyncClient read the
    answer instead of a broken connection."""
    big = "x" * (5 << 20)  # over the default --max-body-mb 4

    async def go():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": big}],
                                                 max_tokens=2)
        assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"

        async def chunks():  # no Content-Length: the limit is found while reading
            for _ in range(5):
                yield b"y" * (1 << 20)
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(server.url + "/v1/chat/completions", content=chunks(), headers=server.headers())
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await h.get(server.url + "/health")  # the same client goes on
            assert r.status_code == 200

    asyncio.run(go())


def test_cors_allows_this_machine_and_refuses_other_pages(server):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "http://[::1]:5173"):
        r = httpx.options(server.url + "/v1/chat/completions", headers={**pre, "Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
    r = httpx.get(server.url + "/v1/models", headers={"Origin": "http://localhost:3000", **server.headers()})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    evil = "https://evil.example"
    for _ in range(2):
        r = httpx.options(server.url + "/v1/chat/completions", headers={**pre, "Origin": evil})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(2, False),
                       headers={"Origin": evil, **server.headers()})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cors_origin_refused"
    assert server.log().count(f"--cors-origins {evil} to allow it") == 1


def test_host_header_must_name_this_machine(server):
    """DNS rebinding: a page on another origin that points its own name at 127.0.0.1 sends `Host: attacker.example`
    (and that Origin, which then looks same-origin): refused with 403 naming --allowed-hosts, logged once; this
    machine's names pass with any port."""
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}",
                 "app.localhost:3000"):
        r = httpx.get(server.url + "/v1/models", headers={"Host": host, **server.headers()})
        assert r.status_code == 200, (host, r.status_code, r.text[:200])
    evil = f"attacker.example:{server.port}"
    for _ in range(2):
        r = httpx.post(server.url + "/v1/chat/completions", json=_body(2, False),
                       headers={"Host": evil, "Origin": f"http://{evil}", **server.headers()})
        assert r.status_code == 403, r.text[:200]
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed" and "--allowed-hosts attacker.example" in err["message"], err
    assert server.log().count("--allowed-hosts attacker.example to allow it") == 1
    assert server.health()["limits"]["allowed_hosts"] == ["localhost", "127.0.0.1", "[::1]"]


def test_allowed_hosts_default_follows_the_bind_address_and_the_flag_extends_it():
    from starlette.testclient import TestClient

    from lily.cli import _allowed_hosts
    from lily.server.cors import HostGuard
    for bind in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert _allowed_hosts(None, bind) == (), bind  # this machine's names only
    assert _allowed_hosts(None, "0.0.0.0") is None  # any: the operator chose the network
    assert _allowed_hosts("my.box, lan.example", "127.0.0.1") == ("my.box", "lan.example")

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = HostGuard(ok, allowed=("my.box",), log=lambda line: None)
    assert TestClient(guard, base_url="http://my.box:8000").get("/v1/models").status_code == 200
    r = TestClient(guard, base_url="http://other.box:8000").get("/v1/models")
    assert r.status_code == 403 and "--allowed-hosts other.box" in r.json()["error"]["message"]
    assert TestClient(HostGuard(ok, allowed=("*",)), base_url="http://other.box").get("/").status_code == 200


def test_retry_after_is_jittered_around_the_estimate():
    """Clients refused together get different Retry-After values around the estimate (±25%), so their retries do
    not arrive in one burst."""
    from lily.server.errors import retry_headers
    from lily.server.worker import QueueFull
    ms = [int(retry_headers(QueueFull("full", 4.0))["retry-after-ms"]) for _ in range(64)]
    assert 3000 <= min(ms) and max(ms) <= 5000 and len(set(ms)) > 16, sorted(ms)[:8]


def test_a_flood_at_100_requests_a_second_is_bounded_by_max_queue_and_told_when_to_retry(tiny_ckpt, tmp_path):
    """Issue 44.3 with the default settings (parking on): 300 requests at 100 per second. Requests that have not
    started never exceed --max-queue (64), the others get a 503 at once with a Retry-After that the real drain
    bears out (within 2x: the time from the first refusal until the last accepted request finished)."""
    srv = LiveServer(tiny_ckpt, tmp_path / "serve.log", env=SLOW)
    peak = {"queued": 0, "waiting": 0}
    polling = threading.Event()

    def poll() -> None:
        while not polling.is_set():
            h = srv.health()
            peak["queued"] = max(peak["queued"], h["queued"])
            time.sleep(0.02)
    try:
        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        calls = []
        t0 = time.perf_counter()
        for i in range(300):
            c = Call(srv, 4, False)
            c.start()
            calls.append(c)
            time.sleep(max(0.0, t0 + (i + 1) / 100 - time.perf_counter()))
        for c in calls:
            c.join(120)
        polling.set()
        watcher.join(5)
    finally:
        srv.stop()
    refused = sorted((c for c in calls if c.status == 503), key=lambda c: c.done_at)
    served = [c for c in calls if c.status == 200]
    assert len(refused) + len(served) == 300, sorted({c.status for c in calls}, key=str)
    assert peak["queued"] <= 64, peak
    assert refused and all(c.json["error"]["code"] == "queue_full" for c in refused)
    first = refused[0]
    drained = max(c.done_at for c in served) - first.done_at
    estimate = int(first.headers["retry-after-ms"]) / 1000
    assert drained / 2 <= estimate <= drained * 2, (estimate, drained, len(refused))

"""Issue 44.2 against a live `lily serve` with the bundled model: a 20K-token prompt-scoring request (`echo` +
`logprobs`, `max_tokens: 0`) runs one piece per decode round, so four running streams keep their pace; it stops
within 0.5 s of a hang-up, of its request timeout and of a SIGTERM, and the server then exits within its grace.

The whole 20K prompt is never scored here (that takes a minute on two cores): each scoring request is stopped a
few seconds in; the pieces' sizes at every position are checked in test_pieces_shrink_with_the_position."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

from _http import httpx
from _live import NO_THINK, LiveServer

from lily.model import BUNDLED_MODEL_DIR
from lily.tokenizer import Tokenizer

_TOK = Tokenizer(BUNDLED_MODEL_DIR / "tokenizer.json")
NO_END = {str(i): -100 for i in {_TOK.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")} - {None}}
PROMPT_TOKENS = 20_000


def _scoring_body(n: int) -> bytes:
    ids = [(i * 7919) % 3000 + 10 for i in range(n)]
    return json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).encode()


class RawPost:
    """A POST on a raw socket: hang_up() closes it mid-request; answer() reads the status line and body."""

    def __init__(self, srv: LiveServer, path: str, body: bytes):
        self.sock = socket.create_connection(("127.0.0.1", srv.port))
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {srv.api_key}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

    def hang_up(self) -> None:
        self.sock.close()

    def answer(self, timeout: float) -> tuple[int, dict]:
        self.sock.settimeout(timeout)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = self.sock.recv(1 << 20)
            if not part:
                break
            data += part
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)


class Stream(threading.Thread):
    """A streaming chat that runs until the server stops it: the arrival time of each of its tokens."""

    def __init__(self, srv: LiveServer, i: int):
        super().__init__(daemon=True)
        self.srv, self.i, self.times = srv, i, []

    def run(self) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"story {self.i}"}], "max_tokens": 20000,
                "temperature": 0.0, "stream": True, "logit_bias": NO_END, **NO_THINK}
        try:
            with httpx.stream("POST", self.srv.url + "/v1/chat/completions", json=body, headers=self.srv.headers(),
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"content":' in line:
                        self.times.append(time.perf_counter())
        except httpx.HTTPError:
            pass


def _wait(cond, timeout: float = 20.0) -> None:
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.01)


def _stopped_within(srv: LiveServer) -> float:
    """Seconds until /health shows no scoring request."""
    t0 = time.perf_counter()
    _wait(lambda: srv.health()["scoring"] == 0, 5.0)
    return time.perf_counter() - t0


def test_pieces_shrink_with_the_position():
    """Every piece of a 32K prompt costs about the same (tokens x (1 + position / 2048) stays within 2x of the
    first piece's), and the pieces cover the prompt exactly once."""
    from lily.server.scoring import PIECE, piece_rows
    start, sizes = 0, []
    while start < 32768:
        n = piece_rows(4096, start)
        cost = n * (1 + (start + n / 2) / 2048)
        assert cost <= 2 * PIECE * 1.1 and n >= 16, (start, n, cost)
        sizes.append(n)
        start += n
    assert sizes[0] == PIECE and sizes[-1] < 32 and piece_rows(248_320, 0) == (1 << 24) // 248_320


def test_a_long_scoring_request_neither_stalls_the_streams_nor_outlives_a_hang_up_a_timeout_or_sigterm(tmp_path):
    srv = LiveServer(None, tmp_path / "serve.log", "--parallel", "4", "--request-timeout", "7",
                     "--shutdown-grace", "5", max_context=24576)
    exit_s = None
    try:
        streams = [Stream(srv, i) for i in range(4)]
        for s in streams:
            s.start()
        _wait(lambda: all(len(s.times) >= 3 for s in streams))

        # 1. four streams keep their pace while the scoring request runs; a hang-up stops it
        scoring = RawPost(srv, "/v1/completions", _scoring_body(PROMPT_TOKENS))
        _wait(lambda: srv.health()["scoring"] == 1, 5.0)
        t0 = time.perf_counter()
        time.sleep(3.0)
        assert srv.health()["scoring"] == 1, "the scoring request ended early"
        scoring.hang_up()
        hang_up_s = _stopped_within(srv)
        gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:]) if a >= t0 and b <= t0 + 3.0]
        during = [sum(1 for t in s.times if t0 <= t <= t0 + 3.0) for s in streams]

        # 2. the request timeout (7 s from its arrival) ends a scoring request with a 408
        late = RawPost(srv, "/v1/completions", _scoring_body(PROMPT_TOKENS))
        t1 = time.perf_counter()
        status, body = late.answer(30)
        timeout_s = time.perf_counter() - t1

        # 3. SIGTERM during a scoring request: a 503 at once, and the server exits within its grace
        third = RawPost(srv, "/v1/completions", _scoring_body(PROMPT_TOKENS))
        _wait(lambda: srv.health()["scoring"] == 1, 5.0)
        time.sleep(1.0)
        t2 = time.perf_counter()
        srv.proc.send_signal(signal.SIGTERM)
        status3, body3 = third.answer(10)
        sigterm_s = time.perf_counter() - t2
        srv.proc.wait(timeout=15)
        exit_s = time.perf_counter() - t2
    finally:
        srv.stop()
    assert min(during) >= 10 and max(gaps) < 0.5, (max(gaps), during)
    assert hang_up_s < 0.5, hang_up_s
    assert status == 408 and body["error"]["code"] == "request_timeout" and timeout_s < 7.5, (status, body, timeout_s)
    assert status3 == 503 and body3["error"]["code"] == "server_shutting_down" and sigterm_s < 0.5, (status3, body3,
                                                                                                      sigterm_s)
    assert exit_s < 5.5, exit_s

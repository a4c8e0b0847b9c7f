"""Helpers of the server tests: a live `lily serve` subprocess on a free 127.0.0.1 port, the backend to use."""
from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from _http import httpx

API_KEY = "test-key"


def backend() -> str:
    try:
        importlib.import_module("lily._lily")
        return "cpu"
    except ImportError:
        return "reference"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m lily serve ...` in a subprocess; stop() sends SIGINT (graceful: sessions are saved).
    ckpt None: the bundled model; max_context None: the server's default."""

    def __init__(self, ckpt: Path | None, log: Path, *extra: str, api_key: str | None = API_KEY,
                 max_context: int | None = 4096, env: dict | None = None, model_name: str = "tiny"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log
        args = [sys.executable, "-m", "lily", "serve", *(["--model", str(ckpt)] if ckpt is not None else []),
                "--backend", backend(), "--port", str(self.port), "--threads", "2",
                *(["--max-context", str(max_context)] if max_context is not None else []),
                "--model-name", model_name, "--log-level", "warning", *extra]
        if api_key:
            args += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})}  # the same lily as this process
        self._log = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"lily serve did not answer /health within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5.0).json()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def rss_bytes(self) -> int:
        """The server process's resident memory (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=60.0, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def distinct_short_chat(srv: LiveServer, client, i: int) -> int:
    """A chat request of its own conversation (number i), 4 tokens, thinking off: its HTTP status (the memory
    bursts of tests/server/test_server_memory.py and benchmarks/server_memory_bursts.py)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"request number {i} please " * 20}],
            "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}}
    return client.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers()).status_code


def rss_after_bursts(srv: LiveServer, bursts: int, size: int, report=None) -> tuple[float, list[tuple[list[int], float]]]:
    """The server's RSS (GiB) after 60 sequential distinct_short_chat requests, then (the burst's HTTP statuses, RSS)
    after each of `bursts` bursts of `size` concurrent ones, each read 1 s after the burst (the memory test and
    benchmarks/server_memory_bursts.py). report(burst number, statuses, RSS) is called after each."""
    client = httpx.Client(timeout=300)
    assert all(distinct_short_chat(srv, client, i) == 200 for i in range(60))
    time.sleep(1.0)
    sequential, after = srv.rss_bytes() / 2**30, []
    for b in range(bursts):
        with ThreadPoolExecutor(size) as pool:
            codes = list(pool.map(lambda i: distinct_short_chat(srv, client, i),
                                  range(1000 * (b + 1), 1000 * (b + 1) + size)))
        time.sleep(1.0)
        after.append((codes, srv.rss_bytes() / 2**30))
        if report is not None:
            report(b + 1, codes, after[-1][1])
    return sequential, after

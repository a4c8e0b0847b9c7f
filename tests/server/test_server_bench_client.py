"""benchmarks/bench_cuda.py's server-row client against a live `lily serve`: its timed request goes out pre-encoded
over http.client and parses the server-sent events itself (the openai client's request building costs ~14 us per
prompt token, which the row would time as the server's), so it must read the stream as the openai client does."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _live import LiveServer

ROOT = Path(__file__).resolve().parents[2]


def serve_client_source() -> str:
    src = (ROOT / "benchmarks" / "bench_cuda.py").read_text()
    i = src.index('SERVE_CLIENT = r"""') + len('SERVE_CLIENT = r"""')
    return src[i:src.index('"""', i)]


def test_bench_serve_client_counts_the_same_tokens_as_the_openai_client(tiny_ckpt, tmp_path):
    srv = LiveServer(tiny_ckpt, tmp_path / "serve.log", api_key=None)  # the benchmark's server has no key
    try:
        prompt = [(7 * i + 3) % 200 for i in range(300)]
        short, long_ = 3, 9
        r = subprocess.run([sys.executable, "-c", serve_client_source(), srv.url + "/v1", str(short), str(long_)],
                           input=json.dumps(prompt), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        reqs = json.loads(r.stdout.strip().splitlines()[-1])
        assert len(reqs) == 4  # short, long, short, long
        # the same greedy requests through the official client: their usage blocks are the reference counts
        for n, got in zip((short, long_, short, long_), reqs):
            first, last, tokens = got
            ref = srv.client().completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
            assert tokens == ref.usage.completion_tokens
            assert 1 <= tokens <= n
            assert 0 < first <= last
    finally:
        srv.stop()

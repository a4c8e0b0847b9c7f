"""RSS of `lily serve` (bundled model, default settings but --max-queue 1000) after 60 sequential requests, then
after each of 8 bursts of 300 concurrent requests, and after idle (issue 44: <= 1.2x the sequential plateau).

    python benchmarks/server_memory_bursts.py      # prints the figures and a JSON line (results/server_memory_bursts_cpu.json)
"""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))  # the tests' live-server helper
from _http import httpx  # noqa: E402
from _live import LiveServer, distinct_short_chat  # noqa: E402

srv = LiveServer(None, Path("/tmp/server_memory_bursts.log"), "--max-queue", "1000")
try:
    client = httpx.Client(timeout=300)

    def one(i: int) -> int:
        return distinct_short_chat(srv, client, i)

    assert all(one(i) == 200 for i in range(60))
    time.sleep(1.0)
    seq = srv.rss_bytes() / 2**30
    after = []
    for b in range(8):
        with ThreadPoolExecutor(300) as pool:
            codes = list(pool.map(one, range(1000 * (b + 1), 1000 * (b + 1) + 300)))
        time.sleep(1.0)
        after.append(round(srv.rss_bytes() / 2**30, 3))
        print(f"burst {b + 1}: {codes.count(200)}/300 ok, RSS {after[-1]:.3f} GiB", flush=True)
    time.sleep(5.0)
    idle = srv.rss_bytes() / 2**30
    print(json.dumps({"sequential_gib": round(seq, 3), "after_bursts_gib": after, "idle_gib": round(idle, 3),
                      "max_over_sequential": round(max(after) / seq, 3)}))
finally:
    srv.stop()

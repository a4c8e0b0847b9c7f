"""RSS of `lily serve` (bundled model, default settings but --max-queue 1000) after 60 sequential requests, then
after each of 8 bursts of 300 concurrent requests, and after idle (issue 44: <= 1.2x the sequential plateau).

    python benchmarks/server_memory_bursts.py      # prints the figures and a JSON line (results/server_memory_bursts_cpu.json)
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))  # the tests' live-server helper
from _live import LiveServer, rss_after_bursts  # noqa: E402

srv = LiveServer(None, Path("/tmp/server_memory_bursts.log"), "--max-queue", "1000")
try:
    seq, bursts = rss_after_bursts(srv, 8, 300, report=lambda b, codes, rss: print(
        f"burst {b}: {codes.count(200)}/300 ok, RSS {rss:.3f} GiB", flush=True))
    after = [round(rss, 3) for _, rss in bursts]
    time.sleep(5.0)
    idle = srv.rss_bytes() / 2**30
    print(json.dumps({"sequential_gib": round(seq, 3), "after_bursts_gib": after, "idle_gib": round(idle, 3),
                      "max_over_sequential": round(max(after) / seq, 3)}))
finally:
    srv.stop()

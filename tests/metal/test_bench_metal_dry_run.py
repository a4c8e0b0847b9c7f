"""The Metal benchmark (benchmarks/bench_metal.py) end to end in its dry run: a tiny synthetic checkpoint on the
emulated Metal device, so the script a Mac user runs is known to work; its figures mean nothing here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lily._lily")
ROOT = Path(__file__).resolve().parents[2]


def test_bench_metal_dry_run_writes_its_json(tmp_path):
    out = tmp_path / "bench_metal_dry"
    env = {**os.environ, "CI": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_metal.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["benchmark"] == "bench_metal" and res["settings"]["backend"] == "metal"
    assert {"git_sha", "hardware", "settings", "rows"} <= set(res)
    got = {(row["engine"], row["phase"], row["tokens"]) for row in res["rows"]}
    engines = ["lily-metal"]
    try:  # the peer runs in the dry run when mlx-lm is installed (on the CPU here)
        import mlx_lm  # noqa: F401
        engines.append("mlx-lm")
    except ImportError:
        pass
    want = {(e, phase, n) for e in engines for phase in ("prefill", "decode") for n in (16, 40)}
    assert want <= got
    assert all(row["tok_s"] > 0 for row in res["rows"])

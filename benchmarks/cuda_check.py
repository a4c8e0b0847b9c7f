"""CUDA backend correctness on the GPU: the CUDA engine against the CPU engine (fp32, the executable spec) on
tiny configs plus one with the real per-head shapes, judged against a rounding envelope. Prints a pass/fail
table last and writes JSON to --json. The checks themselves are lily.testing.cuda_checks (tests/test_cuda_backend.py
runs the same ones under pytest); this script adds the bundled model's session-sampling check and the full size.

Envelope (docs/numerics.md): the NumPy reference run with bf16 rounding where a bf16 engine rounds (every matrix
product's activation input and its dequantized weights) against the CPU engine in fp32. The CUDA engine passes
when its agreement with the CPU engine is no worse than that envelope plus ENVELOPE_SLACK_* (lily.testing.tolerances).

Checks per config: teacher-forced logits over T positions (top-1, perplexity ratio, rel RMS); per-sub-block
residuals (forward_trace); decode steps == one prefill; chunked == unchunked; logits last == all[-1];
snapshot/restore and export/import round trips; the exported KV/DeltaNet state against the CPU engine's; the
device sampler against its NumPy twin.

    PYTHONPATH=src python3 benchmarks/cuda_check.py --tokens 256 --json /tmp/cuda_check.json
    PYTHONPATH=src python3 benchmarks/cuda_check.py --configs none --full /tmp/full35b   # full size only
Full size (--full DIR, benchmarks/full_checkpoint.py's checkpoint): see benchmarks/cuda_check_full.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("LILY_DEBUG", "1")  # NaN-poisoned scratch: reads of unwritten memory show as non-finite

from lily import _lily  # noqa: E402
from lily.testing.cuda_checks import check_config, configs  # noqa: E402
from lily.testing.cuda_sampling_checks import check_session_sampling  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256,
                    help="teacher-forced tokens per config (>= 12: the sampler chain needs 8 steps past a prefix)")
    ap.add_argument("--json", default="")
    ap.add_argument("--configs", default="")
    ap.add_argument("--full", default="", help="full-size checkpoint folder (benchmarks/full_checkpoint.py): "
                    "adds the teacher-forced full-size case (cuda_check_full.py); --configs none skips the tiny ones")
    ap.add_argument("--full-tokens", type=int, default=192)
    ap.add_argument("--env-positions", type=int, default=96, help="positions of the bf16 reference envelope")
    ap.add_argument("--threads", type=int, default=0, help="CPU engine threads for --full (0 = all cores)")
    ap.add_argument("--progress", action="store_true",
                    help="print each check as it completes (the sanitizers' runs: a timeout then shows where)")
    ap.add_argument("--no-bundled", action="store_true",
                    help="skip the bundled model's session-sampling check (the sanitizers' runs: its model load "
                    "and generations take minutes under racecheck; the configs' own sampler checks still run)")
    args = ap.parse_args()
    if args.tokens < 12:
        ap.error(f"--tokens {args.tokens}: expected >= 12 (the device-sampler chain decodes 8 steps after a prefix "
                 "of at least 2 tokens)")
    info = _lily.build_info()
    print("build", info, "devices", _lily.cuda_device_count(), flush=True)
    if _lily.cuda_device_count() == 0:
        sys.exit("no CUDA device")
    results = []
    cfgs = configs()
    names = [] if args.configs == "none" else args.configs.split(",") if args.configs else list(cfgs)
    for name in names:
        t0 = time.time()
        try:
            check_config(name, cfgs[name], args.tokens, results,
                         progress=(lambda ln: print(ln, flush=True)) if args.progress else None)
        except Exception as e:  # one failing config must not hide the others
            results.append({"config": name, "check": "exception", "pass": False, "error": repr(e)})
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
    if names and not args.no_bundled:
        t0 = time.time()
        try:
            check_session_sampling(results)
        except Exception as e:  # noqa: BLE001
            results.append({"config": "bundled_model", "check": "exception", "pass": False, "error": repr(e)})
        print(f"[bundled_model sampling] {time.time() - t0:.1f}s", flush=True)
    if args.full:
        from cuda_check_full import check_full
        t0 = time.time()
        try:
            check_full(args.full, args.full_tokens, args.env_positions, results, args.threads)
        except Exception as e:  # noqa: BLE001 - report, do not hide the tiny configs' table
            results.append({"config": "full_checkpoint", "check": "exception", "pass": False, "error": repr(e)})
        print(f"[full_checkpoint] {time.time() - t0:.1f}s", flush=True)
    print()
    print(f"{'config':16s} {'check':34s} {'result':6s} figures")
    for r in results:
        fig = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
               if k not in ("config", "check", "pass", "per_block")}
        print(f"{r['config']:16s} {r['check']:34s} {'PASS' if r['pass'] else 'FAIL':6s} {fig}")
    n_fail = sum(not r["pass"] for r in results)
    print(f"\n{len(results) - n_fail} passed, {n_fail} failed")
    if args.json:
        Path(args.json).write_text(json.dumps({"build": info, "results": results}, indent=1, default=float))
    sys.exit(1 if n_fail else 0)


if __name__ == "__main__":
    main()

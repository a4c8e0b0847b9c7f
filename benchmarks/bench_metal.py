"""Metal benchmark for a Mac: lily (backend "metal") against MLX-LM on the same checkpoint bytes, prefill and decode
from 256 to 128K tokens (benchmarks/results/README.md), the engines alternating order each round, with a cooldown before every
timed run (M-series chips throttle under sustained load). JSON (hardware, git sha, settings, rows) + PNG.

On a Mac (Apple Silicon, ~20 GB free for the real checkpoint; see docs/metal.md "Benchmark on your Mac"):
    pip install . mlx-lm matplotlib
    python benchmarks/bench_metal.py                                   # the real model, the full sweep
    python benchmarks/bench_metal.py --lengths 256,4096,32768 --cooldown 20 --out bench_metal_m3max

Dry run anywhere (CI runs it): a tiny synthetic checkpoint on the emulated Metal device (the CPU emulator of
Metal compute, tools/msl), MLX-LM on the CPU when it is installed. It checks that the script works end to end;
its figures say nothing about a Mac:
    python benchmarks/bench_metal.py --dry-run --out /tmp/bench_metal_dry
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import lily
from lily.bench import format_table, run_bench

REPO = Path(__file__).resolve().parents[1]
REAL_MODEL = "mlx-community/Qwen3.6-35B-A3B-4bit"
FULL_LENGTHS = "256,512,1024,2048,4096,8192,16384,32768,65536,131072"
DRY_LENGTHS = "16,40"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=REAL_MODEL, help=f"checkpoint folder or Hugging Face repo id ({REAL_MODEL})")
    ap.add_argument("--lengths", default="", help=f"prompt and context lengths (default {FULL_LENGTHS})")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median reported)")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed greedy steps per decode repeat")
    ap.add_argument("--cooldown", type=float, default=10.0, help="idle seconds before every timed run")
    ap.add_argument("--no-peer", action="store_true", help="lily only (no MLX-LM)")
    ap.add_argument("--peer-max", type=int, default=None, metavar="TOKENS",
                    help="run MLX-LM only up to this length (e.g. when it runs out of memory at 128K)")
    ap.add_argument("--out", default="", help="path stem of the JSON / PNG (default benchmarks/results/"
                                              "bench_metal_<chip>)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny synthetic checkpoint on the emulated Metal device (Linux CI); short lengths")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in (args.lengths or (DRY_LENGTHS if args.dry_run else FULL_LENGTHS)).split(",")]
    if args.dry_run:
        args.repeats, args.decode_steps, args.cooldown = min(args.repeats, 2), min(args.decode_steps, 4), 0.0
    return args


def emulated_metal_options() -> dict[str, str]:
    """Backend options of the emulated Metal device: every metal/*.metal built by the project's MSL toolchain."""
    sys.path.insert(0, str(REPO / "tools" / "msl"))
    import emu  # noqa: E402 (tools/msl: the emulator's builder, cached on disk)
    libs = [emu.library(str(f)).lib._name for f in sorted((REPO / "metal").glob("*.metal"))]
    return {"emu_kernel_libs": ";".join(libs)}


def load(args):
    """(model, peer or None, note)."""
    peer = None if args.no_peer else "mlx-lm"
    need = max(args.lengths) + 2 + args.decode_steps * (args.repeats + 1) + 8
    if args.dry_run:
        from lily.testing import write_synthetic_checkpoint
        folder = write_synthetic_checkpoint(Path(tempfile.mkdtemp(prefix="lily_bench_metal_")), "tiny")
        model = lily.load(str(folder), backend="metal", backend_options=emulated_metal_options(),
                          max_context=need)
        try:
            import mlx_lm  # noqa: F401
        except ImportError:
            peer = None
        return model, peer, "dry run: tiny synthetic checkpoint, emulated Metal device (figures mean nothing)"
    if platform.system() != "Darwin":
        raise SystemExit("bench_metal.py measures Apple GPUs: run it on a Mac (or pass --dry-run)")
    model = lily.load(args.model, backend="metal", max_context=need)
    return model, peer, ""


def default_out(model, dry: bool) -> Path:
    if dry:
        return Path(tempfile.gettempdir()) / "bench_metal_dryrun"
    chip = platform.processor() or platform.machine()
    try:
        import subprocess
        chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or chip
    except OSError:
        pass
    name = "".join(c if c.isalnum() else "_" for c in chip.lower()).strip("_")
    return REPO / "benchmarks" / "results" / f"bench_metal_{name}"


def main(argv=None) -> int:
    args = parse_args(argv)
    model, peer, note = load(args)
    out = Path(args.out) if args.out else default_out(model, args.dry_run)
    print(f"[bench_metal] {model!r}; peer {peer or 'none'}; lengths {args.lengths}; cooldown {args.cooldown} s",
          file=sys.stderr, flush=True)
    result = run_bench(model, args.lengths, args.lengths, args.repeats, peer=peer, decode_steps=args.decode_steps,
                       peer_max_tokens=args.peer_max, note=note, out=out, cooldown_s=args.cooldown)
    result["benchmark"] = "bench_metal"
    from lily.bench import write_result
    write_result(result, out)
    print(format_table(result))
    print(f"[bench_metal] wrote {out}.json" + ("" if os.environ.get("CI") else
                                              " (please report it: docs/metal.md says how)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

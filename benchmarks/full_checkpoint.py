"""Write the full-size synthetic Qwen3.6-35B-A3B checkpoint (MLX 4-bit, ~19.5 GB) fast, for the CUDA benchmark,
the full-size correctness check and MLX-LM as a peer on the same bytes.

    PYTHONPATH=src python3 benchmarks/full_checkpoint.py /tmp/full35b            # real config (~19.5 GB)
    PYTHONPATH=src python3 benchmarks/full_checkpoint.py /tmp/tiny --config tiny  # dry run

Codes and per-group scales are views into shared random pools (lily.testing.fast_synthetic: conditioning and
why in its docstring); ~10 shards of 2 GB are written by a thread pool. Loadable by `lily.load(dir,
backend="cuda")`, `lily.checkpoint.load_checkpoint` (-> `_lily.Engine`) and `mlx_lm.load(dir)`.
--verify loads it back with lily.checkpoint (and mlx-lm when it imports) and prints a few shapes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lily.testing.fast_synthetic import write_fast_checkpoint
from lily.testing.synthetic import config_dict


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--config", default="full", help="full (real shapes) or a tiny config name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--residual-scale", type=float, default=0.1)
    ap.add_argument("--router-gain", type=float, default=4.0)
    ap.add_argument("--embed-std", type=float, default=1.0)
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    info = write_fast_checkpoint(args.folder, config_dict(args.config), args.seed, threads=args.threads,
                                 residual_scale=args.residual_scale, router_gain=args.router_gain,
                                 embed_std=args.embed_std)
    info["total_s"] = time.perf_counter() - t0
    print(f"[full_checkpoint] {args.folder}: {info['bytes'] / 1e9:.2f} GB in {info['shards']} shards; generate "
          f"{info['gen_s']:.1f}s, write {info['write_s']:.1f}s ({info['bytes'] / 1e9 / max(info['write_s'], 1e-9):.1f}"
          f" GB/s), tokenizer {info['tokenizer_s']:.1f}s, total {info['total_s']:.1f}s", flush=True)
    (Path(args.folder) / "lily_synthetic_timing.json").write_text(json.dumps(info, indent=1))
    if args.verify:
        from lily.checkpoint import load_checkpoint
        t0 = time.perf_counter()
        ck = load_checkpoint(args.folder, progress=False)
        print(f"[full_checkpoint] lily.checkpoint: {len(ck.tensors)} tensors, {ck.nbytes / 1e9:.2f} GB, "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
        try:
            import mlx_lm
            t0 = time.perf_counter()
            mlx_lm.load(args.folder)
            print(f"[full_checkpoint] mlx_lm.load ok ({time.perf_counter() - t0:.1f}s)", flush=True)
        except ImportError as e:
            print(f"[full_checkpoint] mlx-lm not importable: {e}")
    return info


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""The real decode step under Nsight Compute, warm and whole: the in-memory full-size weights (the same as
dev/compare_builds.py), a prefill of L random tokens, greedy steps until both step graphs are recorded, then
--steps more between cuProfilerStart / cuProfilerStop (the driver's, so no CUDA runtime library is needed). Run it
under `ncu --profile-from-start off --graph-profiling graph`: each step graph is then one result, so the stall
samples, DRAM throughput and SM activity are those of the whole step as it runs (the launches interleaved, caches
as the step leaves them), not of one kernel replayed cold.

    ncu --profile-from-start off --graph-profiling graph --cache-control none --clock-control none \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,... \
        --csv --page raw python3 dev/decode_step_profile.py --length 4096
"""
from __future__ import annotations

import argparse
import ctypes

import numpy as np

from lily import _lily
from lily.config import ModelConfig
from lily.testing.fast_synthetic import conditioned_weights
from lily.testing.synthetic import config_dict


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(config_dict("full"))
    tensors, quant = conditioned_weights(cfg)
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=args.length + 64, backend="cuda")
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, args.length).astype(np.int32)
    st = eng.new_state()
    tok = int(np.argmax(eng.forward(st, toks, logits="last")[-1]))
    eng.decode_greedy(st, tok, 6)  # both parities' graphs recorded and replayed
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    eng.decode_greedy(st, tok, args.steps)
    cuda.cuProfilerStop()
    print(f"profiled {args.steps} decode steps at {args.length}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One prefill of L tokens on the in-memory full-size weights (lily.testing.fast_synthetic, seed 0) between
cuProfilerStart / cuProfilerStop (the driver's), after a warm-up prefill, so that Nsight Compute with
`--profile-from-start off` sees the real launches of that prefill alone: which GEMM path each projection takes,
its grid and its time (the prefill's kernel profile in bench_cuda.py only sums by kernel name).

    ncu --profile-from-start off --kernel-name regex:gemm_mma --launch-count 12 --section SpeedOfLight \
        --section LaunchStats python3 dev/ncu_prefill.py 4096          (H200)
"""
from __future__ import annotations

import ctypes
import sys

import numpy as np

from lily import _lily
from lily.config import ModelConfig
from lily.testing.fast_synthetic import conditioned_weights
from lily.testing.synthetic import config_dict


def main() -> int:
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    cfg = ModelConfig.from_dict(config_dict("full"))
    tensors, quant = conditioned_weights(cfg)
    eng = _lily.Engine(cfg.to_dict(), tensors, quant, threads=0, max_context=L + 16, backend="cuda")
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, L).astype(np.int32)
    warm = eng.new_state()
    eng.forward(warm, toks[:512], logits="last")
    del warm
    st = eng.new_state()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    eng.forward(st, toks, logits="last")
    cuda.cuProfilerStop()
    print(f"prefill of {L} tokens profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())

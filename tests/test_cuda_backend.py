"""CUDA backend: the clear error without a device (runs everywhere), and the GPU checks of
benchmarks/cuda_check.py (CUDA engine vs CPU engine within the rounding envelope) where a device is visible."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_lily = pytest.importorskip("lily._lily")
from lily.testing import random_weights, tiny_configs  # noqa: E402

BUILT = "cuda" in _lily.build_info()["backends"]
HAVE_GPU = BUILT and _lily.cuda_device_count() > 0


@pytest.mark.skipif(HAVE_GPU, reason="a CUDA device is visible")
def test_cuda_without_device_is_a_clear_error():
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)
    with pytest.raises(RuntimeError, match="cuda"):
        _lily.Engine(cfg.to_dict(), tensors, quant, backend="cuda")
    assert _lily.Engine(cfg.to_dict(), tensors, quant, backend="cpu").backend == "cpu"


def test_unknown_backend():
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)
    with pytest.raises(ValueError, match="unknown backend"):
        _lily.Engine(cfg.to_dict(), tensors, quant, backend="tpu")


@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device")
@pytest.mark.parametrize("name", ["tiny", "tiny_dk_ne_dv", "tiny_odd", "mid_real_heads"])
def test_cuda_vs_cpu(name):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import cuda_check

    results = []
    cuda_check.check_config(name, cuda_check.configs()[name], 192, results)
    for r in results:
        print(r)
    assert all(r["pass"] for r in results), [r for r in results if not r["pass"]]

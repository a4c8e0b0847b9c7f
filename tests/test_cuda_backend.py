"""CUDA backend: the clear error without a device (runs everywhere), and the whole-model GPU checks of
lily.testing.cuda_checks (CUDA engine vs CPU engine within the rounding envelope; benchmarks/cuda_check.py runs
the same ones on the H200) where a device is visible."""
from __future__ import annotations

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
def test_cuda_vs_cpu(name, monkeypatch):
    monkeypatch.setenv("LILY_DEBUG", "1")  # NaN-poisoned scratch, as benchmarks/cuda_check.py runs the engines
    from lily.testing.cuda_checks import check_config, configs

    results = []
    check_config(name, configs()[name], 192, results)
    for r in results:
        print(r)
    assert all(r["pass"] for r in results), [r for r in results if not r["pass"]]

"""Fixtures of the kernel suite: `backend`, the op table of each backend (cpu: lily._lily.ops, metal: the emulator
wrappers of ops_metal.py, cuda: ops_cuda.py over lily._lily.cuda_ops), `cuda`, the CUDA op table itself for the
kernel-by-kernel tests (test_cuda_*.py). CUDA entries skip with "no CUDA device" where none is visible (CI builds the
CUDA backend without a GPU). `rng` (fresh inputs per run from a printed seed, LILY_TEST_SEED reproduces one) is
tests/conftest.py's."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# metal_env (the MSL toolchain and kernel libraries) lives beside the other Metal tests; it is imported, not copied
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "metal"))
sys.path.insert(0, HERE)

def cuda_ops():
    """lily._lily.cuda_ops, or a skip (no CUDA device) / failure (a device, but an extension built without CUDA)."""
    _lily = pytest.importorskip("lily._lily")
    if _lily.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    if not hasattr(_lily, "cuda_ops"):
        pytest.fail("a CUDA device is visible but lily._lily has no cuda_ops: rebuild the extension with nvcc")
    return _lily.cuda_ops


@pytest.fixture
def cuda():
    """The CUDA op table (lily._lily.cuda_ops) of the kernel-by-kernel tests."""
    return cuda_ops()


BACKENDS = ["cpu", "metal", "cuda"]


def op_table(name: str):
    if name == "cpu":
        _lily = pytest.importorskip("lily._lily")
        if not hasattr(_lily, "ops"):
            pytest.fail("lily._lily has no ops submodule: rebuild the extension")
        import ops_cpu
        return ops_cpu
    if name == "metal":
        import ops_metal
        return ops_metal
    cuda_ops()
    import ops_cuda
    return ops_cuda


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The op table of one backend: the entry points of op_list.py, the same on each."""
    return op_table(request.param)

"""Fixtures of the kernel suite: `backend`, the op table of each backend (cpu: lily._lily.ops, metal: the emulator
wrappers of ops_metal.py, cuda: none yet), and `rng`, fresh inputs per run from a printed seed.

Reproduce a failure with the seed its captured output prints: LILY_TEST_SEED=<seed> pytest <test id>."""
from __future__ import annotations

import os
import secrets
import sys
import zlib

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# metal_env (the MSL toolchain and kernel libraries) lives beside the other Metal tests; it is imported, not copied
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "metal"))
sys.path.insert(0, HERE)

RUN_SEED = int(os.environ.get("LILY_TEST_SEED") or secrets.randbits(32))


@pytest.fixture
def rng(request):
    # fresh random inputs per run; each test draws from (run seed, test id), so one seed reproduces one test
    seed = zlib.crc32(f"{RUN_SEED}:{request.node.nodeid}".encode())
    print(f"seed: LILY_TEST_SEED={RUN_SEED} (this test draws from {seed})")
    return np.random.default_rng(seed)


def _cuda_ops():
    """The CUDA op table: no per-op Python entry points yet. A module with the names of ops_cpu.py goes here
    (e.g. over a lily._lily.cuda_ops submodule); until then a visible device still skips."""
    return None


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
    _lily = pytest.importorskip("lily._lily")
    if _lily.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    table = _cuda_ops()
    if table is None:
        pytest.skip("no CUDA per-op entry points yet (the CUDA kernels are checked by benchmarks/kernels/run.sh)")
    return table


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The op table of one backend: the same functions (names and shapes as ops_cpu.py) on each."""
    return op_table(request.param)

"""The CUDA kernel timing drivers (benchmarks/kernels/time_*.cu) compile and link on the CI machine, which has nvcc
but no GPU: a source missing from a driver's "// build:" line, or a launch function's signature changed without its
driver, fails here instead of in the first (scarce) device call. Their correctness twins are gone: the kernels are
checked by tests/kernels/test_cuda_*.py against lily.reference, which must use every CUDA kernel bound of the one
tolerance table."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "benchmarks" / "kernels"


@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc not installed")
def test_kernel_timing_drivers_build(tmp_path):
    env = dict(os.environ, BUILD_ONLY="1", PTX_ONLY="1", OUT=str(tmp_path), KBIN=str(tmp_path / "bin"))
    r = subprocess.run(["bash", "benchmarks/kernels/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    programs = sorted(p.stem for p in KERNELS.glob("time_*.cu"))
    assert programs, "no timing drivers in benchmarks/kernels"
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert sorted(line.split()[1] for line in r.stdout.splitlines() if line.startswith("built ")) == programs


def test_drivers_time_and_do_not_check():
    """benchmarks/kernels holds the drivers, their shared timing header and run.sh: no check programs, no fp64 twins,
    no tolerance header (the one table is lily.testing.tolerances, read by the Python tests)."""
    assert sorted(p.name for p in KERNELS.iterdir()) == sorted(
        ["run.sh", "timing.cuh"] + [p.name for p in KERNELS.glob("time_*.cu")])
    for src in KERNELS.glob("*.cu*"):
        text = src.read_text()
        assert not re.search(r"\b(PASS|FAIL|SUMMARY|tolerances::)", text), f"{src.name} checks results"


def test_every_cuda_kernel_bound_is_used_by_the_kernel_tests():
    from lily.testing.tolerances import KERNEL_CHECKS
    text = "".join(p.read_text() for p in (ROOT / "tests" / "kernels").glob("*cuda*.py"))
    unused = sorted(name for name in KERNEL_CHECKS if f'"{name}"' not in text)
    assert not unused, f"KERNEL_CHECKS entries no CUDA kernel test reads: {unused}"

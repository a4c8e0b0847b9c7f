"""The GPU check programs (benchmarks/kernels/check_*.cu) compile and link on the CI machine, which has nvcc but no
GPU: a source missing from a program's "// build:" line, or a kernel signature changed without its check, fails
here instead of in the first (scarce) device call."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc not installed")
def test_kernel_check_programs_build(tmp_path):
    env = dict(os.environ, BUILD_ONLY="1", OUT=str(tmp_path))
    r = subprocess.run(["bash", "benchmarks/kernels/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    programs = sorted(p.stem for p in (ROOT / "benchmarks" / "kernels").glob("check_*.cu"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert sorted(line.split()[1] for line in r.stdout.splitlines() if line.startswith("built ")) == programs


def test_kernel_check_tolerances_header_is_generated_from_the_table():
    """The check programs' tolerances (benchmarks/kernels/tolerances.h) are lily.testing.tolerances.KERNEL_CHECKS:
    the header is that table's `--header` output, and every program reads its thresholds from it."""
    from lily.testing.tolerances import KERNEL_CHECKS, header
    path = ROOT / "benchmarks" / "kernels" / "tolerances.h"
    assert path.read_text() == header(), "regenerate: python3 -m lily.testing.tolerances --header > " + str(path)
    used = set()
    for src in (ROOT / "benchmarks" / "kernels").glob("check_*.cu"):
        text = src.read_text()
        assert '#include "tolerances.h"' in text, src.name
        used |= {name for name in KERNEL_CHECKS if f"tolerances::{name}" in text}
    assert used == set(KERNEL_CHECKS), f"unused entries: {sorted(set(KERNEL_CHECKS) - used)}"

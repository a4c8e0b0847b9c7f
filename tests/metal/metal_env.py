"""Helpers of the Metal tests: the project's MSL toolchain (tools/msl) on sys.path, kernel libraries,
paths. (A uniquely named module: `conftest` names several files under tests/.)"""
from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# lily itself comes from the installed package (or PYTHONPATH=src), as for the other tests: putting src/
# first here would shadow the installed extension module in a clean checkout.
sys.path.insert(0, os.path.join(ROOT, "tools", "msl"))

import emu  # noqa: E402
import mslc  # noqa: E402

METAL_DIR = os.path.join(ROOT, "metal")


def metal_files() -> list[str]:
    return sorted(os.path.join(METAL_DIR, f) for f in os.listdir(METAL_DIR) if f.endswith(".metal"))


# family -> path of a modified copy of its .metal file (tests/metal/test_planted_bugs.py)
OVERRIDE: dict[str, str] = {}


def lib(name: str) -> emu.Library:
    """The emulator build of metal/<name>.metal (cached per session), or of its planted copy."""
    return emu.library(OVERRIDE.get(name) or os.path.join(METAL_DIR, name + ".metal"))


def nan_like(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, np.nan, dtype)

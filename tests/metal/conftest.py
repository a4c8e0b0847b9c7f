"""Fixtures of the Metal tests (helpers live in metal_env.py)."""
from __future__ import annotations

import shutil

import pytest
from metal_env import CLANG_HINT, mslc


@pytest.fixture(scope="session")
def have_clang():
    if shutil.which(mslc.CLANG) is None:
        pytest.fail(f"{mslc.CLANG} not found: {CLANG_HINT}")
    return True

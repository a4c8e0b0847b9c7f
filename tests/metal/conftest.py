"""Fixtures of the Metal tests (helpers live in metal_env.py)."""
from __future__ import annotations

import pytest
from metal_env import mslc


@pytest.fixture(scope="session")
def have_clang():
    # a failure, not a skip: the address-space check is part of what the Metal backend's status rests on
    if mslc.CLANG is None:
        pytest.fail(mslc.CLANG_MISSING)
    return True

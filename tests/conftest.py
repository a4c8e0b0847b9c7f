import os
import secrets
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Reproduce a failure with the seed its captured output prints: LILY_TEST_SEED=<seed> pytest <test id>.
RUN_SEED = int(os.environ.get("LILY_TEST_SEED") or secrets.randbits(32))


@pytest.fixture
def rng(request):
    # fresh random inputs per run; each test draws from (run seed, test id), so one seed reproduces one test
    seed = zlib.crc32(f"{RUN_SEED}:{request.node.nodeid}".encode())
    print(f"seed: LILY_TEST_SEED={RUN_SEED} (this test draws from {seed})")
    return np.random.default_rng(seed)

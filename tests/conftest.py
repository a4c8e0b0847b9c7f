import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng(request):
    # fresh random inputs per test, but reproducible from the test name
    seed = abs(hash(request.node.nodeid)) % (2 ** 32)
    return np.random.default_rng(seed)

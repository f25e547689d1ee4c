import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
MODELS = os.path.join(SHARED, "models")


def backend_names():
    return ["cpu"]


@pytest.fixture(scope="session", params=backend_names())
def backend(request):
    from ferrum import _core
    return _core.make_backend(request.param, 2)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

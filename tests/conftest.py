import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

try:
    from hypothesis import settings

    # design.md: cap hypothesis at about 25 examples so the suite stays within budget.
    settings.register_profile("glassformer", max_examples=25, deadline=None, derandomize=True)
    settings.load_profile("glassformer")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One CPU thread: much faster for tiny models on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

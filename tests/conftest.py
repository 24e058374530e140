"""Fixtures many test files share; the independent oracles live in tests/oracles/ (importable as `oracles.*`)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["default", 1])
def threads(request):
    """The machine's default intra-op thread count, then one thread, for one test (restored after): kernels
    may return other layouts at another count (convolution weight gradients), so a memory-fidelity test runs
    at both."""
    import torch  # here, not at the top: tests that check what importing the planner loads run without it

    default = torch.get_num_threads()
    torch.set_num_threads(default if request.param == "default" else request.param)
    yield torch.get_num_threads()
    torch.set_num_threads(default)


@pytest.fixture(scope="module")
def per_thread_count():
    """A module's ``{thread count: value}``, for a fixture that profiles once per count of :func:`threads`."""
    return {}

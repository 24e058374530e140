"""Fixtures many test files share; the independent oracles live in tests/oracles/ (importable as `oracles.*`), the
checks several folders share in tests/checks.py."""

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Inductor compiles a test's kernels in this process, not in a pool of worker processes it would start (each
# importing torch) on the 2 cores the suite has: test_compiled.py's cases took 12% less time so. Set before torch
# reads it; a value in the environment is kept.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# OpenMP's idle threads sleep at once instead of spinning for a while: the suite runs a pytest-xdist worker per
# core, each with its tests' child processes, and a thread spinning on one core takes it from another process
# (test_stage_options.py and test_thread_fidelity.py on 2 workers: 51 s, 82 s of CPU; passive: 41 s, 63 s). The
# thread counts, and so every measured size, are the same. Set before torch loads its OpenMP runtime; children
# inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The helper modules (checks, paths, oracles...) import from tests/; the repository comes first so that the
# packages are found there even when pytest runs without it on sys.path (the `pytest` script, an editable
# install's import hook): tests/planner/ and its siblings, folders of tests, would otherwise pass for them.
sys.path[:0] = [str(TESTS.parent), str(TESTS)]


def pytest_configure(config):
    """A pytest-xdist worker (CI runs one per core: ``-n auto``) computes with one intra-op thread, so that the
    workers do not each spin as many threads as there are cores; the ``threads`` fixtures still give a test the
    machine's default count (:func:`checks.default_threads`). A child process (a fresh process, torchrun's ranks)
    has torch's default."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        from checks import DEFAULT_THREADS_VARIABLE

        os.environ.setdefault(DEFAULT_THREADS_VARIABLE, str(torch.get_num_threads()))
        torch.set_num_threads(1)


@pytest.fixture(params=["default", 1])
def threads(request):
    """The machine's default intra-op thread count, then one thread, for one test (restored after): kernels
    may return other layouts at another count (convolution weight gradients), so a memory-fidelity test runs
    at both."""
    from checks import at_thread_count

    yield from at_thread_count(request.param)


@pytest.fixture(scope="module")
def per_thread_count():
    """A module's ``{thread count: value}``, for a fixture that profiles once per count of :func:`threads`."""
    return {}


@pytest.fixture(scope="module")
def rotor_plan():
    """An 8-stage synthetic chain and its rotor plan, halfway between the least and the store-all memory."""
    import solvers  # here, not at the top: conftest loads for every test file, and numba's import takes ~2 s
    from profiles.synthetic import random_chain
    from solvers.minimum import minimum_budget

    chain = random_chain(8, seed=3, tmp=True, params=True)
    budget = (minimum_budget(chain) + solvers.store_all_peak(chain)) // 2
    return chain, solvers.solve(chain, budget, "rotor")

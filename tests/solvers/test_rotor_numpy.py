"""solvers/rotor_numpy.py fills Rotor's table and the least-memory table as the numba kernels do, bit for bit; its
choices rebuild schedules that reach the table's optimum; small chains are solved with it while the kernels are
not compiled (solvers/kernels.py), so that the first solve of a new install compiles nothing (issue 40: 9.5 CPU s
on a 24-stage chain before)."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from paths import ROOT
from planner.simulate.chain import ChainSimulator
from profiles.synthetic import random_chain
from solvers import kernels, rotor_numpy, store_all_peak
from solvers.minimum import minimum_budget
from solvers.rotor_model import build_schedule, rotor_arrays

rotor_module = importlib.import_module("solvers.rotor")  # (``solvers.rotor`` is also the package's function)
minimum_module = importlib.import_module("solvers.minimum")


def _chains():
    """Chains of 1 to 14 stages of a few bytes (one unit a byte: the table's optimum is exact in bytes), with
    temporaries, parameter gradients, outputs kept in part, and options (ways) or not."""
    for seed in range(24):
        yield seed, random_chain(1 + seed % 14, seed, scale_bytes=6, tmp=seed % 2 == 0, params=seed % 3 != 0,
                                 own_saved=seed % 4 < 2, options=seed % 3)


def _tables(arrays, top, fill):
    length = arrays.length
    opt = np.empty((length + 1, length + 1, top + 1))
    need, choice = (np.zeros((length + 1, length + 1), dtype=np.int64) for _ in range(2))
    if fill == "kernel":
        rotor_module._fill_diagonal(arrays.x, *arrays.ways, opt)
        rotor_module._fill_spans(arrays.x, arrays.nograd_tmp, arrays.param_prefix, arrays.fwd_time, *arrays.ways,
                                 opt, 1, length + 1)
        minimum_module._least_memory_diagonal(arrays.x, *arrays.ways[:4], need, choice)
        minimum_module._least_memory_spans(arrays.x, arrays.nograd_tmp, arrays.param_prefix, *arrays.ways[:4], need,
                                           choice, 1, length + 1)
    else:
        rotor_numpy.fill_diagonal(arrays, opt)
        rotor_numpy.fill_spans(arrays, opt, 1, length + 1)
        rotor_numpy.least_memory_diagonal(arrays, need, choice)
        rotor_numpy.least_memory_spans(arrays, need, choice, 1, length + 1)
    return opt, need, choice


@pytest.mark.parametrize("seed, chain", list(_chains()), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_numpy_tables_equal_the_kernels_and_their_choices_reach_the_optimum(seed, chain):
    options = seed % 3 > 0
    top = store_all_peak(chain) - chain.input_bytes  # every level up to store-all, a byte each
    arrays = rotor_arrays(chain, 1, options=options)
    upper = np.triu_indices(chain.length + 1)
    kernel, ours = _tables(arrays, top, "kernel"), _tables(arrays, top, "numpy")
    for theirs, mine in zip(kernel, ours):
        assert np.array_equal(theirs[upper], mine[upper])  # inf where nothing fits, on both sides
    opt = ours[0]
    rng = np.random.default_rng(seed)
    for _ in range(200):  # the choice behind a cell: numpy's is the kernel's (ties to a leaf, the first j, way)
        i, end = sorted(int(v) for v in rng.integers(0, chain.length + 1, size=2))
        m = int(rng.integers(0, top + 1))
        assert rotor_numpy.best_choice(arrays, opt, i, end, m) == rotor_module._best_choice(
            arrays.x, arrays.nograd_tmp, arrays.param_prefix, arrays.fwd_time, *arrays.ways, opt, i, end, m)
    simulator = ChainSimulator(chain)
    low = minimum_budget(chain, options=options) - chain.input_bytes
    for level in sorted({low, (low + top) // 2, top}):
        if not (np.isfinite(opt[0, chain.length, level]) and rotor_module.final_state_fits(arrays, level)):
            continue
        schedule = build_schedule(arrays, lambda i, end, m: rotor_numpy.best_choice(arrays, opt, i, end, m), level)
        result = simulator.run(schedule)
        assert result.time == pytest.approx(opt[0, chain.length, level], rel=1e-12)
        assert result.peak_bytes <= chain.input_bytes + level


def test_a_table_is_filled_in_numpy_only_while_small_and_its_kernel_not_compiled(monkeypatch):
    chain = random_chain(12, 3, tmp=True, params=True)
    arrays = rotor_arrays(chain, 1 << 20)
    fills = []
    monkeypatch.setattr(rotor_numpy, "fill_spans", lambda *args: fills.append("numpy"))
    monkeypatch.setattr(rotor_module, "_fill_spans", lambda *args: fills.append("kernel"))
    monkeypatch.setattr(rotor_module, "_fill_diagonal", lambda *args: None)
    monkeypatch.setattr(rotor_module, "compile_for", lambda *args: None)
    numpy_seconds, most = kernels.NUMPY_SECONDS, rotor_numpy.ROTOR_WORK
    for ready, work, spent, expected in ((False, most, 0.0, "numpy"), (True, most, 0.0, "kernel"),
                                         (False, 10, 0.0, "kernel"), (False, most, numpy_seconds, "kernel")):
        fills.clear()
        monkeypatch.setattr(kernels, "ready", lambda kernel, ready=ready: ready)
        monkeypatch.setattr(rotor_numpy, "ROTOR_WORK", work)
        monkeypatch.setattr(kernels, "_SPENT", [spent])  # this process's seconds in numpy tables so far
        rotor_module.compute_table(arrays, 40)
        assert set(fills) == {expected}


def test_a_kernel_is_ready_once_compiled():
    @numba.njit
    def twice(value):
        return 2 * value

    assert not kernels.ready(twice)  # not compiled, and no cache
    assert twice(3) == 6
    assert kernels.ready(twice)


FIRST_SOLVE = textwrap.dedent('''
    import json, sys, time
    from numba.core import event
    compiled = []

    class Listener(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            compiled.append(ev.data["dispatcher"].py_func.__qualname__)

    event.register("numba:compile", Listener())
    import cli
    started = time.process_time()
    code = cli.main(["solve", sys.argv[1], "--budget", "60%"])
    print(json.dumps([code, compiled, time.process_time() - started]))
''')


@pytest.mark.slow
@pytest.mark.parametrize("options", [0, 2])
def test_the_first_solve_of_a_new_install_compiles_no_kernel(tmp_path, options):
    """A 50-stage chain (with two options a stage: the hierarchical solver), solved in a fresh process with an
    empty numba cache: no kernel compiled (before: Rotor's and the least memory's, 9.5 CPU s)."""
    from planner import save_chain

    path = tmp_path / "chain.json"
    save_chain(random_chain(50, 3, tmp=True, params=True, options=options), path)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", FIRST_SOLVE, str(path)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    code, compiled, _ = json.loads(done.stdout.splitlines()[-1])
    assert code == 0 and compiled == [], compiled

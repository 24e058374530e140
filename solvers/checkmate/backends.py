"""The HiGHS and CBC drivers of :class:`solvers.checkmate.model.CheckmateModel`: one solve of its arrays.

:func:`solve_highs` runs HiGHS (highspy) in this process, in a thread that Ctrl-C interrupts, or above
:data:`_CHILD_ABOVE` columns in a child process killed at the deadline; :func:`solve_cbc` writes the model as an
MPS file for the CBC binary bundled with pulp (a child process too). Both return ``(found, finished, objective,
bound, column values)`` and set the model's ``row_dual`` (row multipliers of a relaxed model, else None).
highspy and pulp are imported on first use: the chain solvers never load them.
"""

import functools
import inspect
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from planner.errors import MemschedError
from solvers.limits import Deadline, run_interruptibly

_THREADS = 2
_CHILD_ABOVE = 4000  # columns: HiGHS runs in a child process above (see solve_highs)
_KILL_GRACE = 0.3  # seconds past the deadline before a HiGHS child is killed


@functools.cache
def _highspy():
    """highspy, imported once; its banner (printed on the process's stdout when the first solver object is made)
    goes to /dev/null."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    return highspy


def _highs_model(model, offset: bool, integral: bool = True):
    """A HiGHS instance holding this model (integrality only with ``integral``, the offset with ``offset``)."""
    arrays = _highs_arrays(model, None)
    if not integral:
        arrays["integral"] = None
    if not offset:
        arrays["offset"] = 0.0
    return _highs_instance(_highspy(), arrays, {"output_flag": False, "threads": _THREADS})


def _highs_options(model, gap) -> dict:
    options = {"output_flag": False, "threads": _THREADS, "mip_rel_gap": float(gap), "mip_abs_gap": 0.0}
    if model.relaxed:  # rounding needs values, not a vertex: the interior point method without crossover
        options.update(solver="ipm", run_crossover="off")
    return options


def solve_highs(model, deadline: Deadline, gap, start):
    """(found, finished: optimal or proven infeasible, objective, bound, column values); objective and bound
    without the offset.

    HiGHS does not look at its clock (nor at an interrupt) in every phase: on models of 50,000 columns and
    more its setup after presolve runs for seconds past any time limit. Models above :data:`_CHILD_ABOVE`
    columns are therefore solved in a child process, killed :data:`_KILL_GRACE` seconds past the deadline
    (or at once on Ctrl-C); smaller ones here, in a thread that Ctrl-C interrupts (HiGHS's interrupt
    callback). A solve that the deadline leaves no time for is not started."""
    left = deadline.left()
    if left is not None and left <= 0.0:
        return False, False, math.nan, None, None
    options = _highs_options(model, gap)
    if len(model.col_lower) > _CHILD_ABOVE:
        outcome = _highs_child(model, options, start, deadline)
    else:
        outcome = _highs_here(model, options, start, deadline)
    if outcome is None:  # killed at the deadline
        return False, False, math.nan, None, None
    status, primal_valid, objective, dual_bound, values, row_dual = outcome
    found = primal_valid and status != "infeasible"
    finished = status in ("optimal", "infeasible")
    objective -= model.objective_offset
    bound = None
    if not model.relaxed and math.isfinite(dual_bound):
        bound = dual_bound - model.objective_offset
    values = np.asarray(values) if found else None
    model.row_dual = np.asarray(row_dual) if found and model.relaxed else None
    if values is not None and start is not None:
        # HiGHS 1.16 can report the optimum yet hand back the start's values (seen when presolve solves the
        # whole model): trust the values only when their objective is the one reported, else solve again
        # without the start (when there is time for it; else the start is kept, not proven)
        recomputed = float(np.dot(model.col_cost, values))
        if abs(recomputed - objective) > 1e-6 * max(1.0, abs(objective)):
            if deadline.passed():
                return False, False, math.nan, None, None
            return solve_highs(model, deadline, gap, None)
    return found, finished, objective, bound, values


def _highs_arrays(model, start) -> dict:
    """The model as arrays for :func:`_highs_instance` (with the column values ``start`` as its start)."""
    start_row, index, value = model.matrix
    arrays = {name: np.asarray(getattr(model, name), dtype=float)
              for name in ("col_cost", "col_lower", "col_upper", "row_lower", "row_upper")}
    arrays.update(start=start_row.astype(np.int32), index=index, value=value, offset=model.objective_offset,
                  integral=None if model.relaxed else np.asarray(model.col_integer, dtype=bool),
                  solution=None if start is None else np.asarray(start, dtype=float))
    return arrays


def _highs_here(model, options, start, deadline):
    """Solve in this process (a thread Ctrl-C interrupts): the outcome tuple of :func:`_highs_outcome`."""
    highspy = _highspy()
    arrays = _highs_arrays(model, start)
    left = deadline.left()
    if left is not None:
        options = dict(options, time_limit=max(0.01, left))
    highs = _highs_instance(highspy, arrays, options)
    highs.HandleUserInterrupt = True  # lets cancelSolve stop it
    run_interruptibly(highs.run, highs.cancelSolve)
    return _highs_outcome(highspy, highs, model.relaxed)


def _highs_child(model, options, start, deadline):
    """Solve in a child process (see :func:`solve_highs`): the outcome tuple, or None when it was killed at
    the deadline."""
    left = deadline.left()
    job = pickle.dumps({"arrays": _highs_arrays(model, start), "options": options, "relaxed": model.relaxed,
                        "deadline": None if left is None else time.monotonic() + left},
                       protocol=pickle.HIGHEST_PROTOCOL)
    try:
        child = subprocess.Popen([sys.executable, "-c", _HIGHS_CHILD], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError:  # no interpreter to start (an embedded Python): here, then
        return _highs_here(model, options, start, deadline)
    try:
        left = deadline.left()
        try:
            out, err = child.communicate(job, timeout=None if left is None else max(0.1, left + _KILL_GRACE))
        except subprocess.TimeoutExpired:
            return None
    finally:  # killed at the deadline, on Ctrl-C, or on any error here
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode != 0 or not out:
        raise MemschedError(f"checkmate: HiGHS failed in its child process (exit status {child.returncode}): "
                            f"{err.decode(errors='replace').strip()[-300:]}")
    return pickle.loads(out)


def solve_cbc(model, deadline: Deadline, gap, start, relax=False):
    """As :func:`solve_highs`, with the CBC binary bundled with pulp on an MPS file of the same matrix (with
    ``relax`` or a relaxed model: its LP relaxation by CLP's dual simplex, row multipliers in ``row_dual``).
    CBC runs as a child process: killed past the deadline, or on Ctrl-C."""
    from pulp.apis import coin_api

    relax = relax or model.relaxed
    if deadline.passed():
        return False, False, math.nan, None, None
    began = time.perf_counter()
    time_limit = deadline.left()
    path = coin_api.PULP_CBC_CMD.pulp_cbc_path  # the CBC binary bundled with pulp
    highs = _highs_model(model, offset=False, integral=not relax)
    with tempfile.TemporaryDirectory(prefix="memsched-cbc-") as folder:
        mps, solution, mipstart = (os.path.join(folder, name) for name in ("model.mps", "model.sol", "start.mst"))
        sys.stdout.flush()
        highs.writeModel(mps)
        args = [path, mps]
        if start is not None:
            with open(mipstart, "w") as out:
                out.write("Stopped on time - objective value 0\n")
                out.writelines(f"{col:>7} c{col} {value:>15} {0:>23}\n" for col, value in enumerate(start))
            args += ["-mips", mipstart]
        if time_limit is not None:  # CBC's clock starts after it read the file: leave it time for that
            writing = time.perf_counter() - began
            if time_limit - 2.0 * writing <= 0.0:  # no time left for CBC to read the file and solve
                return False, False, math.nan, None, None
            args += ["-timeMode", "elapsed", "-sec", str(max(0.1, 0.9 * time_limit - 2.0 * writing))]
        args += ["-ratio", str(gap), "-allow", "0", "-threads", str(_THREADS)]
        args += ["-solve" if not relax else "-dualSimplex", "-printingOptions", "all", "-solution", solution]
        # CBC overruns "-sec" in phases it does not check the clock (seen: 99 s for 60 s at 300 nodes); past
        # the limit it is stopped, and the caller falls back on the start schedule, which is feasible
        hard_limit = None if time_limit is None else max(0.1, deadline.left() + _KILL_GRACE)
        try:
            run = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True, check=False, timeout=hard_limit)
        except subprocess.TimeoutExpired:
            return False, False, math.nan, None, None
        log = run.stdout
        if not os.path.exists(solution):
            raise MemschedError(f"checkmate: CBC failed (exit status {run.returncode}): {log.strip()[-300:]}")
        with open(solution) as text:
            lines = text.read().splitlines()
    head = lines[0] if lines else ""
    values = np.zeros(len(model.col_lower))
    duals = np.zeros(len(model.row_lower))
    pattern = re.compile(r"^\**\s*(\d+)\s+([cr])(\d+)\s+(\S+)\s+(\S+)")
    for line in lines[1:]:
        match = pattern.match(line.strip())
        if match and match.group(2) == "c":
            values[int(match.group(3))] = float(match.group(4))
        elif match:
            duals[int(match.group(3))] = float(match.group(5))
    infeasible = head.startswith("Infeasible") or "Result - Problem proven infeasible" in log
    found = not infeasible and (head.startswith("Optimal") or (
        head.startswith("Stopped") and "objective value" in head and "no integer" not in head))
    finished = infeasible or "Result - Optimal solution found" in log or (relax and head.startswith("Optimal"))
    model.row_dual = duals if relax and found and finished else None
    objective = float(head.rsplit("objective value", 1)[1]) if found else math.nan
    bound = None
    for line in log.splitlines():
        if line.startswith("Lower bound:"):
            bound = float(line.split(":")[1])
    return found, finished, objective, bound, values if found else None


def _highs_instance(highspy, arrays, options):
    """A HiGHS instance with the model of ``arrays`` (:func:`_highs_arrays`: row-wise matrix,
    integrality, offset and an optional start ``solution``) and ``options``. Self-contained: the HiGHS child
    process runs its source (``_HIGHS_CHILD``)."""
    lp = highspy.HighsLp()
    lp.num_col_ = len(arrays["col_cost"])
    lp.num_row_ = len(arrays["row_lower"])
    lp.col_cost_ = arrays["col_cost"]
    lp.col_lower_ = arrays["col_lower"]
    lp.col_upper_ = arrays["col_upper"]
    lp.row_lower_ = arrays["row_lower"]
    lp.row_upper_ = arrays["row_upper"]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = arrays["start"]
    lp.a_matrix_.index_ = arrays["index"]
    lp.a_matrix_.value_ = arrays["value"]
    if arrays["integral"] is not None:
        lp.integrality_ = [highspy.HighsVarType.kInteger if integer else highspy.HighsVarType.kContinuous
                           for integer in arrays["integral"]]
    if arrays["offset"]:
        lp.offset_ = arrays["offset"]
    highs = highspy.Highs()
    for key, value in options.items():
        highs.setOptionValue(key, value)
    highs.passModel(lp)
    if arrays["solution"] is not None:
        solution = highspy.HighsSolution()
        solution.col_value = arrays["solution"].tolist()
        solution.value_valid = True
        highs.setSolution(solution)
    return highs


def _highs_outcome(highspy, highs, relaxed):
    """``(status, primal_valid, objective, dual_bound, col_values, row_dual)`` of a solved HiGHS instance: status
    "optimal", "infeasible" or HiGHS's name; values only when there is a primal solution (row multipliers for a
    relaxed model). Self-contained, as :func:`_highs_instance`."""
    status = highs.getModelStatus()
    name = ("optimal" if status == highspy.HighsModelStatus.kOptimal else
            "infeasible" if status == highspy.HighsModelStatus.kInfeasible else str(status))
    info = highs.getInfo()
    valid = info.primal_solution_status == 2
    solution = highs.getSolution() if valid else None
    return (name, valid, float(info.objective_function_value), float(info.mip_dual_bound),
            None if solution is None else list(solution.col_value),
            list(solution.row_dual) if solution is not None and relaxed else None)


_HIGHS_CHILD_MAIN = """
import os, pickle, sys, time
out = os.fdopen(os.dup(1), "wb")  # the result; HiGHS's banner goes to /dev/null
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
try:  # killed with the parent
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except Exception:
    pass
import highspy
job = pickle.load(sys.stdin.buffer)
options = dict(job["options"])
highs = _highs_instance(highspy, job["arrays"], options)
if job["deadline"] is not None:
    highs.setOptionValue("time_limit", max(0.01, job["deadline"] - time.monotonic()))
highs.run()
pickle.dump(_highs_outcome(highspy, highs, job["relaxed"]), out, protocol=pickle.HIGHEST_PROTOCOL)
out.flush()
"""


def _child_script() -> str:
    """The HiGHS child process's program: :func:`_highs_instance`, :func:`_highs_outcome` and the main part (their
    source read once, at import, while it is the code running here)."""
    return "\n".join([inspect.getsource(_highs_instance), inspect.getsource(_highs_outcome), _HIGHS_CHILD_MAIN])


_HIGHS_CHILD = _child_script()

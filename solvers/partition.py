"""Partition: the fastest contiguous split of a chain onto pipeline devices, with recomputation per device.

Input: a chain profile (one micro-batch), ``P`` devices of ``memory`` bytes each, ``m`` micro-batches, the
schedule (``1f1b`` or ``gpipe``), the activation channel between neighbours and the training setup
(planner.setup.training.TrainingSetup). Output (:func:`partition`): a plan of kind ``pipeline``, per device its
stages ``[first, last)`` and its own schedule (store-all, the least-memory schedule or Rotor's, judged by the
exact device peak of planner/simulate/pipeline.py). :func:`solve_partition` is exact: a min-sum dynamic program
per candidate bottleneck ``β``. An infeasible problem is a one-line :class:`MemschedError` with the smallest
device memory that would fit. docs/solvers.md derives the model, the options and the program.
"""

import time
from dataclasses import asdict
from typing import NamedTuple

import numpy as np

from planner.chain import Chain
from planner.errors import MemschedError
from planner.plan import Pipeline, PipelineDevice, Plan, Predicted, check_micro_batches
from planner.setup.training import TrainingSetup
from planner.simulate.chain import ChainSimulator
from planner.simulate.pipeline import (
    PIPELINE_SCHEDULES,
    DeviceState,
    MicroBatch,
    device_peak,
    device_result,
    device_state,
    in_flight,
    micro_batch,
    pipeline_time,
    sends,
    sub_chain,
    sync_seconds,
    to_global,
)
from planner.units import format_bytes
from solvers.extremes import store_all_schedule
from solvers.minimum import least_memory_schedule, minimum_budget
from solvers.rotor import DEFAULT_SLOTS, best_choice, compute_table, discretise, final_state_fits
from solvers.rotor_model import build_schedule

BATCH = 64  # β values per numpy batch
MAX_STAGES = 128  # longest chain partitioned: every range is simulated (40 stages ~16 s, 100 stages ~2 min here)
SLACK = 1e-9  # relative: store-all's time bounds any schedule's from below up to float rounding


class Option:
    """A device's schedule for one range at one in-flight count: ``kind`` store_all | rotor | least_memory."""

    __slots__ = ("kind", "local_schedule", "result")

    def __init__(self, kind, local_schedule, result):
        self.kind, self.local_schedule, self.result = kind, local_schedule, result

    @property
    def time(self) -> float:
        return self.result.time


class StageRange(NamedTuple):
    """Stages ``[a, b)`` as a device runs them: their standalone sub-chain, the device's state, and store-all's
    schedule of the sub-chain with its micro-batch."""

    chain: Chain
    state: DeviceState
    store_all: tuple
    store_all_micro: MicroBatch


class LeastMemory(NamedTuple):
    """The least-memory schedule of a range's sub-chain: its least memory for one micro-batch (bytes), the
    schedule and its micro-batch."""

    nbytes: int
    schedule: tuple
    micro: MicroBatch


class PartitionProblem:
    """The options of every stage range on every device of one pipeline problem (cached)."""

    def __init__(self, chain: Chain, devices: int, memory: int, micro_batches: int, schedule: str = "1f1b",
                 bandwidth=None, latency: float = 0.0, setup: TrainingSetup = None, slots: int = DEFAULT_SLOTS):
        if schedule not in PIPELINE_SCHEDULES:
            raise MemschedError(f"partition: schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise MemschedError(f"partition: devices must be a whole number >= 1, got {devices!r}")
        check_micro_batches(micro_batches, "partition: micro_batches (--micro-batches)")
        if chain.length > MAX_STAGES:
            raise MemschedError(f"partition: chain '{chain.name}' has {chain.length} stages, more than the "
                                f"{MAX_STAGES} it partitions (each of its L(L+1)/2 stage ranges is solved and "
                                "simulated: 100 stages take about 2 minutes); profile the model in fewer, coarser "
                                "stages")
        if devices > chain.length:
            raise MemschedError(f"partition: {devices} devices for chain '{chain.name}' of {chain.length} stages; "
                                "each device needs at least one stage: use at most that many devices")
        if schedule == "1f1b" and micro_batches < devices:
            raise MemschedError(f"partition: 1F1B needs at least as many micro-batches as devices ({micro_batches} < "
                                f"{devices}; PyTorch's Schedule1F1B refuses fewer): give more micro-batches, or the "
                                "gpipe schedule")
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
            raise MemschedError(f"partition: device memory must be a whole number of bytes >= 1, got {memory!r}")
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < float("inf"):
            raise MemschedError(f"partition: latency must be a finite number of seconds >= 0, got {latency!r}")
        if bandwidth is not None and not bandwidth > 0:
            raise MemschedError(f"partition: bandwidth must be bytes per second > 0 (or None), got {bandwidth!r}")
        self.chain, self.devices, self.memory, self.micro_batches = chain, devices, memory, micro_batches
        self.schedule, self.bandwidth, self.latency = schedule, bandwidth, float(latency)
        self.setup, self.slots = setup or TrainingSetup(), slots
        if self.setup.update != "after":
            raise MemschedError(f"partition: update {self.setup.update!r}: a pipeline accumulates gradients over "
                                "micro-batches, which an update inside the backward cannot honour; update after it")
        self.length = chain.length
        self.rotor_calls = 0
        self._ranges, self._least, self._tables, self._rotors = {}, {}, {}, {}
        self._store_peaks, self._least_peaks = {}, {}

    def in_flight(self, device: int) -> int:
        """In-flight micro-batches of ``device``: forwards it starts before its first backward."""
        return in_flight(self.schedule, self.micro_batches, self.devices, device)

    def positions(self):
        """``(s, a, b)`` for every range ``[a, b)`` device ``s`` can hold (every device keeps a stage)."""
        P, L = self.devices, self.length
        for s in range(P):
            for a in range(s, L - (P - 1 - s)):
                for b in range(a + 1, L - (P - 1 - s) + 1):
                    yield s, a, b

    def stage_range(self, a: int, b: int) -> StageRange:
        """Stages ``[a, b)`` on a device (cached)."""
        if (a, b) not in self._ranges:
            state = device_state(self.chain, a, b, self.setup, self.micro_batches)
            sub = sub_chain(self.chain, a, b)
            store = store_all_schedule(b - a)
            self._ranges[a, b] = StageRange(sub, state, store, micro_batch(self.chain, a, b, store, state, sub))
        return self._ranges[a, b]

    def micro(self, a: int, b: int, schedule):
        """The micro-batch of a schedule (local stage indices) of ``[a, b)``."""
        stages = self.stage_range(a, b)
        return micro_batch(self.chain, a, b, schedule, stages.state, stages.chain)

    def least(self, a: int, b: int) -> LeastMemory:
        """The least-memory schedule of the sub-chain of ``[a, b)`` (cached)."""
        if (a, b) not in self._least:
            chain = self.stage_range(a, b).chain
            schedule = least_memory_schedule(chain)
            self._least[a, b] = LeastMemory(minimum_budget(chain), schedule, self.micro(a, b, schedule))
        return self._least[a, b]

    def _make(self, kind, a, b, k, schedule, micro) -> Option:
        result = device_result(self.chain, a, b, schedule, self.schedule, k, self.micro_batches, self.setup,
                               self.bandwidth, self.latency, micro, self.stage_range(a, b).state)
        return Option(kind, schedule, result)

    def sync(self, a: int, b: int) -> float:
        """Seconds per step a device on ``[a, b)`` spends summing its copies of shared parameters' gradients."""
        return sync_seconds(self.chain, a, b, self.setup, self.bandwidth, self.latency)

    def lower_time(self, a: int, b: int) -> float:
        """Seconds per micro-batch of store-all on ``[a, b)``: no schedule of it is faster."""
        return self.stage_range(a, b).store_all_micro.compute + sends(self.chain, a, b, self.bandwidth, self.latency)

    def peak(self, a: int, b: int, k: int, micro) -> int:
        """The exact device peak of a micro-batch (a schedule's) on ``[a, b)`` with ``k`` forwards before the first
        backward."""
        return device_peak(micro, self.schedule, k, self.micro_batches, self.stage_range(a, b).state)

    def store_all_peak(self, a: int, b: int, k: int) -> int:
        """The device peak of store-all on ``[a, b)`` with ``k`` forwards before the first backward (cached)."""
        if (a, b, k) not in self._store_peaks:
            self._store_peaks[a, b, k] = self.peak(a, b, k, self.stage_range(a, b).store_all_micro)
        return self._store_peaks[a, b, k]

    def store_all(self, a: int, b: int, k: int):
        """The store-all option when it fits, else None."""
        if self.store_all_peak(a, b, k) <= self.memory:
            stages = self.stage_range(a, b)
            return self._make("store_all", a, b, k, stages.store_all, stages.store_all_micro)
        return None

    def least_memory_peak(self, a: int, b: int, k: int) -> int:
        """The exact device peak of the least-memory schedule on ``[a, b)`` (cached)."""
        if (a, b, k) not in self._least_peaks:
            self._least_peaks[a, b, k] = self.peak(a, b, k, self.least(a, b).micro)
        return self._least_peaks[a, b, k]

    def least_option(self, a: int, b: int, k: int):
        """The least-memory schedule when its exact peak fits, else None."""
        if self.least_memory_peak(a, b, k) > self.memory:
            return None
        least = self.least(a, b)
        return self._make("least_memory", a, b, k, least.schedule, least.micro)

    def _table(self, a: int, b: int):
        """Rotor's table for the sub-chain of ``[a, b)`` (solvers/rotor.py, ``slots`` units) up to its store-all
        peak, and its least feasible level: ``(arrays, opt, lowest, top)``, or None (cached)."""
        if (a, b) not in self._tables:
            stages = self.stage_range(a, b)
            chain = stages.chain
            _, arrays, top = discretise(chain, ChainSimulator(chain).run(stages.store_all).peak_bytes, self.slots)
            self.rotor_calls += 1
            opt = compute_table(arrays, top) if top >= 0 else None
            finite = np.flatnonzero(np.isfinite(opt[0, chain.length])) if opt is not None else ()
            lowest = next((int(level) for level in finite if final_state_fits(arrays, int(level))), None)
            self._tables[a, b] = None if lowest is None else (arrays, opt, lowest, top)
        return self._tables[a, b]

    def _rotor_at(self, a: int, b: int, level: int):
        """Rotor's schedule at one level of its table and its micro-batch (cached)."""
        if (a, b, level) not in self._rotors:
            arrays, opt, _, _ = self._table(a, b)
            schedule = build_schedule(arrays, lambda i, end, m: best_choice(arrays, opt, i, end, m), level)
            self._rotors[a, b, level] = schedule, self.micro(a, b, schedule)
        return self._rotors[a, b, level]

    def rotor_option(self, a: int, b: int, k: int):
        """Rotor's schedule at the highest level of its table whose exact device peak fits (found by bisection:
        more memory per micro-batch, a higher peak), or None."""
        table = self._table(a, b)
        if table is None:
            return None
        _, _, low, high = table
        found = None
        while low <= high:
            level = (low + high) // 2
            schedule, micro = self._rotor_at(a, b, level)
            if self.peak(a, b, k, micro) <= self.memory:
                found, low = (schedule, micro), level + 1
            else:
                high = level - 1
        return None if found is None else self._make("rotor", a, b, k, *found)

    def option(self, a: int, b: int, k: int):
        """The device's schedule for ``[a, b)`` at ``k`` in flight (docs/solvers.md), or None if nothing fits."""
        found = self.store_all(a, b, k)
        if found is not None:
            return found
        least, rotor = self.least_option(a, b, k), self.rotor_option(a, b, k)
        if rotor is None or (least is not None and least.time < rotor.time):
            return least
        return rotor

    def requirement(self, a: int, b: int, k: int) -> int:
        """The least device memory at which ``[a, b)`` fits with ``k`` forwards before the first backward: the
        exact peak of store-all or of the least-memory schedule."""
        return min(self.store_all_peak(a, b, k), self.least_memory_peak(a, b, k))


def _min_sum(times: np.ndarray, bounds: np.ndarray, syncs: np.ndarray):
    """For each bound β: the least left-to-right sum of ``t_s + sync_s`` over partitions with every ``t_s <= β``
    (inf if none), and the argmin tables ``(K, P, L+1)`` to read the partition back."""
    P, size, _ = times.shape
    K = len(bounds)
    f = np.full((K, size), np.inf)
    f[:, 0] = 0.0
    choices = np.empty((K, P, size), dtype=np.int64)
    costs = times + syncs
    for s in range(P):
        masked = np.where(times[s][None, :, :] <= bounds[:, None, None], costs[s][None, :, :], np.inf)
        total = f[:, :, None] + masked  # (K, a, b)
        choices[:, s, :] = np.argmin(total, axis=1)
        f = np.take_along_axis(total, choices[:, s, None, :], axis=1)[:, 0, :]
    return f[:, -1], choices


def _min_max(values: np.ndarray):
    """Least over partitions of the largest ``values[s, a, b]``, and the partition."""
    P, size, _ = values.shape
    g = np.full(size, np.inf)
    g[0] = -np.inf
    choices = np.empty((P, size), dtype=np.int64)
    for s in range(P):
        total = np.maximum(g[:, None], values[s])
        choices[s] = np.argmin(total, axis=0)
        g = total[choices[s], np.arange(size)]
    return g[-1], choices


def _read_back(choices: np.ndarray, length: int) -> list:
    """``[(a_s, b_s)]`` from argmin tables ``(P, L+1)``."""
    bounds, b = [], length
    for s in reversed(range(choices.shape[0])):
        a = int(choices[s, b])
        bounds.append((a, b))
        b = a
    return bounds[::-1]


def min_max_partition(values: np.ndarray):
    """``(value, [(a_s, b_s), ...])``: the contiguous partition into ``values.shape[0]`` parts minimising the
    largest ``values[s, a, b]`` (part ``s`` on stages ``[a, b)``), as torchgpipe's balance-by-time does."""
    best, choices = _min_max(values)
    return best, _read_back(choices, values.shape[1] - 1)


def best_partition(times: np.ndarray, micro_batches: int, syncs: np.ndarray = None):
    """``(T, [(a_s, b_s)])``: the least ``(m - 1) * max t + sum (t + sync)`` over partitions for tables
    ``times[s, a, b]`` (inf: not allowed) and ``syncs[a, b]`` (seconds per step; none: 0), or ``(inf, None)``."""
    P, size, _ = times.shape
    syncs = np.zeros((size, size)) if syncs is None else syncs
    finite = np.unique(times[np.isfinite(times)])
    if finite.size == 0:
        return np.inf, None
    bottleneck, _ = _min_max(times)
    if not np.isfinite(bottleneck):
        return np.inf, None
    unbounded, _ = _min_sum(times, np.array([np.inf]), syncs)
    candidates = finite[finite >= bottleneck]
    best, best_parts = np.inf, None
    for start in range(0, len(candidates), BATCH):
        bounds = candidates[start:start + BATCH]
        if (micro_batches - 1) * bounds[0] + unbounded[0] > best:
            break
        sums, choices = _min_sum(times, bounds, syncs)
        totals = (micro_batches - 1) * bounds + sums
        index = int(np.argmin(totals))
        if totals[index] < best:
            parts = _read_back(choices[index], size - 1)
            # the partition's own T (its bottleneck may be below the bound): at most the bound's value
            true = pipeline_time([float(times[s, a, b]) for s, (a, b) in enumerate(parts)], micro_batches,
                                 [float(syncs[a, b]) for a, b in parts])
            if true < best:
                best, best_parts = true, parts
    return best, best_parts


class PartitionSolution:
    """What :func:`solve_partition` found: the partition, each device's option, and counters."""

    def __init__(self, problem, parts, options, rotor_calls, seconds):
        self.problem, self.parts, self.options = problem, parts, options
        self.rotor_calls, self.seconds = rotor_calls, seconds

    @property
    def time(self) -> float:
        return pipeline_time([o.time for o in self.options], self.problem.micro_batches,
                             [o.result.sync for o in self.options])


def least_device_memory(problem: PartitionProblem, store_all: bool = False) -> int:
    """The smallest device memory at which some partition fits (``store_all``: with store-all on every device):
    the least over partitions of the largest requirement (:meth:`PartitionProblem.requirement`)."""
    P, size = problem.devices, problem.length + 1
    need = np.full((P, size, size), np.inf)
    for s, a, b in problem.positions():
        k = problem.in_flight(s)
        if store_all:
            need[s, a, b] = problem.store_all_peak(a, b, k)
        else:
            need[s, a, b] = problem.requirement(a, b, k)
    smallest, _ = _min_max(need)
    return int(smallest)


def _infeasible(problem: PartitionProblem) -> MemschedError:
    P = problem.devices
    smallest = least_device_memory(problem)
    chain = problem.chain
    return MemschedError(
        f"partition: no split of chain '{chain.name}' ({chain.length} stages) onto {P} devices fits "
        f"{format_bytes(problem.memory)} ({problem.memory} bytes) per device with {problem.schedule} and "
        f"{problem.micro_batches} micro-batches; the smallest device memory that fits is {format_bytes(smallest)} "
        f"({smallest} bytes): raise it, or use more devices or fewer micro-batches")


def _prefix_suffix(times: np.ndarray):
    """``pre[s, a]``: least sum over devices ``0..s-1`` covering stages ``[0, a)``; ``suf[s, b]``: over devices
    ``s+1..P-1`` covering ``[b, L)``."""
    P, size, _ = times.shape
    pre = np.full((P, size), np.inf)
    suf = np.full((P, size), np.inf)
    pre[0, 0] = 0.0
    for s in range(1, P):
        pre[s] = np.min(pre[s - 1][:, None] + times[s - 1], axis=0)
    suf[P - 1, size - 1] = 0.0
    for s in range(P - 2, -1, -1):
        suf[s] = np.min(times[s + 1] + suf[s + 1][None, :], axis=1)
    return pre, suf


def solve_partition(problem: PartitionProblem) -> PartitionSolution:
    """The exact optimum of the model (docs/solvers.md).

    Rotor is run only where it may matter: every range starts with an upper bound (store-all when it fits, else
    the least-memory schedule) and a lower bound (store-all's time); the DP's partition over the upper bounds
    has its ranges solved exactly until it is made of exact options only (its ``T`` is then achievable); a
    range whose ``m * t_lower`` plus the least sum of lower bounds of the devices before and after it exceeds
    that ``T`` cannot be in an optimal partition (``T >= m * t_s + sum of the others``) and is dropped; every
    other range is solved exactly, and the DP runs once more on exact times.
    """
    started = time.perf_counter()
    P, L, m = problem.devices, problem.length, problem.micro_batches
    size = L + 1
    times = np.full((P, size, size), np.inf)  # exact where `exact`, else an upper bound
    lower = np.full((P, size, size), np.inf)
    exact = np.zeros((P, size, size), dtype=bool)
    syncs = np.zeros((size, size))
    for s, a, b in problem.positions():
        k = problem.in_flight(s)
        syncs[a, b] = problem.sync(a, b)
        found = problem.store_all(a, b, k)
        exact[s, a, b] = found is not None
        if found is None:
            found = problem.least_option(a, b, k)
            if found is None:  # only a Rotor schedule may fit: decide it now
                found, exact[s, a, b] = problem.option(a, b, k), True
        if found is not None:
            times[s, a, b] = found.time
            lower[s, a, b] = problem.lower_time(a, b)
        else:
            exact[s, a, b] = True  # nothing fits: inf is exact
    while True:
        t_upper, parts = best_partition(times, m, syncs)
        if not np.isfinite(t_upper):
            raise _infeasible(problem)
        pending = [(s, a, b) for s, (a, b) in enumerate(parts) if not exact[s, a, b]]
        if not pending:
            break
        for s, a, b in pending:
            times[s, a, b], exact[s, a, b] = problem.option(a, b, problem.in_flight(s)).time, True
    pre, suf = _prefix_suffix(lower)
    bound = m * lower + pre[:, :, None] + suf[:, None, :]
    for s, a, b in zip(*np.nonzero(~exact)):
        s, a, b = int(s), int(a), int(b)
        if bound[s, a, b] > t_upper * (1 + SLACK):
            times[s, a, b] = np.inf  # never in an optimal partition
        else:
            times[s, a, b] = problem.option(a, b, problem.in_flight(s)).time
    _, parts = best_partition(times, m, syncs)
    options = [problem.option(a, b, problem.in_flight(s)) for s, (a, b) in enumerate(parts)]
    return PartitionSolution(problem, parts, options, problem.rotor_calls, time.perf_counter() - started)


def partition_plan(solution: PartitionSolution) -> Plan:
    """The plan of kind ``pipeline`` for a solution; its figures are the pipeline simulator's."""
    problem, chain = solution.problem, solution.problem.chain
    devices = tuple(PipelineDevice(first=a, last=b, schedule=to_global(o.local_schedule, a),
                                   peak_bytes=o.result.peak_bytes, time=o.result.time)
                    for (a, b), o in zip(solution.parts, solution.options))
    baseline = pipeline_time([sub_chain(chain, a, b).compute_time + sends(chain, a, b, problem.bandwidth,
                                                                             problem.latency)
                              for a, b in solution.parts], problem.micro_batches,
                             [o.result.sync for o in solution.options])
    pipeline = Pipeline(schedule=problem.schedule, micro_batches=problem.micro_batches,
                        bandwidth=None if problem.bandwidth is None else float(problem.bandwidth),
                        latency=problem.latency, setup=_setup_fields(problem.setup), devices=devices,
                        shared=chain.shared)
    return Plan(problem_name=chain.name, fingerprint=chain.fingerprint(), solver="partition",
                budget_bytes=problem.memory,
                predicted=Predicted(peak_bytes=max(d.peak_bytes for d in devices), time=solution.time,
                                    baseline_time=baseline),
                schedule=(), params={"devices": problem.devices, "slots": problem.slots,
                                     "options": [o.kind for o in solution.options]},
                solve_seconds=solution.seconds, optimal=True, kind="pipeline", pipeline=pipeline,
                measured_on=chain.measured_on)


def _setup_fields(setup: TrainingSetup) -> dict:
    """A pipeline plan's ``setup``: the fields of its TrainingSetup but the update (always after the backward)."""
    return {field: value for field, value in asdict(setup).items() if field != "update"}


def partition(chain: Chain, devices: int, memory: int, micro_batches: int, schedule: str = "1f1b",
              bandwidth=None, latency: float = 0.0, setup: TrainingSetup = None,
              slots: int = DEFAULT_SLOTS) -> Plan:
    """The fastest pipeline plan for ``chain`` on ``devices`` devices of ``memory`` bytes (docs/solvers.md).

    Args:
        chain: the chain as profiled on one micro-batch (at most :data:`MAX_STAGES` stages).
        devices: the pipeline's devices, from 1 to the chain's stage count; each runs a contiguous range of stages.
        memory: bytes of each device's memory, for everything it holds over the step (parameters, optimizer
            state, gradients and the micro-batches in flight).
        micro_batches: micro-batches per step (at least ``devices`` with ``1f1b``).
        schedule: the pipeline schedule, ``1f1b`` or ``gpipe``.
        bandwidth: bytes per second of the activation channel between neighbouring devices (and of the exchange
            of tied parameters' gradients); None: sends take no time.
        latency: seconds added to each send over it.
        setup: the :class:`planner.setup.TrainingSetup` (its update after the backward); default: its defaults.
        slots: Rotor's units in a device's memory (solvers/rotor.py).

    Returns:
        The :class:`planner.plan.Plan` of kind ``pipeline``: per device its stages and schedule, its figures (peak
        bytes, seconds per step) the pipeline simulator's.

    Raises:
        MemschedError: an unknown schedule; devices, micro-batches, memory, latency or bandwidth out of range; a
            chain longer than :data:`MAX_STAGES`; more devices than stages; ``1f1b`` with fewer micro-batches than
            devices; an update inside the backward; no split fitting ``memory`` (the message states the smallest
            device memory that fits).
    """
    problem = PartitionProblem(chain, devices, memory, micro_batches, schedule, bandwidth, latency, setup, slots)
    return partition_plan(solve_partition(problem))

"""This CPU's :class:`planner.rates.Rates`, measured: fp32 matrix-product FLOP/s (a large square GEMM), memory
bandwidth (an elementwise add of large tensors into a preallocated output: two read, one written) and the fixed
cost of one operation in an eager training step (a forward and backward of tiny layers, whose operations move and
compute next to nothing, per operation the roofline counts in it). Each is the median of a few timed runs after
one untimed (or another ``statistic`` of them: ``min``, the least disturbed run on a shared machine), at a given
thread count (default: torch's). :func:`bare_op_s` is the cost of one operation alone,
without modules or autograd, for comparison. :func:`cpu_device_spec` is this CPU as a target device
(``memsched plan SPEC --device-spec cpu``)."""

import contextlib
import statistics
import time

import torch
from torch import nn

from planner.devices import DeviceSpec
from planner.rates import Rates
from profiles.roofline import roofline

GEMM_SIZE = 1024  # square fp32 matrices: 2 * 1024**3 FLOPs, 4 MiB each (beyond the L2 caches, GEMMs block for them)
STREAM_ELEMENTS = 1 << 24  # fp32 elements per tensor: 64 MiB each, beyond any last-level cache here
TINY_CALLS = 200  # one-element adds per timed run
TINY_LAYERS = 32  # Linear(4, 4) + Tanh layers of the tiny training step

THIS_CPU_NAME = "this-cpu"  # the name of this machine's CPU as a device spec


def measure_cpu_rates(threads: int = None, repeats: int = 5, statistic=statistics.median) -> Rates:
    """The :class:`Rates` of this CPU at ``threads`` threads (None: torch's current number)."""
    with _threads(threads):
        with torch.no_grad():
            flops, memory = gemm_flops_per_s(repeats, statistic), stream_bytes_per_s(repeats, statistic)
        return Rates(flops_per_s=flops, bytes_per_s=memory, op_overhead_s=op_overhead_s(repeats, statistic))


def cpu_device_spec(memory_bytes: int, threads: int = None, repeats: int = 5) -> DeviceSpec:
    """This CPU as a :class:`DeviceSpec` named "this-cpu" of ``memory_bytes`` bytes, its rates measured at
    ``threads`` threads (:func:`measure_cpu_rates`; None: torch's current number): the fp32 FLOP/s for bf16 too
    (not measured apart), the memory bandwidth, which is the host link too, and the cost per operation; storages
    counted as they are (allocator "cpu")."""
    rates = measure_cpu_rates(threads, repeats)
    count = torch.get_num_threads() if threads is None else threads
    return DeviceSpec(THIS_CPU_NAME, memory_bytes, rates.flops_per_s, rates.flops_per_s, rates.bytes_per_s,
                      rates.bytes_per_s, rates.bytes_per_s, "cpu",
                      f"measured here at {count} threads (profiles/cpu_rates.py)", rates.op_overhead_s)


def gemm_flops_per_s(repeats: int = 5, statistic=statistics.median, size: int = GEMM_SIZE) -> float:
    """FLOP/s of an fp32 ``size`` x ``size`` matrix product (``2 * size**3`` FLOPs) into a preallocated output."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    return 2 * size ** 3 / _seconds(lambda: torch.mm(a, b, out=out), repeats, statistic)


def stream_bytes_per_s(repeats: int = 5, statistic=statistics.median, elements: int = STREAM_ELEMENTS) -> float:
    """Bytes per second of ``out = a + b`` on ``elements`` fp32 elements each (12 bytes per element moved)."""
    a, b = torch.randn(elements), torch.randn(elements)
    out = torch.empty(elements)
    return 3 * 4 * elements / _seconds(lambda: torch.add(a, b, out=out), repeats, statistic)


def op_overhead_s(repeats: int = 5, statistic=statistics.median, layers: int = TINY_LAYERS) -> float:
    """Seconds per operation of an eager training step of tiny operations: ``layers`` ``Linear(4, 4)`` + ``Tanh``
    on one row, forward and backward (gradients from None), over the operations :mod:`profiles.roofline` counts in
    it (module calls, autograd's recording and its engine included, as in a real step)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(layers)])
    row = torch.ones(1, 4)

    def step():
        model.zero_grad(set_to_none=True)
        model(row).sum().backward()

    return _seconds(step, repeats, statistic) / roofline(step, Rates(1e12)).ops


def bare_op_s(repeats: int = 5, statistic=statistics.median, calls: int = TINY_CALLS) -> float:
    """Seconds of one ``a + b`` on one-element tensors from Python, no autograd (its output allocated)."""
    a, b = torch.ones(1), torch.ones(1)

    def tiny_ops():
        for _ in range(calls):
            a + b

    return _seconds(tiny_ops, repeats, statistic) / calls


def _seconds(work, repeats: int, statistic) -> float:
    """``statistic`` of the seconds of ``repeats`` runs of ``work()`` after one untimed."""
    work()  # untimed: first-touch page faults, thread pool start
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return statistic(samples)


@contextlib.contextmanager
def _threads(threads):
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

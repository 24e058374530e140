"""Live memory, measured honestly: one meter for the profilers, the executors and the tests.

On CPU :class:`planner.execute.live_memory.LiveMemoryTracker` follows storages itself; on CUDA
``torch.cuda.memory_allocated`` / ``max_memory_allocated`` are the truth. :func:`memory_meter` picks the right
one for a device; :func:`storage_bytes` counts what tensors hold.
"""

import torch

from planner.execute.live_memory import LiveMemoryTracker


class CudaMemoryMeter:
    """The CUDA caching allocator's own figures for one device (bytes)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        return False

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


class ProfilerMemoryMeter:
    """CPU memory of code a dispatch-mode tracker cannot see into (``torch.compile``'s): the allocation and free
    events ``torch.profiler`` records inside the window, added up in time order. ``peak`` (bytes above the
    level at entry) is known once the window has closed; ``current`` is 0 at entry. On an eager step it equals
    the live-memory tracker's peak (tests/execute/test_compiled.py)."""

    def __init__(self):
        self.current = 0
        self.peak = None
        self._profile = None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        events = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]
        level = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            level += event.nbytes()  # negative for a free
            peak = max(peak, level)
        self.peak, self._profile = peak, None
        return False


def memory_meter(device, compiled: bool = False):
    """The meter that tells the truth on ``device``: the allocator's statistics on CUDA, the tracker elsewhere,
    or the profiler's events for ``compiled`` code on CPU (:class:`ProfilerMemoryMeter`).

    All are context managers with ``current`` and ``peak`` (bytes; the profiler's peak once the window has
    closed), the first two with ``reset_peak()``. Compare levels taken inside one window: the tracker counts
    from zero at entry, the CUDA meter from what was already allocated.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMemoryMeter(device)
    return ProfilerMemoryMeter() if compiled else LiveMemoryTracker()


def storage_bytes(tensors, exclude=(), size_of=None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once), minus those in ``exclude``;
    each storage counted as ``size_of(its bytes)`` when given (an allocator's rounding: planner/allocator.py)."""
    return sum(storages(tensors, exclude, size_of).values())


def storages(tensors, exclude=(), size_of=None) -> dict:
    """``{storage key: bytes}`` for the tensors, leaving out storages of the tensors in ``exclude``; the bytes
    ``size_of(bytes)`` when given."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in skip:
            found[storage._cdata] = size_of(storage.nbytes()) if size_of else storage.nbytes()
    return found

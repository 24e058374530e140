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


def memory_meter(device):
    """The meter that tells the truth on ``device``: the allocator's statistics on CUDA, the tracker elsewhere.

    Both are context managers with ``current``, ``peak`` (bytes) and ``reset_peak()``. Compare levels taken
    inside one window: the tracker counts from zero at entry, the CUDA meter from what was already allocated.
    """
    device = torch.device(device)
    return CudaMemoryMeter(device) if device.type == "cuda" else LiveMemoryTracker()


def storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once), minus those in ``exclude``."""
    return sum(storages(tensors, exclude).values())


def storages(tensors, exclude=()) -> dict:
    """``{storage key: bytes}`` for the tensors, leaving out storages of the tensors in ``exclude``."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in skip:
            found[storage._cdata] = storage.nbytes()
    return found

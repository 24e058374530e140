"""Live memory, measured honestly: one tracker for the profiler, the executor and the tests.

On CPU torch keeps no allocator statistics, so :class:`LiveMemoryTracker`
follows storages itself: a ``TorchDispatchMode`` that sees every operation,
counts the storage of each tensor returned by a *non-aliasing* result (views
such as ``t()`` or ``detach()`` of a parameter allocate nothing), keyed by
storage, and releases it through ``weakref.finalize`` when the storage dies.
It reports the bytes allocated since the window opened (current and peak);
what existed before (parameters, the input) is not counted. Open a window with
gradients already ``None`` and optimizer state already created.

On CUDA ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` are the
truth; :func:`memory_meter` picks the right one for a device.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveMemoryTracker(TorchDispatchMode):
    """Bytes of storages allocated inside the ``with`` block and still alive; and their peak."""

    def __init__(self):
        super().__init__()
        self._live = {}  # storage key -> bytes
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for schema, result in zip(func._schema.returns, results):
            if schema.alias_info is None:
                for tensor in result if isinstance(result, (tuple, list)) else (result,):
                    if isinstance(tensor, torch.Tensor):
                        self._allocated(tensor.untyped_storage())
        return out

    def _allocated(self, storage) -> None:
        key = storage._cdata
        if key in self._live:
            return
        size = storage.nbytes()
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._released, key)

    def _released(self, key) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self.peak = self.current


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

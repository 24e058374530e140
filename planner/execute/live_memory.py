"""Live memory on the CPU, where torch keeps no allocator statistics: :class:`LiveMemoryTracker`.

A ``TorchDispatchMode`` that sees every operation, counts the storage of each tensor returned by a
*non-aliasing* result (views such as ``t()`` or ``detach()`` of a parameter allocate nothing), keyed by storage,
and releases it through ``weakref.finalize`` when the storage dies. It reports the bytes allocated since the
window opened (``current`` and ``peak``); what existed before (parameters, the input) is not counted. Open a
window with gradients already ``None`` and optimizer state already created. A storage resized in place
(``UntypedStorage.resize_``, as FSDP2 frees and re-allocates its all-gathered parameters) is followed too: a
counted one changes by the difference, one from before the window counts from when it grows from empty. The
selective-checkpoint policy predicts its peak with it (on fake tensors); the profilers and tests measure with it
(:func:`profiles.memory.memory_meter`). With ``size_of`` each storage counts as that function of its bytes: an
estimate for a CUDA device counts the blocks its allocator would hand out (planner/allocator.py). A fake
tensor's storage (on the ``meta`` device) holds no memory: only a tracker made with ``fake=True`` (an estimate
on fake tensors) counts it, so that a step which traces something on fake tensors (``torch.export`` in a
replanning call) is measured for what it really allocates.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ACTIVE = []  # the trackers inside their ``with`` block, which storage resizes are reported to
_RESIZE = torch.UntypedStorage.resize_


def _resize_seen(storage, size):
    before = storage.nbytes()
    result = _RESIZE(storage, size)
    for tracker in _ACTIVE:
        tracker._resized(storage, before)
    return result


class LiveMemoryTracker(TorchDispatchMode):
    """Bytes of storages allocated inside the ``with`` block and still alive; and their peak. ``size_of(bytes)``:
    the bytes one storage counts as (default: its own); ``fake``: count fake tensors' storages (an estimate),
    else only those that hold memory."""

    def __init__(self, size_of=None, fake: bool = False):
        super().__init__()
        self._size_of = size_of or (lambda size: size)
        self._fake = fake
        self._live = {}  # storage key -> bytes
        self.current = 0
        self.peak = 0
        self.operations = 0  # operations seen (each costs the mode's Python: ~50-70 us on this CPU)

    def __enter__(self):
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _resize_seen
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _RESIZE
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.operations += 1
        results = out if isinstance(out, (tuple, list)) else (out,)
        for schema, result in zip(func._schema.returns, results):
            if schema.alias_info is None:
                for tensor in result if isinstance(result, (tuple, list)) else (result,):
                    if isinstance(tensor, torch.Tensor):
                        self._allocated(tensor.untyped_storage())
        return out

    def _allocated(self, storage) -> None:
        key = storage._cdata
        if key in self._live or (storage.device.type == "meta" and not self._fake):
            return
        size = self._size_of(storage.nbytes())
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._released, key)

    def _resized(self, storage, before: int) -> None:
        key = storage._cdata
        if key in self._live:
            size = self._size_of(storage.nbytes())
            self.current += size - self._live[key]
            self._live[key] = size
            self.peak = max(self.peak, self.current)
        elif before == 0:
            self._allocated(storage)

    def _released(self, key) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        self.peak = self.current

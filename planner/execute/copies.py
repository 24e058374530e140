"""Copy engines between device and host memory, for the offload executor (docs/execution.md, "Offload executor").

:func:`copies_for` gives the engine of a device: on CPU synchronous copies whose host side is a NumPy array
(outside the live-memory tracker's device accounting); on CUDA one copy stream per direction, pinned host
buffers and events. Each copy returns ``(result, event or None)``; ``wait(event)`` makes the compute stream wait.
"""

import torch

from planner.errors import MemschedError


def bytes_of(storage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (allocates nothing)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def numpy_backed(tensor) -> torch.Tensor:
    """A CPU tensor, the same view as ``tensor``, over a NumPy copy of its storage: the live-memory tracker does
    not count it (no operation made it)."""
    array = bytes_of(tensor.untyped_storage()).numpy().copy()
    return torch.empty(0, dtype=tensor.dtype).set_(torch.from_numpy(array).untyped_storage(),
                                                   tensor.storage_offset(), tensor.size(), tensor.stride())


def copies_for(device, engines: dict):
    """The copy engine of ``device``, made once per ``engines`` dict (one per step)."""
    device = torch.device(device)
    if device not in engines:
        if device.type == "cuda":
            engines[device] = CudaCopies(device)
        elif device.type == "cpu":
            engines[device] = HostCopies()
        else:
            raise MemschedError(f"offload plans run on CPU and CUDA, not on {device.type}")
    return engines[device]


class HostCopies:
    """CPU: synchronous copies; the host copy is a NumPy array, invisible to the device accounting."""

    def to_host(self, storage):
        return bytes_of(storage).numpy().copy(), None

    def to_device(self, host, device):
        target = torch.empty(host.shape[0], dtype=torch.uint8, device=device)
        target.copy_(torch.from_numpy(host))
        return target.untyped_storage(), None

    def tensor_to_device(self, host, device):
        return host.clone(), None  # counted by the tracker, as a device allocation is

    def tensor_to_host(self, tensor):
        return numpy_backed(tensor), None

    def wait(self, event) -> None:
        pass


class CudaCopies:
    """CUDA: one copy stream per direction, pinned host buffers, events (docs/execution.md)."""

    _streams = {}  # device index -> (d2h stream, h2d stream), reused across steps

    def __init__(self, device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        if device.index not in self._streams:
            self._streams[device.index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.d2h, self.h2d = self._streams[device.index]

    def to_host(self, storage):
        source = bytes_of(storage)
        host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
        self.d2h.wait_stream(self.compute)  # the data has been written
        with torch.cuda.stream(self.d2h):
            host.copy_(source, non_blocking=True)
        return host, self.d2h.record_event()

    def to_device(self, host, device):
        with torch.cuda.stream(self.compute):  # allocated for the compute stream, which frees it later
            target = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        self.h2d.wait_stream(self.compute)  # the block may have been in use on the compute stream until now
        with torch.cuda.stream(self.h2d):
            target.copy_(host, non_blocking=True)
        return target.untyped_storage(), self.h2d.record_event()

    def tensor_to_device(self, host, device):
        """A device copy of a (pinned) host tensor, same view; the h2d stream writes it."""
        with torch.cuda.stream(self.compute):
            target = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)
        self.h2d.wait_stream(self.compute)
        with torch.cuda.stream(self.h2d):
            target.copy_(host, non_blocking=True)
        return target, self.h2d.record_event()

    def tensor_to_host(self, tensor):
        """A pinned host copy of a device tensor; the d2h stream reads it once the compute stream has written it."""
        host = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, pin_memory=True)
        self.d2h.wait_stream(self.compute)
        with torch.cuda.stream(self.d2h):
            host.copy_(tensor, non_blocking=True)
        return host, self.d2h.record_event()

    def wait(self, event) -> None:
        self.compute.wait_event(event)

"""Offload plans in the chain executor: items moved between device and host as the plan says.

An offload plan (planner/plan.py) adds ``Offload``, ``Release`` and ``Prefetch``
of *items* to a chain schedule: ``saved i`` is ``ā_{i+1}``, everything ``F_all
i`` keeps for its backward, its output ``a_{i+1}`` included; ``input i`` is
``a_i`` held on its own (made by ``F_ck`` / ``F_none`` i-1), i >= 1. The chain
executor (planner/execute/chain.py) runs such a plan with :class:`OffloadRun`, and
only such a plan: without transfer operations no hook is installed and nothing
here runs.

**Items and tensors.** Each item is a *box* of storages (a storage is counted
once, whatever views of it exist, as the profiler and the memory tracker count
it). ``F_all i`` runs under ``torch.autograd.graph.saved_tensors_hooks``: the
pack hook puts each saved tensor's storage in the box of ``saved i``, or, when
that storage already belongs to an item (the stage's own input ``a_i``, which
the chain model counts in ``ā_i`` or in the standalone ``a_i``), in that item;
parameters (but those of host-weight stages, below), buffers and the caller's
inputs (``a_0`` and the extra arguments) are never boxed. Autograd keeps only
a small handle (the box's storage, dtype, size, strides, offset); the unpack
hook rebuilds the tensor on the box's current device storage, and fails with
a one-line :class:`MemschedError` naming the item when that item is on the
host (the plan lacks a ``Prefetch``). The executor's own references go through the same boxes: the
outputs of ``F_ck`` / ``F_none`` (``input i+1``) and of ``F_all`` (inside
``saved i``) are held as handles, and rebuilt for the operations that read
them; the fresh leaf an ``F_all`` runs on gives its storage back once the stage
has run (autograd reaches the leaf only for its gradient). A storage lives
while any handle on it does (autograd frees saved tensors as the backward
goes, as in a plain step), so ``Release`` really frees the device memory, and
nothing is left in any box once the step ends.

**Transfers.**

* ``Offload i what`` copies every storage of the item to the host; the device
  copy stays readable.
* ``Release i what`` waits for those copies to end, then drops the device
  storages.
* ``Prefetch i what`` allocates the device storages at once, at the operation
  the plan names, and copies the host copies back (which are then dropped); the
  first operation that reads the item waits for its copy.

On CUDA each direction has its own copy stream (one pair per device, reused),
host copies are in pinned memory, and everything is ordered by events:
``Offload`` makes the device-to-host stream wait for the compute stream (the
data is written) and records the copy's end; ``Release`` makes the compute
stream wait for that end before the device storage is dropped; ``Prefetch``
allocates on the compute stream, makes the host-to-device stream wait for the
compute stream (the memory may have been in use until then), copies, and
records the end, which the first reader makes the compute stream wait for. A
device storage is never dropped while a copy may still read or write it: a
storage that dies otherwise (its last handle gone) first makes the compute
stream wait for any copy of it still pending. A pinned host buffer given to a
host-to-device copy is dropped at once; PyTorch's pinned-memory allocator does
not reuse it before the copy has ended.

On CPU the same code runs with the copies synchronous at ``Offload`` and
``Prefetch``; the host copy is a NumPy array (``Tensor.numpy().copy()``),
which the live-memory tracker (profiles/memory.py) does not count as device
memory, and ``Prefetch`` allocates a tensor (counted) and copies into it.

**Weights and gradients (host-weight stages).** A plan may also move the
trainable parameters of a stage (the ZeRO-Offload / FSDP CPU-offload
pattern): ``weights i`` (``param_bytes`` of stage i) and, after ``B i``,
``grads i`` (its parameter gradients, ``param_bytes``). A stage with any
transfer of ``weights i`` is a *host-weight stage*: its parameters live on the
host between steps. ``apply_plan`` puts them there (and back on their device
for a later plan that does not move them), keeping the same ``Parameter``
objects (the optimizer holds them): only ``param.data`` (and a ``.grad``) is
swapped. A parameter shared with another stage (tied weights) is refused.

* ``Prefetch i weights`` allocates a device copy of each parameter at once
  and copies the host data in; ``param.data`` is then the device copy. Every
  compute operation of stage i (``F_*`` i, ``B i``) waits for that copy, and
  fails with a one-line :class:`MemschedError` when the weights are on the host
  (the plan lacks a ``Prefetch``): on CPU it would otherwise compute silently on
  the host data.
* ``Release i weights`` waits for a prefetch still in flight, then sets
  ``param.data`` back to the host tensor: the device copy dies (no copy back,
  the parameters do not change during the step). Autograd does not pin it:
  under the stage's ``F_all`` the pack hook puts a parameter's storage, saved
  as it is or as a view (``linear`` saves ``weight.t()``), in the box of
  ``weights i``, and a handle is rebuilt on the current device copy at unpack.
  A recomputed forward reads the weights as any compute operation does.
  ``Offload i weights`` is refused.
* ``B i`` makes the gradients on the device, as in any step (the host
  ``.grad`` from before the step is set aside when it starts). ``B i`` takes
  them by the gradient edges ``F_all i`` recorded: on CUDA, setting
  ``param.data`` to a tensor of another device drops the parameter's link to
  the graph's gradient accumulator.
* ``Offload i grads`` copies each ``.grad`` to the host; ``Release i grads``
  waits for that copy and frees the device gradient. The host copy becomes
  ``.grad`` (added to the one set aside, so gradients accumulate across steps
  as usual). ``Prefetch i grads`` is refused.

The plan must end with the weights and gradients of every host-weight stage
on the host (else a one-line error, the weights put back on the host); a
failed step puts the weights back on the host and the gradients not yet in
``.grad`` back as they were. A host-weight stage never runs fused with a
neighbour (see Fusion). ``torch.no_grad()`` inference runs each host-weight
stage on a temporary device copy of its parameters.

On CPU the host tensors are NumPy-backed (``torch.from_numpy`` on a copy), so
the live-memory tracker does not count them; a prefetched copy is a
``clone()``, which it counts, and ``Offload i grads`` is a synchronous NumPy
copy. On CUDA the host parameters and gradients are pinned CPU tensors:
after ``apply_plan`` the parameters of host-weight stages are CPU tensors, and
the user's optimizer steps on them on the CPU (its state, created at its first
step, lives there too). ``Prefetch i weights`` allocates on the compute stream
and copies on the host-to-device stream, ordered by events as above; ``Offload
i grads`` copies on the device-to-host stream after the compute stream; ``Release
i grads`` makes the compute stream wait for the copy before the device
gradient is freed, and the step's end waits on the host (``Event.synchronize``)
for every gradient copy before ``.grad`` is set, so the optimizer reads
finished data.

**Fusion.** Consecutive ``F_all`` / ``B`` of neighbouring stages run as one
autograd graph (planner/execute/chain.py, ``_fused_positions``), computed here on
the schedule without its transfers. The fused forward runs every stage at its
own position, on the tensor the previous stage returned, held meanwhile; the
fused backward runs the backwards of all the graph's stages at the first
``B``. A transfer between two fused operations therefore breaks the fusion
when it would act at the wrong time: between the two forwards, a ``Release``
or ``Prefetch`` of the lower stage's ``saved`` item (it holds that tensor);
between the two backwards, any ``Release`` or ``Prefetch`` (of a group's item,
it would come after the fused call read or freed it; of another item, the
fused call would run backwards the plan puts after it on the other side of a
memory change, so the peak would differ from the prediction), and an
``Offload`` of an item of the group's stages (``saved k`` / ``input k``, the
provider of its first input included). An ``Offload`` between two forwards, or
of another item between two backwards, keeps the fusion. A host-weight stage
never fuses (its weights would be read, and its gradients made, at another
operation than the plan's); ``Release i grads`` between two backwards breaks
their fusion as any ``Release``.
"""

import contextlib
import itertools
import weakref

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from planner.errors import MemschedError
from planner.execute.chain import _any_requires_grad, _fused_positions, _Graph, _leaf, _Run
from planner.ops import TRANSFER_OPS, Op

ON_DEVICE, COPYING, ON_HOST = "on the device", "being offloaded", "on the host"

_LIVE = weakref.WeakSet()  # every storage slot not yet dropped, for leak checks


def live_copies() -> tuple:
    """``(slots, host bytes)``: storages still held in a box by any step, and the bytes of their host copies."""
    slots = list(_LIVE)
    return len(slots), sum(slot.host_bytes for slot in slots)


def _item_text(what, i) -> str:
    return {"saved": f"saved {i} (ā_{i + 1})", "input": f"input {i} (a_{i})",
            "weights": f"weights {i} (the parameters of stage {i})",
            "grads": f"grads {i} (the parameter gradients of stage {i})"}.get(what, f"{what} {i}")


# --------------------------------------------------------------------------------------------------
# Copies


def _bytes_of(storage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (allocates nothing)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _HostCopies:
    """CPU: synchronous copies; the host copy is a NumPy array, invisible to the device accounting."""

    def to_host(self, storage):
        return _bytes_of(storage).numpy().copy(), None

    def to_device(self, host, device):
        target = torch.empty(host.shape[0], dtype=torch.uint8, device=device)
        target.copy_(torch.from_numpy(host))
        return target.untyped_storage(), None

    def tensor_to_device(self, host, device):
        return host.clone(), None  # counted by the tracker, as a device allocation is

    def tensor_to_host(self, tensor):
        return _numpy_backed(tensor), None

    def wait(self, event) -> None:
        pass


class _CudaCopies:
    """CUDA: one copy stream per direction, pinned host buffers, events (see the module docstring)."""

    _streams = {}  # device index -> (d2h stream, h2d stream), reused across steps

    def __init__(self, device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        if device.index not in self._streams:
            self._streams[device.index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.d2h, self.h2d = self._streams[device.index]

    def to_host(self, storage):
        source = _bytes_of(storage)
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


def _numpy_backed(tensor) -> torch.Tensor:
    """A CPU tensor, the same view as ``tensor``, over a NumPy copy of its storage: the live-memory tracker does
    not count it (no operation made it)."""
    array = _bytes_of(tensor.untyped_storage()).numpy().copy()
    return torch.empty(0, dtype=tensor.dtype).set_(torch.from_numpy(array).untyped_storage(),
                                                   tensor.storage_offset(), tensor.size(), tensor.stride())


def _copies_for(device, engines: dict):
    device = torch.device(device)
    if device not in engines:
        if device.type == "cuda":
            engines[device] = _CudaCopies(device)
        elif device.type == "cpu":
            engines[device] = _HostCopies()
        else:
            raise MemschedError(f"offload plans run on CPU and CUDA, not on {device.type}")
    return engines[device]


# --------------------------------------------------------------------------------------------------
# Boxes, slots, handles


class _Slot:
    """One storage of an item: its device storage (None while on the host), its host copy, its handles."""

    __slots__ = ("box", "storage", "device", "nbytes", "host", "refs", "copied", "ready", "copies", "__weakref__")

    def __init__(self, box, storage):
        self.box, self.storage, self.device, self.nbytes = box, storage, storage.device, storage.nbytes()
        self.host = self.copied = self.ready = None
        self.refs = 0
        self.copies = _copies_for(self.device, box.engines)
        box.slots[self] = None
        box.owner[storage._cdata] = self
        _LIVE.add(self)

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.nbytes

    def tensor(self, dtype, size, stride, offset, reader) -> torch.Tensor:
        if self.storage is None:
            box = self.box
            raise MemschedError(f"{reader} reads {_item_text(*box.item)}, which is on the host: the plan must "
                                f"Prefetch {box.item[1]} {box.item[0]} before it (check it with memsched show PLAN "
                                "--chain CHAIN)")
        self._settle_ready()
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.storage, offset, size, stride)

    def _settle_ready(self) -> None:
        if self.ready is not None:
            self.copies.wait(self.ready)
            self.ready = None

    def unref(self) -> None:
        self.refs -= 1
        if self.refs <= 0:
            self.drop()

    def drop(self) -> None:
        """Free the device storage (after any copy still using it) and the host copy; leave the box."""
        if self.storage is not None:
            if self.copied is not None:
                self.copies.wait(self.copied)
            self._settle_ready()
            self.box.forget(self)
            self.storage = None
        self.copied = self.host = None
        self.box.slots.pop(self, None)
        _LIVE.discard(self)

    def offload(self) -> None:
        self._settle_ready()  # a storage just prefetched is read once its copy has ended
        self.host, self.copied = self.copies.to_host(self.storage)

    def release(self) -> None:
        if self.copied is not None:
            self.copies.wait(self.copied)
            self.copied = None
        self.box.forget(self)
        self.storage = None

    def prefetch(self) -> None:
        self.storage, self.ready = self.copies.to_device(self.host, self.device)
        self.host = None
        self.box.owner[self.storage._cdata] = self


class _Box:
    """The storages of one item (``("saved", i)`` or ``("input", i)``) and where the item is."""

    def __init__(self, item, owner, engines):
        self.item, self.owner, self.engines = item, owner, engines
        self.slots = {}  # _Slot -> None, in insertion order
        self.phase = ON_DEVICE

    def add(self, storage) -> _Slot:
        return _Slot(self, storage)

    def forget(self, slot) -> None:
        key = slot.storage._cdata
        if self.owner.get(key) is slot:
            del self.owner[key]

    def _expect(self, phase, op) -> None:
        if self.phase != phase:
            raise MemschedError(f"{op}: {_item_text(*self.item)} is {self.phase}, not {phase}: the plan is invalid "
                                "(check it with memsched show PLAN --chain CHAIN)")

    def offload(self, op) -> None:
        self._expect(ON_DEVICE, op)
        for slot in list(self.slots):
            slot.offload()
        self.phase = COPYING

    def release(self, op) -> None:
        self._expect(COPYING, op)
        for slot in list(self.slots):
            slot.release()
        self.phase = ON_HOST

    def prefetch(self, op) -> None:
        self._expect(ON_HOST, op)
        for slot in list(self.slots):
            slot.prefetch()
        self.phase = ON_DEVICE


class _WeightSlot(_Slot):
    """One parameter of a host-weight stage: its host tensor (the parameter's data between its Release and
    Prefetch) and, while on the device, the device copy's storage. The weights box, not the handles on it,
    decides its life: autograd's handles only rebuild views of the current device copy."""

    __slots__ = ("param",)

    def __init__(self, box, param, host, device):
        self.box, self.param, self.host, self.device = box, param, host, torch.device(device)
        self.storage = self.copied = self.ready = None
        self.nbytes, self.refs = host.untyped_storage().nbytes(), 0
        self.copies = _copies_for(self.device, box.engines)

    @property
    def host_bytes(self) -> int:
        return 0

    def unref(self) -> None:
        self.refs -= 1

    def drop(self) -> None:
        self.release()

    def prefetch(self) -> None:
        tensor, self.ready = self.copies.tensor_to_device(self.host, self.device)
        self.param.data = tensor
        self.storage = tensor.untyped_storage()
        self.box.owner[self.storage._cdata] = self

    def release(self) -> None:
        """Back to the host copy, which is current (no copy back); a prefetch still in flight is waited for."""
        if self.storage is None:
            return
        self._settle_ready()
        key = self.storage._cdata
        if self.box.owner.get(key) is self:
            del self.box.owner[key]
        self.storage = None
        self.param.data = self.host


class _WeightBox:
    """``weights i``: the parameters of a host-weight stage, on the host at the start and end of the step."""

    def __init__(self, i, homes, owner, engines):
        self.item, self.owner, self.engines = ("weights", i), owner, engines
        self.slots = [_WeightSlot(self, param, host, device) for param, host, device in homes]
        self.phase = ON_HOST

    def _expect(self, phase, op) -> None:
        if self.phase != phase:
            raise MemschedError(f"{op}: {_item_text(*self.item)} is {self.phase}, not {phase}: the plan is invalid "
                                "(check it with memsched show PLAN --chain CHAIN)")

    def offload(self, op) -> None:
        raise MemschedError(f"{op}: parameters are never offloaded (their host copy is current): the plan must "
                            f"Release {self.item[1]} weights instead")

    def prefetch(self, op) -> None:
        self._expect(ON_HOST, op)
        for slot in self.slots:
            slot.prefetch()
        self.phase = ON_DEVICE

    def release(self, op) -> None:
        self._expect(ON_DEVICE, op)
        self.restore()

    def restore(self) -> None:
        for slot in self.slots:
            slot.release()
        self.phase = ON_HOST

    def settle(self, reader) -> None:
        """Before ``reader`` (a compute operation of the stage) runs: the weights are on the device, copied."""
        if self.phase != ON_DEVICE:
            i = self.item[1]
            raise MemschedError(f"{reader} reads {_item_text(*self.item)}, which are on the host: the plan must "
                                f"Prefetch {i} weights before it (check it with memsched show PLAN --chain CHAIN)")
        for slot in self.slots:
            slot._settle_ready()


class _GradBox:
    """``grads i``: the device gradients a host-weight stage's backward made, until they are on the host."""

    def __init__(self, i, params, engines, landed):
        self.item, self.params, self.engines, self.landed = ("grads", i), params, engines, landed
        self.copies = []  # (parameter, host copy, event)
        self.phase = ON_DEVICE

    _expect = _WeightBox._expect

    def offload(self, op) -> None:
        self._expect(ON_DEVICE, op)
        for param in self.params:
            if param.grad is not None:
                host, event = _copies_for(param.grad.device, self.engines).tensor_to_host(param.grad)
                self.copies.append((param, host, event))
        self.phase = COPYING

    def release(self, op) -> None:
        self._expect(COPYING, op)
        for param, host, event in self.copies:
            if event is not None:
                _copies_for(param.grad.device, self.engines).wait(event)
            param.grad = None  # frees the device gradient (the compute stream waits for its copy)
        self.landed.extend(self.copies)
        self.copies = []
        self.phase = ON_HOST

    def prefetch(self, op) -> None:
        raise MemschedError(f"{op}: parameter gradients are never prefetched (the optimizer steps on the host)")


class _Handle:
    """A reference to a tensor stored in a box: the slot and the view (dtype, size, strides, offset)."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset")

    def __init__(self, slot, tensor):
        self.slot = slot
        self.dtype, self.size, self.stride, self.offset = (tensor.dtype, tensor.size(), tensor.stride(),
                                                           tensor.storage_offset())
        slot.refs += 1

    def tensor(self, reader) -> torch.Tensor:
        return self.slot.tensor(self.dtype, self.size, self.stride, self.offset, reader)

    def __del__(self):
        try:
            self.slot.unref()
        except Exception:  # interpreter shutdown
            pass


class _Held:
    """An activation held through handles: a tree whose tensors are handles (or resident tensors)."""

    __slots__ = ("leaves", "spec")

    def __init__(self, leaves, spec):
        self.leaves, self.spec = leaves, spec

    def tensors(self, reader):
        return tree_unflatten([leaf.tensor(reader) if isinstance(leaf, _Handle) else leaf for leaf in self.leaves],
                              self.spec)


def _slot_for(tensor, box, resident):
    """The slot of ``tensor``'s storage, added to ``box`` if no item holds it yet; None for a tensor never boxed
    (a parameter of a stage whose weights stay on the device, a buffer, the caller's input, a tensor of another
    layout). A host-weight stage's parameter, or a view of it, goes to its ``weights`` item."""
    if _strided(tensor):
        slot = box.owner.get(tensor.untyped_storage()._cdata)
        if isinstance(slot, _WeightSlot):
            return slot
    if not _boxable(tensor):
        return None
    storage = tensor.untyped_storage()
    key = storage._cdata
    if key in resident:
        return None
    slot = box.owner.get(key)
    return slot if slot is not None else box.add(storage)


def _strided(tensor) -> bool:
    return (tensor.layout == torch.strided and not tensor.is_conj() and not tensor.is_neg()
            and tensor.device.type in ("cpu", "cuda"))


def _boxable(tensor) -> bool:
    return type(tensor) is torch.Tensor and _strided(tensor)


# --------------------------------------------------------------------------------------------------
# Host-weight stages

_HOMES = WeakIdKeyDictionary()  # parameter -> (its host tensor, the device it is computed on)


def host_weight_stages(schedule) -> set:
    """The stages whose weights the schedule moves: their parameters live on the host between steps."""
    return {op.stage for op in schedule if op.kind in TRANSFER_OPS and op.what == "weights"}


def prepare_host_weights(modules, schedule) -> dict:
    """``{i: [(parameter, host tensor, device), ...]}`` for the host-weight stages of ``schedule``, their
    trainable parameters' data (and any ``.grad``) moved to the host. Parameters made host-weight by an earlier
    plan and not by this one go back to their device. A parameter shared with another stage is refused."""
    stages = host_weight_stages(schedule)
    where = {}  # id(parameter) -> the stages holding it
    for k, module in enumerate(modules):
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            where.setdefault(id(parameter), set()).add(k)
    homes = {}
    for i in sorted(stages):
        if not 0 <= i < len(modules):
            raise MemschedError(f"the plan moves weights {i}, but the model has {len(modules)} stages")
        module = modules[i]
        named = list(module.named_parameters()) if isinstance(module, torch.nn.Module) else []
        for name, parameter in named:
            others = sorted(where[id(parameter)] - {i}) if parameter.requires_grad else ()
            if others:
                raise MemschedError(f"parameter {name!r} of stage {i} is shared with stage {others[0]} (tied "
                                    f"weights): the plan cannot keep stage {i}'s weights on the host; keep them on "
                                    "the device (no transfers of weights/grads of either stage)")
        unique = {id(p): p for _, p in named if p.requires_grad}
        homes[i] = [_home(parameter) for parameter in unique.values()]
    moved = {id(parameter) for entries in homes.values() for parameter, _, _ in entries}
    for module in modules:
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            if id(parameter) not in moved and parameter in _HOMES:
                _go_back(parameter)
    return homes


def current_homes(planned) -> dict:
    """``planned.host_weights``, re-homing a parameter whose data was replaced since (``load_state_dict``
    copies in place and keeps the home; ``model.to(...)`` replaces it)."""
    for entries in planned.host_weights.values():
        for k, (parameter, host, _) in enumerate(entries):
            if not _same_storage(parameter.data, host):
                entries[k] = _home(parameter)
    return planned.host_weights


@contextlib.contextmanager
def weights_on_device(homes):
    """Inference (no autograd) on a host-weight stage: its parameters on their device for the call (on CPU the
    host tensors themselves)."""
    moved = [(parameter, host, device) for parameter, host, device in homes if host.device != device]
    try:
        for parameter, host, device in moved:
            parameter.data = host.to(device, non_blocking=True)
        yield
    finally:
        for parameter, host, _ in moved:
            parameter.data = host


def _same_storage(a, b) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _home(parameter) -> tuple:
    """``(parameter, host, device)``, the parameter's data and gradient now on the host."""
    known = _HOMES.get(parameter)
    if known is not None and _same_storage(parameter.data, known[0]):
        return (parameter, *known)
    data, device = parameter.data, parameter.device
    grad = parameter.grad
    if device.type == "cpu":
        host = _numpy_backed(data)
    else:
        host = torch.empty_strided(data.size(), data.stride(), dtype=data.dtype, pin_memory=True)
        host.copy_(data)
    parameter.grad = None
    parameter.data = host
    if grad is not None:
        parameter.grad = grad if grad.device.type == "cpu" else grad.to("cpu")
    _HOMES[parameter] = (host, device)
    return parameter, host, device


def _go_back(parameter) -> None:
    """A parameter no plan keeps on the host any more: back to the device it was computed on."""
    _, device = _HOMES.pop(parameter)
    if parameter.device != device:
        grad = parameter.grad
        parameter.grad = None
        parameter.data = parameter.data.to(device)
        if grad is not None:
            parameter.grad = grad.to(device)


# --------------------------------------------------------------------------------------------------
# Fusion


def fused_positions(schedule) -> tuple:
    """``(continued, absorbed, kept)`` for a schedule with transfers (see "Fusion" in the module docstring).

    ``continued`` and ``absorbed`` are as for :func:`planner.execute.chain._fused_positions`, in positions of the
    whole schedule; ``kept`` holds the positions of the ``F_all`` whose output object the next operation
    continues on.
    """
    compute = [p for p, op in enumerate(schedule) if op.kind not in TRANSFER_OPS]
    ops = tuple(schedule[p] for p in compute)
    continued_c, _ = _fused_positions(ops)
    continued, absorbed, kept = set(), set(), set()
    start = {}  # compute index of a kept continued F_all -> the first stage of its group
    host_weights = host_weight_stages(schedule)
    for c in sorted(continued_c):
        upper = ops[c].stage
        lower = upper - 1
        if lower in host_weights or upper in host_weights:  # a host-weight stage always runs on its own
            continue
        end = next(q for q in range(c + 1, len(ops)) if ops[q] == Op("B", upper))
        first = start.get(c - 1, lower)
        forward_gap = schedule[compute[c - 1] + 1:compute[c]]
        backward_gap = schedule[compute[end] + 1:compute[end + 1]]
        broken = any(op.kind in ("Release", "Prefetch") and (op.what, op.stage) == ("saved", lower)
                     for op in forward_gap)
        broken = broken or any(op.kind != "Offload" or (first - 1 <= op.stage <= lower if op.what == "saved"
                                                        else first <= op.stage <= lower) for op in backward_gap)
        if broken:
            continue
        start[c] = first
        continued.add(compute[c])
        absorbed.add(compute[end + 1])
        kept.add(compute[c - 1])
    return continued, absorbed, kept


# --------------------------------------------------------------------------------------------------
# The run


class OffloadRun(_Run):
    """One step of a plan with transfers: :class:`planner.execute.chain._Run` with activations held in boxes."""

    def __init__(self, planned, first, extra):
        super().__init__(planned, first, extra)
        self.owner = {}  # storage key -> _Slot, for every storage held on the device in a box
        self.engines = {}  # device -> copy engine
        self.boxes = {}  # (what, i) -> _Box of the item's current incarnation
        self.held = {}  # i -> _Held a_i inside ā_i (F_all i-1's output) while a later operation reads it
        self.reader = ["the output"]  # the operation running, as errors name it
        modules = [m for m in planned.modules_in_order if isinstance(m, torch.nn.Module)]
        resident = itertools.chain((t for m in modules for t in itertools.chain(m.parameters(), m.buffers())),
                                   (t for t in tree_flatten((first, extra))[0] if isinstance(t, torch.Tensor)))
        self.resident = {t.untyped_storage()._cdata for t in resident}
        # Host-weight stages: their weights box, the gradients they had before the step (added to at its end),
        # the host gradients released and not yet in .grad, and the parameters' gradient edges taken at F_all.
        self.weights, self.stashed, self.landed, self.edges = {}, {}, [], {}
        for i, homes in current_homes(planned).items():
            self.weights[i] = self.boxes[("weights", i)] = _WeightBox(i, homes, self.owner, self.engines)
            for parameter, _, _ in homes:
                self.stashed[id(parameter)] = (parameter, None)
                self._set_aside(parameter)  # the step's gradients are made on the device, then copied out

    # -- activations through boxes

    def _box(self, what, i) -> _Box:
        box = _Box((what, i), self.owner, self.engines)
        self.boxes[(what, i)] = box
        return box

    def _hold(self, tree, box) -> _Held:
        leaves, spec = tree_flatten(tree)
        held = []
        for leaf in leaves:
            slot = _slot_for(leaf, box, self.resident) if isinstance(leaf, torch.Tensor) else None
            held.append(leaf if slot is None else _Handle(slot, leaf))
        return _Held(held, spec)

    def _packing(self, box):
        """Saved-tensor hooks putting what the stage saves into ``box`` (they hold no reference to the run)."""
        resident, reader = self.resident, self.reader

        def pack(tensor):
            slot = _slot_for(tensor, box, resident)
            return tensor if slot is None else _Handle(slot, tensor)

        def unpack(packed):
            return packed.tensor(reader[0]) if isinstance(packed, _Handle) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def activation(self, i):
        if i == 0:
            return self.acts[0]
        reader = "Loss" if i == len(self.planned.stages) else self.reader[0]  # a_L: read for the loss
        held = self.acts.get(i)
        if held is None:
            held = self.held.get(i)
        if held is None:
            raise MemschedError(f"the plan needs a_{i}, which is not in memory: the plan is invalid "
                                f"(check it with memsched show PLAN --chain CHAIN)")
        return held.tensors(reader)

    def _give_back_storage(self, leaf) -> None:
        """The leaf shares a boxed ``a_i``'s storage: once the stage has run, only its gradient is wanted."""
        for tensor in tree_flatten(leaf)[0]:
            if isinstance(tensor, torch.Tensor) and _boxable(tensor) and \
                    tensor.untyped_storage()._cdata in self.owner:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def _pass_on(self, output, args):
        """Stage ``output``, every tensor sharing a storage with ``args`` copied (``nn.Identity``, a view of the
        input, a skip passed on): the chain model holds ``a_{i+1}`` in its own item, which the plan may keep on the
        device while the input's item is on the host."""
        given = {t.untyped_storage()._cdata for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and _strided(t)}
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and _strided(t)
                        and t.untyped_storage()._cdata in given else t, output)

    # -- operations

    def run(self, position) -> None:
        try:
            self._run(position)
        except BaseException:
            self.abandon()
            raise

    def _run(self, position) -> None:
        planned = self.planned
        op = planned.plan.schedule[position]
        self.reader[0] = str(op)
        graph = self.graphs.get(op.stage) if op.kind == "B" else None
        if graph is not None and len(graph.stages) > 1:  # a fused graph: its backwards all run here
            self.reader[0] = (f"{op} (running the backwards of stages {graph.stages[-1]}..{graph.stages[0]} "
                              "as one graph)")
        if op.kind in TRANSFER_OPS:
            box = self.boxes.get((op.what, op.stage))
            if box is None:
                raise MemschedError(f"{op}: {_item_text(op.what, op.stage)} was never made: the plan is invalid "
                                    "(check it with memsched show PLAN --chain CHAIN)")
            getattr(box, op.kind.lower())(op)
            if op.kind == "Release" and op.what == "grads":
                self._land(final=False)
            return
        weights = self.weights.get(op.stage) if op.kind != "Loss" else None
        if weights is not None:
            weights.settle(self.reader[0])
        if position in planned.absorbed:
            if op.stage > 0:
                self.acts.pop(op.stage, None)
        elif op.kind == "B":
            if weights is not None:  # (another step's forward, sharing this backward, may have set .grad since)
                for slot in weights.slots:
                    self._set_aside(slot.param)
            self._backward(op.stage)
            if weights is not None:
                self.boxes[("grads", op.stage)] = _GradBox(op.stage, [slot.param for slot in weights.slots],
                                                           self.engines, self.landed)
        elif position in planned.continued:
            self._continue_at(op.stage, position)
        elif op.kind != "Loss":
            self._forward_at(op, position)
        self.release(position)

    def release(self, position) -> None:
        for i in self.planned.releases.get(position, ()):
            self.held.pop(i + 1, None)
            graph = self.graphs.get(i)
            if graph is not None and graph.output is not None:
                graph.release_output()

    def _forward_at(self, op, position) -> None:
        i, module = op.stage, self.planned.modules_in_order[op.stage]
        source = self.activation(i)
        if op.kind == "F_all":
            leaf = _leaf(source, requires_grad=i > 0 or _any_requires_grad(source))
            del source
            extra = _leaf(self.extra, requires_grad=True) if _any_requires_grad(self.extra) else self.extra
            box = self._box("saved", i)
            with self._packing(box):
                output = self._call(i, module, leaf, *extra)
            self.graphs[i] = _Graph(leaf, extra, output, (i,))
            if i in self.weights:  # set_data to the host resets a CUDA parameter's gradient accumulator: keep it
                self.edges[i] = {id(slot.param): get_gradient_edge(slot.param) for slot in self.weights[i].slots
                                 if slot.param.requires_grad}
            self._keep_output(i, output, box, position)
            del output
            self._give_back_storage(leaf)
        else:
            with torch.no_grad():
                output = self._call(i, module, source, *self.extra)
            del source
            self.acts[i + 1] = self._hold(output, self._box("input", i + 1))
            del output
        if op.kind == "F_none" and i > 0:
            self.acts.pop(i, None)

    def _continue_at(self, i, position) -> None:
        graph = self.graphs.pop(i - 1)
        box = self._box("saved", i)
        with self._packing(box):
            output = self._call(i, self.planned.modules_in_order[i], graph.output, *graph.extra)
        graph.extend(i, output)
        self.graphs[i] = graph
        self._keep_output(i, output, box, position)

    def _keep_output(self, i, output, box, position) -> None:
        """``a_{i+1}`` is held through ``saved i``; the tensor itself only when the next operation continues
        on it."""
        self.held[i + 1] = self._hold(output, box)
        if position not in self.planned.kept_outputs:
            self.graphs[i].release_output()

    # -- host-weight stages

    def _gradient_inputs(self, graph, parameters) -> list:
        """A host-weight stage's parameters by the gradient edges its F_all took (see :meth:`_forward_at`)."""
        edges = self.edges.pop(graph.stages[0], None) if len(graph.stages) == 1 else None
        return parameters if edges is None else [edges.get(id(p), p) for p in parameters]

    def _set_aside(self, parameter) -> None:
        """``.grad`` (on the host: from before the step, or landed by another step sharing this backward) joins
        the gradient set aside for the step's end, and ``.grad`` is None for the device gradients to come."""
        grad = parameter.grad
        if grad is not None:
            _, before = self.stashed.get(id(parameter), (parameter, None))
            self.stashed[id(parameter)] = (parameter, grad if before is None else before.add_(grad))
            parameter.grad = None

    def _land(self, final) -> None:
        """Released host gradients become ``.grad`` (added to the gradient from before the step); on CUDA at the
        step's end, once their copies have ended (the optimizer reads them on the host)."""
        waiting = []
        for parameter, host, event in self.landed:
            if event is not None and not final:
                waiting.append((parameter, host, event))
                continue
            if event is not None:
                event.synchronize()
            self._set_aside(parameter)
            _, before = self.stashed.pop(id(parameter), (parameter, None))
            parameter.grad = host if before is None else before.add_(host)
        self.landed[:] = waiting

    def finish(self) -> None:
        """The step's end: every host-weight stage's weights and gradients are on the host."""
        left = [f"weights {i}" for i, box in self.weights.items() if box.phase != ON_HOST]
        for i, box in self.weights.items():
            grads = self.boxes.get(("grads", i))
            if (grads is None or grads.phase != ON_HOST) and any(slot.param.grad is not None for slot in box.slots):
                left.append(f"grads {i}")
        if left:
            self.abandon()
            raise MemschedError(f"the step ends with {', '.join(left)} on the device: the plan must Release them "
                                "before it ends (check it with memsched show PLAN --chain CHAIN)")
        self._land(final=True)
        for key in list(self.stashed):  # no gradient this step: the one from before
            self._set_aside(self.stashed[key][0])
            parameter, before = self.stashed[key]
            parameter.grad = before
        self.stashed.clear()

    def abandon(self) -> None:
        """A failed step: the parameters back on the host, their gradients as before the step."""
        for box in self.weights.values():
            box.restore()
        for parameter, _, _ in self.landed:
            self.stashed.setdefault(id(parameter), (parameter, None))
        self.landed.clear()
        for parameter, before in self.stashed.values():
            parameter.grad = before
        self.stashed.clear()

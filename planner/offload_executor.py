"""Offload plans in the chain executor: items moved between device and host as the plan says.

An offload plan (planner/plan.py) adds ``Offload``, ``Release`` and ``Prefetch``
of *items* to a chain schedule: ``saved i`` is ``ā_{i+1}``, everything ``F_all
i`` keeps for its backward, its output ``a_{i+1}`` included; ``input i`` is
``a_i`` held on its own (made by ``F_ck`` / ``F_none`` i-1), i >= 1. The chain
executor (planner/executor.py) runs such a plan with :class:`OffloadRun`, and
only such a plan: without transfer operations no hook is installed and nothing
here runs.

**Items and tensors.** Each item is a *box* of storages (a storage is counted
once, whatever views of it exist, as the profiler and the memory tracker count
it). ``F_all i`` runs under ``torch.autograd.graph.saved_tensors_hooks``: the
pack hook puts each saved tensor's storage in the box of ``saved i``, or, when
that storage already belongs to an item (the stage's own input ``a_i``, which
the chain model counts in ``ā_i`` or in the standalone ``a_i``), in that item;
parameters, buffers and the caller's inputs (``a_0`` and the extra arguments)
are never boxed. Autograd keeps only a small handle (the box's storage, dtype,
size, strides, offset); the unpack hook rebuilds the tensor on the box's
current device storage, and fails with a one-line :class:`MemschedError`
naming the item when that item is on the host (the plan lacks a
``Prefetch``). The executor's own references go through the same boxes: the
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

**Fusion.** Consecutive ``F_all`` / ``B`` of neighbouring stages run as one
autograd graph (planner/executor.py, ``_fused_positions``), computed here on
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
of another item between two backwards, keeps the fusion.
"""

import itertools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.errors import MemschedError
from planner.executor import _any_requires_grad, _fused_positions, _Graph, _leaf, _Run
from planner.plan import TRANSFER_OPS, Op

ON_DEVICE, COPYING, ON_HOST = "on the device", "being offloaded", "on the host"

_LIVE = weakref.WeakSet()  # every storage slot not yet dropped, for leak checks


def live_copies() -> tuple:
    """``(slots, host bytes)``: storages still held in a box by any step, and the bytes of their host copies."""
    slots = list(_LIVE)
    return len(slots), sum(slot.host_bytes for slot in slots)


def _item_text(what, i) -> str:
    return f"{what} {i} (ā_{i + 1})" if what == "saved" else f"{what} {i} (a_{i})"


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

    def wait(self, event) -> None:
        self.compute.wait_event(event)


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
    (a parameter, a buffer, the caller's input, a tensor of another layout)."""
    if not _boxable(tensor):
        return None
    storage = tensor.untyped_storage()
    key = storage._cdata
    if key in resident:
        return None
    slot = box.owner.get(key)
    return slot if slot is not None else box.add(storage)


def _boxable(tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_conj()
            and not tensor.is_neg() and tensor.device.type in ("cpu", "cuda"))


# --------------------------------------------------------------------------------------------------
# Fusion


def fused_positions(schedule) -> tuple:
    """``(continued, absorbed, kept)`` for a schedule with transfers (see "Fusion" in the module docstring).

    ``continued`` and ``absorbed`` are as for :func:`planner.executor._fused_positions`, in positions of the
    whole schedule; ``kept`` holds the positions of the ``F_all`` whose output object the next operation
    continues on.
    """
    compute = [p for p, op in enumerate(schedule) if op.kind not in TRANSFER_OPS]
    ops = tuple(schedule[p] for p in compute)
    continued_c, _ = _fused_positions(ops)
    continued, absorbed, kept = set(), set(), set()
    start = {}  # compute index of a kept continued F_all -> the first stage of its group
    for c in sorted(continued_c):
        upper = ops[c].stage
        lower = upper - 1
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
    """One step of a plan with transfers: :class:`planner.executor._Run` with activations held in boxes."""

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

    # -- operations

    def run(self, position) -> None:
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
            return
        if position in planned.absorbed:
            if op.stage > 0:
                self.acts.pop(op.stage, None)
        elif op.kind == "B":
            self._backward(op.stage)
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

"""Offload plans: a step whose items move between device and host memory as the plan says.

:class:`OffloadStepRun` is :class:`planner.execute.steprun.StepRun` with its hooks overridden: every tensor ``F_all
i`` saves and every activation the run holds lives in the *box* of its item (``saved i``, ``input i``; the
parameters of a host-weight stage in ``weights i``, its gradients in ``grads i``), through saved-tensor hooks and
handles; ``Offload`` / ``Release`` / ``Prefetch`` act on boxes, and reading an item left on the host fails with a
one-line :class:`MemschedError`. The semantics (boxes, copies and their ordering on CUDA, host-weight stages,
fusion across transfers) are in docs/execution.md, "Offload executor" and "Host weights".
:func:`live_copies` counts what boxes still hold, for leak checks.
"""

import itertools
import weakref

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from planner.errors import MemschedError
from planner.execute.copies import copies_for
from planner.execute.host_weights import current_homes
from planner.execute.steprun import StepRun

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
# Boxes, slots, handles


class _Slot:
    """One storage of an item: its device storage (None while on the host), its host copy, its handles."""

    __slots__ = ("box", "storage", "device", "nbytes", "host", "refs", "copied", "ready", "copies", "__weakref__")

    def __init__(self, box, storage):
        self.box, self.storage, self.device, self.nbytes = box, storage, storage.device, storage.nbytes()
        self.host = self.copied = self.ready = None
        self.refs = 0
        self.copies = copies_for(self.device, box.engines)
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
        self.copies = copies_for(self.device, box.engines)

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
                host, event = copies_for(param.grad.device, self.engines).tensor_to_host(param.grad)
                self.copies.append((param, host, event))
        self.phase = COPYING

    def release(self, op) -> None:
        self._expect(COPYING, op)
        for param, host, event in self.copies:
            if event is not None:
                copies_for(param.grad.device, self.engines).wait(event)
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
# The run


class OffloadStepRun(StepRun):
    """One step of a plan with transfers: :class:`StepRun` with activations held in boxes (its hooks only)."""

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
        for i, homes in current_homes(planned.host_weights).items():
            self.weights[i] = self.boxes[("weights", i)] = _WeightBox(i, homes, self.owner, self.engines)
            for parameter, _, _ in homes:
                self.stashed[id(parameter)] = (parameter, None)
                self._set_aside(parameter)  # the step's gradients are made on the device, then copied out

    def _hold_to_gradient(self, i, activation) -> None:
        """Nothing more: ``a_i`` lives in the box of stage i-1's ``saved`` item (``held``), which the plan's
        transfers move and free; another reference would keep its device storage past a ``Release``. (A value no
        backward keeps, a 16-bit residual stream, is then freed once read: below its prediction, never above.)"""

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

    def _give_back_storage(self, leaf) -> None:
        """The leaf shares a boxed ``a_i``'s storage: once the stage has run, only its gradient is wanted."""
        for tensor in tree_flatten(leaf)[0]:
            if isinstance(tensor, torch.Tensor) and _boxable(tensor) and \
                    tensor.untyped_storage()._cdata in self.owner:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    # -- hooks (planner/execute/steprun.py)

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

    def saving(self, i):
        """What ``F_all i`` saves goes into the box of ``saved i``."""
        return self._packing(self._box("saved", i))

    def keep_output(self, i, output, position) -> None:
        """``a_{i+1}`` is held through ``saved i``; the tensor itself only when the next operation continues
        on it."""
        self.held[i + 1] = self._hold(output, self.boxes[("saved", i)])
        if position not in self.planned.kept_outputs:
            self.graphs[i].release_output()

    def after_forward_all(self, i, leaf) -> None:
        """A host-weight stage's gradient edges (setting ``.data`` to the host resets a CUDA parameter's gradient
        accumulator); the leaf's storage given back."""
        if i in self.weights:
            self.edges[i] = {id(slot.param): get_gradient_edge(slot.param) for slot in self.weights[i].slots
                             if slot.param.requires_grad}
        self._give_back_storage(leaf)

    def hold_input(self, i, output) -> None:
        self.acts[i] = self._hold(output, self._box("input", i))

    def release_output(self, i) -> None:
        self.held.pop(i + 1, None)
        super().release_output(i)

    def pass_on(self, output, args):
        """Stage ``output``, every tensor sharing a storage with ``args`` copied (``nn.Identity``, a view of the
        input, a skip passed on): the chain model holds ``a_{i+1}`` in its own item, which the plan may keep on the
        device while the input's item is on the host."""
        given = {t.untyped_storage()._cdata for t in tree_flatten(args)[0]
                 if isinstance(t, torch.Tensor) and _strided(t)}
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and _strided(t)
                        and t.untyped_storage()._cdata in given else t, output)

    def transfer(self, op) -> None:
        self.reader[0] = str(op)
        box = self.boxes.get((op.what, op.stage))
        if box is None:
            raise MemschedError(f"{op}: {_item_text(op.what, op.stage)} was never made: the plan is invalid "
                                "(check it with memsched show PLAN --chain CHAIN)")
        getattr(box, op.kind.lower())(op)
        if op.kind == "Release" and op.what == "grads":
            self._land(final=False)

    def before_compute(self, op) -> None:
        """Name the operation for errors; a host-weight stage's weights must be on the device, their copy done."""
        self.reader[0] = str(op)
        graph = self.graphs.get(op.stage) if op.kind == "B" else None
        if graph is not None and len(graph.stages) > 1:  # a fused graph: its backwards all run here
            self.reader[0] = (f"{op} (running the backwards of stages {graph.stages[-1]}..{graph.stages[0]} "
                              "as one graph)")
        weights = self.weights.get(op.stage) if op.kind != "Loss" else None
        if weights is not None:
            weights.settle(self.reader[0])

    def before_backward(self, i) -> None:
        """(Another step's forward, sharing this backward, may have set a host-weight stage's ``.grad`` since.)"""
        for slot in self.weights[i].slots if i in self.weights else ():
            self._set_aside(slot.param)

    def after_backward(self, i) -> None:
        """A host-weight stage's device gradients: the ``grads i`` item."""
        if i in self.weights:
            self.boxes[("grads", i)] = _GradBox(i, [slot.param for slot in self.weights[i].slots], self.engines,
                                               self.landed)

    def gradient_inputs(self, graph, parameters) -> list:
        """A host-weight stage's parameters by the gradient edges its F_all took (:meth:`after_forward_all`)."""
        edges = self.edges.pop(graph.stages[0], None) if len(graph.stages) == 1 else None
        return parameters if edges is None else [edges.get(id(p), p) for p in parameters]

    # -- host-weight stages

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

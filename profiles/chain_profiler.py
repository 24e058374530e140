"""Measure a model split into stages into a ``memsched.chain/1`` problem (bytes and seconds).

:func:`profile_chain` runs each stage (called ``module(a_k, *extra)``, as
:class:`planner.execute.stages.StagedModel` says) and measures what the chain model needs
(planner/chain.py) as the simulator will use it: ``out_bytes``, ``saved_bytes``, ``own_saved_bytes``, the
forward, no-grad and backward temporaries, ``param_bytes`` and the times; memory from one run under the
live-memory tracker on CPU (CUDA's own statistics on a GPU), timing from separate runs without it. With
``estimate=True`` the model and inputs must have been built under one ``FakeTensorMode`` (profiles/fake_build.py):
sizes are then exact and allocate nothing, and times are estimated per operation from ``rates``
(:class:`planner.rates.Rates`: a roofline of FLOP/s and memory bandwidth and a cost per operation,
profiles/roofline.py), or FLOPs divided by ``throughput`` when no rates are given; for a target ``device_spec``
(planner/devices.py) the rates are its peak FLOP/s and memory bandwidth and every storage counts as the block its
allocator hands out (planner/allocator.py: a CUDA estimate is in allocated bytes), a CUDA kernel's outputs
resized where they differ from the CPU kernel's (profiles/cuda_kernels.py). The model is
left as it was (buffers and random number generators restored). The chain records what it was measured on
(``measured_on``), which the executors check; identical stages (profiles/identical.py) are measured once. With
``options=N`` each distinct stage also gets its stage options (profiles/options.py), measured as it runs them
(planner/execute/selective.py). What each field counts: docs/execution.md ("Chain profiler").
"""

import contextlib
import dataclasses
import statistics
import time

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

from planner.allocator import rounding
from planner.chain import Chain, Loss, Stage, StageOption
from planner.errors import MemschedError
from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.records import measured_on, parameter_layout, shared_parameters
from planner.execute.selective import forward_nodes, recomputation, run_with_option
from planner.execute.stages import (
    checked_device,
    default_loss,
    named_stages,
    preserved_state,
    quiet_fake_tensor_log,
)
from planner.rates import Rates
from planner.render import seconds_since
from profiles.cuda_kernels import cuda_kernels
from profiles.identical import stage_key
from profiles.memory import memory_meter, storage_bytes, storages
from profiles.options import candidate_recomputes, measure_options, pareto_front, structure
from profiles.roofline import roofline
from profiles.stage_runs import (
    HandOver,
    fresh_input,
    module_buffers,
    module_parameters,
    stage_backward,
    tensors_of,
)
from profiles.transfer_profiler import measure_transfer

DEFAULT_THROUGHPUT = 1e12  # FLOP/s assumed by estimates when none is given
# Seconds of one step (a stage's forward and backward, or the loss) from which it is timed once after its warm-up,
# and an option's extra seconds in LONG_STEP_PAIRS pairs: its noise is a small part of it (GPT-2 small's lm_head,
# ~120 GFLOP a step, took 18 s at one thread timed 3 times)
LONG_STEP_S, LONG_STEP_PAIRS = 0.25, 3
# Seconds the live-memory tracker adds to one operation it sees (its Python: 50-70 us measured on this CPU, a
# chain of 12,000 small operations), bounded from above
TRACKED_OPERATION_S = 1e-4
# An option's differences over a plain step agreeing within this share of the step after LONG_STEP_PAIRS rounds:
# no more rounds (a quiet machine's; a loaded one's spread further, and get 2 * repeats + 1)
AGREEING_SHARE = 0.03
# Forward seconds from which a stage's graph is read for its options on fake tensors: about what a fake run of a
# transformer block costs (40-70 ms measured, a real one of a tiny block 15-20 ms)
FAKE_NODES_S = 0.05


def profile_chain(stages, example_inputs, *, loss_fn=None, device=None, warmup=2, repeats=5, name="model",
                  estimate=False, throughput=None, progress=None, transfer=None, options=0, say=None,
                  check=None, share_identical=True, device_spec=None, rates=None) -> Chain:
    """Profile ``stages`` on ``example_inputs`` (a tensor, or ``(input, *extra)``) into a :class:`Chain`.

    ``loss_fn(last_output) -> scalar`` (default: the mean of the last output);
    ``device`` moves stages and inputs there first; ``progress(k, stage_name)``
    is called before each stage (k = L for the loss); ``say(line)``, when
    given, is told each stage, the loss and the options as they are measured.
    The chain's copy channel is ``transfer`` (a :class:`planner.transfer.Transfer`)
    when given, else the one measured on CUDA (:mod:`profiles.transfer_profiler`),
    else none. ``options`` candidates per distinct stage are measured as its
    options (:mod:`profiles.options`; 0: none) after every stage and the loss,
    as :func:`profiles.options.measure_options` says (``check``: see there);
    till then each distinct stage's input is kept. A stage identical to an
    earlier one (:func:`profiles.identical.stage_key`; none with
    ``share_identical=False``) gets its figures and options, measured once.
    An estimate's times are per operation at ``rates`` (:class:`planner.rates.Rates`), else FLOPs / ``throughput``;
    ``device_spec``: the device an estimate is for (:func:`_target`), recorded as the chain's ``device``.
    """
    pairs, say = named_stages(stages), say or (lambda line: None)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if not inputs:
        raise MemschedError("example_inputs is empty: give the first stage's input")
    loss_fn = loss_fn or default_loss
    rates, size_of = _target(device_spec, throughput, rates, estimate)
    fake_mode = _fake_mode(pairs, inputs) if estimate else None
    if device is not None:
        device = checked_device(device)
        with fake_mode or contextlib.nullcontext():  # fake tensors move under their own mode
            pairs = [(stage_name, module.to(device) if isinstance(module, torch.nn.Module) else module)
                     for stage_name, module in pairs]
            inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)
    device = device or _device_of(inputs)
    runner = _Runner(device, warmup, repeats, fake_mode, rates, size_of)
    modules = [module for _, module in pairs]
    kernels = cuda_kernels() if device_spec is not None and device_spec.allocator == "cuda" else None
    with (fake_mode or contextlib.nullcontext()), (kernels or contextlib.nullcontext()), \
            preserved_state(modules, device), quiet_fake_tensor_log():
        first, extra = inputs[0], inputs[1:]
        for module in modules:  # gradients are made from None, as in a step (the caller's come back after)
            for parameter in module_parameters(module):
                parameter.grad = None
        resident = tensors_of(inputs)
        profiled, owned, measured, same_as, kept_inputs = [], _parameter_owners(modules), {}, [], {}
        activation = first
        for k, (stage_name, module) in enumerate(pairs):
            if progress:
                progress(k, stage_name)
            last_input, started = activation, time.perf_counter()
            key = stage_key(module, activation, extra, resident, k == 0) if share_identical else None
            same_as.append(k if key is None else measured.setdefault(key, k))
            twin = same_as[k] < k and runner.repeated(profiled[same_as[k]], k, stage_name, module, activation, extra,
                                                      owned[k])
            if twin:
                stage, activation = twin
                say(f"stage {k} ({stage_name}) of {len(pairs)}: identical to stage {same_as[k]}, its figures shared")
            else:
                same_as[k] = k
                stage, activation = runner.stage(k, stage_name, module, activation, extra, resident, owned[k],
                                                 input_bytes=runner.bytes(tensors_of(activation)))
                if options:
                    kept_inputs[k] = last_input
                say(f"stage {k} ({stage_name}) of {len(pairs)}: measured in {seconds_since(started)}")
            profiled.append(stage)
        if progress:
            progress(len(pairs), "loss")
        started = time.perf_counter()
        last = _guarded(len(pairs) - 1, pairs[-1][0], pairs[-1][1], extra, runner.ran)
        loss = runner.loss(loss_fn, last, last_input, len(pairs) > 1, activation, profiled[-1].out_bytes)
        say(f"loss: measured in {seconds_since(started)}")
        target = device_spec.name if device_spec else device
        label = f"{target} (estimated at {rates.describe()})" if fake_mode else str(device)
        if transfer is None and fake_mode is None:
            transfer = measure_transfer(device)
        chain = Chain(name=name, device=label, input_bytes=runner.bytes(resident), stages=tuple(profiled), loss=loss,
                      transfer=transfer, measured_on=measured_on(pairs, inputs), shared=shared_parameters(pairs),
                      layout=parameter_layout(pairs))
        if options:
            known = {}

            def measured_options(k):  # stage k with its options, its input let go
                stage_input = kept_inputs.pop(k)
                return runner.with_options(k, *pairs[k], chain.stages[k], stage_input, extra, options, known,
                                           runner.bytes(tensors_of(stage_input)))

            chain = measure_options(chain, same_as, measured_options, check, say)
        elif check:
            check(chain, {})
    return chain


def _target(device_spec, throughput, rates, estimate) -> tuple:
    """``(Rates, size_of)`` a profile assumes: ``rates``, else ``throughput`` FLOP/s alone (default
    :data:`DEFAULT_THROUGHPUT`), and storages counted as they are (None); or, for a ``device_spec``, its peaks
    (an operation on 16-bit inputs at the bf16 one), memory bandwidth and cost per operation
    (:meth:`DeviceSpec.rates`), and the bytes its allocator counts for each storage
    (:func:`planner.allocator.rounding`)."""
    if device_spec is None:
        if rates is not None and throughput is not None:
            raise MemschedError("give an estimate's throughput or its rates, not both (rates hold their FLOP/s)")
        return rates or Rates(throughput or DEFAULT_THROUGHPUT), None
    if not estimate:
        raise MemschedError("a device spec is for estimates (estimate=True, --estimate): a measured profile is the "
                            "device's own")
    if throughput is not None or rates is not None:
        raise MemschedError("give a throughput (--throughput) or a device spec (--device-spec), not both: the spec's "
                            "peak FLOP/s and bandwidth are the rates")
    return device_spec.rates(), rounding(device_spec.allocator)


def _fake_mode(pairs, inputs):
    for tensor in tensors_of(inputs) + [p for _, m in pairs if isinstance(m, torch.nn.Module) for p in m.parameters()]:
        if isinstance(tensor, FakeTensor):
            return tensor.fake_mode
    raise MemschedError("estimate mode needs the model and its inputs built under one FakeTensorMode "
                        "(profiles.fake_build.build_fake(factory) does it)")


def _device_of(inputs) -> torch.device:
    tensors = tensors_of(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def _parameter_owners(modules) -> list:
    """Per stage, the parameters (needing gradients) whose gradient its backward creates: the last user owns a
    shared one."""
    seen, owners = set(), [[] for _ in modules]
    for k in reversed(range(len(modules))):
        module = modules[k]
        for parameter in module.parameters() if isinstance(module, torch.nn.Module) else ():
            if parameter.requires_grad and id(parameter) not in seen:
                seen.add(id(parameter))
                owners[k].append(parameter)
    return owners


class _Runner:
    """Runs one stage (or the loss) for memory, then for time."""

    def __init__(self, device, warmup, repeats, fake_mode, rates, size_of=None):
        self.device = torch.device(device)
        self.size_of = size_of  # bytes -> the bytes the target's allocator counts (None: as they are)
        self.fake = fake_mode is not None
        self.warmup, self.repeats = (0, 1) if self.fake else (warmup, repeats)  # FLOPs: the same on every run
        self.rates = rates
        self.ran = set()  # the stages that ran once without failing (a later failure: not repeatable)

    def bytes(self, tensors) -> int:
        """Bytes of the distinct storages behind ``tensors``, as the target's allocator counts them."""
        return storage_bytes(tensors, size_of=self.size_of)

    def stage(self, k, stage_name, module, activation, extra, resident, owned, input_bytes):
        """Profile one stage on ``activation``; return ``(Stage, its output detached)``."""
        call = _guarded(k, stage_name, module, extra, self.ran)
        # Parameters and buffers (a causal mask) exist before the step: saving one allocates nothing.
        parameter_keys = {t.untyped_storage()._cdata for t in module_parameters(module) + module_buffers(module)}
        needs_grad = k > 0 or any(t.requires_grad for t in tensors_of(activation))
        with self._meter() as meter:
            stage_input = fresh_input(activation, needs_grad)
            start = meter.current
            packed = {}  # storage key -> bytes; no references kept, so the backward frees as it goes

            def pack(tensor):
                packed.update(storages([tensor], size_of=self.size_of))  # noqa: F821 (closure, later del)
                return tensor

            clock = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = call(stage_input)
            seconds = [time.perf_counter() - clock]
            forward_peak = meter.peak - start
            outputs = tensors_of(output)
            out_bytes = self.bytes(outputs)
            not_kept = set(storages(tensors_of(stage_input) + resident)) | parameter_keys
            kept = {key: size for key, size in packed.items() if key not in not_kept}
            own_saved_bytes = sum(kept.values())
            output_storages = storages(outputs, size_of=self.size_of)
            kept.update(output_storages)
            saved_bytes = sum(kept.values())
            gradient_bytes = self.bytes([t for t in outputs if t.requires_grad])
            # An output no backward saved is not held at this stage's backward in the model (B k+1 released it):
            # the executor drops it first, and so does the measured backward (release), from a start without it.
            unsaved = sum(size for key, size in output_storages.items() if key not in packed and key not in not_kept)
            saved_outputs = any(key in packed for key in output_storages)
            meter.reset_peak()
            start = meter.current - unsaved
            del output
            clock = time.perf_counter()
            stage_backward(outputs, stage_input, module, release=True)
            seconds.append(time.perf_counter() - clock)
            backward_peak = meter.peak - start - gradient_bytes  # δ_{k+1}: resident in the model, made here
            timed = self._timed_by(meter, seconds)
            del packed, outputs, stage_input
            held_peak = backward_peak
            if saved_outputs:  # and once more with the outputs held to the end, as a pipeline engine holds them
                for parameter in module_parameters(module):
                    parameter.grad = None
                stage_input = fresh_input(activation, needs_grad)
                outputs = tensors_of(call(stage_input))
                meter.reset_peak()
                start = meter.current
                stage_backward(outputs, stage_input, module)
                held_peak = meter.peak - start - gradient_bytes
                del outputs, stage_input
            meter.reset_peak()
            start = meter.current
            with torch.no_grad():
                next_activation = call(fresh_input(activation, False))
            no_grad_peak = meter.peak - start
        param_bytes = self.bytes(list(owned))
        for parameter in module_parameters(module):
            parameter.grad = None
        fwd_time, bwd_time = self._stage_times(call, activation, needs_grad, module, timed)
        stage = Stage(
            name=stage_name, fwd_time=fwd_time, bwd_time=bwd_time, out_bytes=out_bytes, saved_bytes=saved_bytes,
            fwd_tmp_bytes=max(0, forward_peak - saved_bytes), nograd_tmp_bytes=max(0, no_grad_peak - out_bytes),
            bwd_tmp_bytes=max(0, backward_peak - input_bytes), param_bytes=param_bytes, own_saved_bytes=own_saved_bytes,
            held_bwd_tmp_bytes=max(0, backward_peak - input_bytes, held_peak - input_bytes) if saved_outputs else None,
        )
        return stage, tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, next_activation)

    def repeated(self, measured, k, stage_name, module, activation, extra, owned) -> tuple:
        """Stage ``k``, identical to the ``measured`` one (:mod:`profiles.identical`): ``(its Stage, its output
        detached)``, the figures ``measured``'s but for its name and the bytes of the parameters it ``owned``; its
        output from one run without autograd; None when that output's bytes are not ``measured``'s."""
        with torch.no_grad():
            output = _guarded(k, stage_name, module, extra, self.ran)(fresh_input(activation, False))
        if self.bytes(tensors_of(output)) != measured.out_bytes:
            return None
        stage = dataclasses.replace(measured, name=stage_name, param_bytes=self.bytes(list(owned)))
        return stage, tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)

    def with_options(self, k, stage_name, module, stage, activation, extra, count, known, input_bytes) -> Stage:
        """``stage`` with its options (profiles/options.py), measured here or taken from an identical stage in
        ``known`` (fingerprint -> options); a stage whose graph cannot be had (torch.export fails) gets none."""
        needs_grad = k > 0 or any(t.requires_grad for t in tensors_of(activation))
        stage_input = fresh_input(activation, needs_grad)
        try:
            nodes = self._graph_nodes(module, (stage_input, *extra), stage.fwd_time)
        except MemschedError:
            raise
        except Exception:  # noqa: BLE001 (any export failure: the stage runs whole, as rotor runs it)
            return stage
        del stage_input
        fingerprint = structure(nodes, module)
        if fingerprint not in known:  # as extra seconds over the stage's: an identical one adds them to its own
            measured = [self.option(k, stage_name, module, positions, activation, extra, input_bytes)
                        for positions in candidate_recomputes(nodes, count)]
            extras = self._extra_steps(_guarded(k, stage_name, module, extra, self.ran), [run for _, run in measured],
                                       activation, needs_grad, module)
            known[fingerprint] = [dataclasses.replace(option, fwd_time=max(0.0, seconds - option.bwd_time))
                                  for (option, _), seconds in zip(measured, extras)]
        options = [dataclasses.replace(o, fwd_time=stage.fwd_time + o.fwd_time, bwd_time=stage.bwd_time + o.bwd_time)
                   for o in known[fingerprint]]
        return dataclasses.replace(stage, options=pareto_front(stage, options))

    def _graph_nodes(self, module, args, forward_seconds) -> list:
        """:func:`forward_nodes` of the stage on ``args``: on fake copies of them when its forward takes
        :data:`FAKE_NODES_S` or more and it is a graph already (a discovered stage: another module would be exported
        once more, on fake tensors), the same nodes, sizes and FLOPs without the arithmetic (GPT-2 small's lm_head:
        1.1 s at one thread); else, or when the fake run fails (an operation without a fake kernel), on them."""
        if self.fake or forward_seconds < FAKE_NODES_S or not isinstance(module, torch.fx.GraphModule):
            return forward_nodes(module, args)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                return forward_nodes(module, tree_map(
                    lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args))
        except Exception:  # noqa: BLE001 (the real run says what fails, if anything)
            return forward_nodes(module, args)

    def option(self, k, stage_name, module, recompute, activation, extra, input_bytes) -> tuple:
        """Measure stage ``k`` run recomputing the operations at positions ``recompute`` (as the executor runs
        it): ``(StageOption, its run)``, the option's forward seconds left for :meth:`with_options` to set from
        the run. Its seconds are those an option run takes beyond a plain one, which :meth:`with_options` adds to
        the stage's own: for the backward, the recomputation it adds, timed alone (the rest of the backward is the
        plain one); for the forward, the rest of what a forward and backward with the option take beyond plain
        ones (:meth:`_extra_steps`: the graph's and the hooks' own costs, measured 2 ms of a gpt-tiny block's 25).
        A rotor-style schedule runs each ``F_all`` once per ``B``, so the split between the two does not change a
        plan's time.

        Its outputs count as not kept by its backward (``own_saved_bytes`` leaves them out) and its backward's
        temporaries are measured with them held: the executor lets an output go once the next stage has read it,
        and the operation that saved it (a ReLU its result) drops it early in the backward, where the profiler
        holds it; the two together give the peak of ``B``."""
        def call(stage_input):
            return _guarded_run(k, stage_name, lambda: run_with_option(module, recompute, stage_input, *extra),
                                self.ran)

        needs_grad = k > 0 or any(t.requires_grad for t in tensors_of(activation))
        with self._meter() as meter:
            stage_input = fresh_input(activation, needs_grad)
            start = meter.current
            output = call(stage_input)
            forward_peak, kept = meter.peak - start, meter.current - start  # what autograd keeps, the output
            outputs = tensors_of(output)
            out_bytes = self.bytes(outputs)
            gradient_bytes = self.bytes([t for t in outputs if t.requires_grad])
            meter.reset_peak()
            start = meter.current
            stage_backward(outputs, stage_input, module)
            backward_peak = meter.peak - start - gradient_bytes
            del output, outputs, stage_input
        for parameter in module_parameters(module):
            parameter.grad = None
        with torch.enable_grad():
            replay = _guarded_run(k, stage_name, lambda: recomputation(
                module, recompute, fresh_input(activation, needs_grad), *extra), self.ran)
        extra_bwd = self._median(lambda: self._flops_or_time(replay))
        saved = max(kept, out_bytes)
        return StageOption(recompute=tuple(recompute), fwd_time=0.0, bwd_time=extra_bwd, saved_bytes=saved,
                           own_saved_bytes=saved - out_bytes, fwd_tmp_bytes=max(0, forward_peak - saved),
                           bwd_tmp_bytes=max(0, backward_peak - input_bytes)), call

    def loss(self, loss_fn, last_stage, last_input, needs_grad, activation, gradient_bytes) -> Loss:
        """Profile the loss and its backward: transient bytes above ``δ_L``, what its forward leaves, and seconds.

        As in ``loss_fn(model(x)).backward()``, the last stage's graph holds what it saved and nothing else
        holds the output: the last stage runs with autograd first, then the loss gets its output through an
        identity that stops the gradient there (``δ_L`` is made, the stage's backward is not run). Then the
        loss's forward alone with the output held, as a pipeline's last stage runs it: the bytes it leaves
        (its value and saved tensors) are ``saved_bytes``. One run measures both: the output is let go after the
        loss's forward, before its backward (the forward's peak is the same with it held).
        """
        source = torch.zeros((), requires_grad=True)  # made before the window opens: the real step has none

        def forward(output):
            value = loss_fn(HandOver.hand(output, source))
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise MemschedError(f"the loss function must return a scalar tensor, got {type(value).__name__}")
            return value

        def measure(output):
            torch.autograd.grad(forward(output.pop()), [source], allow_unused=True)

        with self._meter() as meter:
            with torch.enable_grad():
                output = last_stage(fresh_input(last_input, needs_grad))
            start = meter.current
            value = _guarded_loss(lambda: forward(output))  # noqa: F821 (closure, later del)
            saved = meter.current - start  # its input still held, as a pipeline's last stage holds it
            del output  # then held by the graph alone, as in the step
            _guarded_loss(lambda: torch.autograd.grad(value, [source], allow_unused=True))  # noqa: F821
            del value
            peak = meter.peak - start
        seconds = self._median(lambda: self._flops_or_time(lambda: _guarded_loss(lambda: measure([activation]))))
        return Loss(bwd_time=seconds, tmp_bytes=max(0, peak - gradient_bytes), saved_bytes=max(0, saved))

    def _meter(self):
        return LiveMemoryTracker(self.size_of, fake=True) if self.fake else memory_meter(self.device)

    def _timed_step(self, call, activation, needs_grad, module) -> tuple:
        """``(forward, backward)`` seconds of one ``call`` on a fresh input and its backward (gradients cleared)."""
        stage_input = fresh_input(activation, needs_grad)
        holder = {}
        fwd = self._flops_or_time(lambda: holder.update(output=call(stage_input)))
        outputs = tensors_of(holder.pop("output"))
        bwd = self._flops_or_time(lambda: stage_backward(outputs, stage_input, module))
        for parameter in module_parameters(module):
            parameter.grad = None
        return fwd, bwd

    def _stage_times(self, call, activation, needs_grad, module, timed=None):
        """The median forward and backward seconds of ``repeats`` timed steps after ``warmup`` ones; one when it
        takes :data:`LONG_STEP_S` or more; ``timed`` (``(forward, backward)`` seconds) when the memory run was
        timing enough (:meth:`_timed_by`)."""
        forward, backward = zip(*([timed] if timed else self._samples(
            lambda: self._timed_step(call, activation, needs_grad, module), sum)))
        return statistics.median(forward), max(0.0, statistics.median(backward) - self._backward_call_cost())

    def _timed_by(self, meter, seconds) -> tuple:
        """``seconds`` (the forward's and the backward's of a stage's memory run) as its timed step, when the run
        is long and the live-memory tracker's Python per operation is a small part of it: at least
        :data:`LONG_STEP_S`, and :data:`TRACKED_OPERATION_S` a tracked operation at most 1% of it (GPT-2 small's
        lm_head: a 3 s step in ~30 operations, not timed again); else None (CUDA's meter, an estimate)."""
        total = sum(seconds)
        if self.fake or not isinstance(meter, LiveMemoryTracker) or total < LONG_STEP_S:
            return None
        return tuple(seconds) if meter.operations * TRACKED_OPERATION_S <= 0.01 * total else None

    def _extra_steps(self, plain, options, activation, needs_grad, module) -> list:
        """For each of ``options`` (stage calls), the median seconds a forward and backward with it take beyond
        a ``plain`` one; at least 0. Timed in rounds, the plain step then each option in turn (one plain step per
        round serves every option: a stage's 4 options take 5 steps a round, not 8), ``2 * repeats + 1`` rounds
        after ``warmup`` ones (a difference is a few percent of either step, the noise of this machine as much),
        or :data:`LONG_STEP_PAIRS` rounds once every option's differences so far lie within
        :data:`AGREEING_SHARE` of the plain step, or for a plain step of :data:`LONG_STEP_S` or more (a long
        warm-up round counted)."""
        if not options:
            return []
        differences = [[] for _ in options]
        for run in range(self.warmup + (1 if self.fake else 2 * self.repeats + 1)):
            base, *times = [sum(self._timed_step(call, activation, needs_grad, module)) for call in (plain, *options)]
            if run >= self.warmup or base >= LONG_STEP_S:
                for found, seconds in zip(differences, times):
                    found.append(seconds - base)
                if len(differences[0]) >= LONG_STEP_PAIRS and (base >= LONG_STEP_S or all(
                        max(found) - min(found) <= AGREEING_SHARE * base for found in differences)):
                    break
        return [max(0.0, statistics.median(found)) for found in differences]

    def _backward_call_cost(self) -> float:
        """Seconds one measured backward spends starting autograd on a trivial graph, which a stage's backward
        inside a whole step does not pay; subtracted from measured backward times (0 when estimating)."""
        if self.fake:
            return 0.0
        if not hasattr(self, "_call_cost"):
            leaf = torch.zeros(1, device=self.device, requires_grad=True)
            samples = []
            for _ in range(20):
                output = leaf * 1.0
                samples.append(self._flops_or_time(lambda: stage_backward([output], leaf, None)))
            self._call_cost = statistics.median(samples[5:])
        return self._call_cost

    def _median(self, measure):
        """The median of :meth:`_samples` of ``measure()`` (seconds)."""
        return statistics.median(self._samples(measure))

    def _samples(self, measure, seconds=lambda sample: sample) -> list:
        """``measure()``'s samples of ``repeats`` runs after ``warmup`` ones, or of the first run alone when its
        ``seconds`` are :data:`LONG_STEP_S` or more (a warm-up's first-use costs are a small part of it)."""
        samples = []
        for run in range(self.warmup + self.repeats):
            sample = measure()
            if run >= self.warmup or seconds(sample) >= LONG_STEP_S:
                samples.append(sample)
                if seconds(sample) >= LONG_STEP_S:
                    break
        return samples

    def _flops_or_time(self, work) -> float:
        """Seconds of ``work()``: its roofline at the rates when estimating, CUDA events on a GPU, else a wall
        clock."""
        if self.fake:
            return roofline(work, self.rates).seconds
        if self.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            begin.record()
            work()
            end.record()
            torch.cuda.synchronize(self.device)
            return begin.elapsed_time(end) / 1000.0
        started = time.perf_counter()
        work()
        return time.perf_counter() - started


def _guarded(k, stage_name, module, extra, ran):
    return lambda stage_input: _guarded_run(k, stage_name, lambda: module(stage_input, *extra), ran)


def _guarded_run(k, stage_name, run, ran):
    """``run()``, a failure of the user's stage told in one line: on its example input when the stage has not
    run yet, else (``k`` in ``ran``, the stages that ran once) as a stage that cannot run again on the same input,
    as recomputation runs it."""
    try:
        value = run()
    except MemschedError:
        raise
    except Exception as exc:  # a user's stage failing is an expected error: name it
        message = " ".join(str(exc).split())
        if k in ran:
            raise MemschedError(
                f"stage {k} ({stage_name}) ran once on its example input but failed when run again on the same "
                f"input, as recomputation runs it: it is not repeatable (an in-place write to an input or to a "
                f"value it shares with other stages?): {type(exc).__name__}: {message}") from None
        raise MemschedError(f"stage {k} ({stage_name}) failed on its example input: "
                            f"{type(exc).__name__}: {message}") from None
    ran.add(k)
    return value


def _guarded_loss(run):
    try:
        return run()
    except MemschedError:
        raise
    except Exception as exc:
        message = " ".join(str(exc).split())
        raise MemschedError(f"the loss function failed on the last stage's output: "
                            f"{type(exc).__name__}: {message}") from None

"""The executor on offload plans (planner/execute/offload.py): the plain step, exactly, at the predicted peak.

Offload plans are built by hand from compute schedules: store-all with each ``saved i`` offloaded after
``F_all i``, released two forwards later and prefetched before ``B i+1``; and the schedules of Rotor plans
with their checkpoints (``input i``) offloaded between reads. Each planned step is compared with the plain
step (loss and gradients, dropout masks replayed, BatchNorm statistics updated once), its peak measured by
the live-memory tracker against the offload simulator's prediction, and against the same plan without its
transfers (the memory is really freed). On CPU the copies are synchronous and the host copies are NumPy
arrays, outside the tracker's device accounting.
"""

import copy
import dataclasses
import gc

import pytest
import torch
from test_execute_chain import FIDELITY, SEED, clear_grads, grads, input_bytes, plain_step, profiled_models
from test_execute_fusion import store_all_offloaded
from torch.testing import assert_close

from checks import one_line
from planner import MemschedError, Op, Plan, Predicted, simulate
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.offload import OffloadStepRun, live_copies
from planner.ops import TRANSFER_OPS
from planner.simulate.chain import ChainSimulator
from planner.simulate.offload import reads
from planner.transfer import Transfer
from solvers import solve, store_all_peak

CHANNEL = Transfer(d2h_bandwidth=12e9, h2d_bandwidth=12e9, latency=1e-5)
MODELS = ("mlp", "gpt-tiny", "resnet-tiny")
# The fidelity sizes of tests/execute/test_execute_chain.py, the mlp shortened (its 32 layers add time, not coverage).
SPECS = {**FIDELITY, "mlp": "mlp:layers=12"}
DEFAULT_THREADS = torch.get_num_threads()  # what the ``models`` fixture profiles at
RATIOS = {}  # (model, plan) -> measured / predicted peak, printed at the end (pytest -s)


# --------------------------------------------------------------------------------------------------
# Plans by hand


def with_offloads(chain, schedule, kinds=("input",)) -> tuple:
    """``schedule`` (no transfers) with each item of ``kinds`` offloaded after a touch (its production or a
    read) when at least two operations pass before its next read: released after the first of them,
    prefetched before the last."""
    compute = ChainSimulator(chain)
    state = compute.initial_state()
    touches, lives = {}, []
    for position, op in enumerate(schedule):
        for item in reads(chain, state, op):
            if item in touches:
                touches[item].append(position)
        state, _, _ = compute.step(state, op)
        for item in list(touches):  # an item whose memory is gone: its life ends here
            what, i = item
            alive = state.abar >> (i + 1) & 1 if what == "saved" else state.standalone >> i & 1
            if not alive:
                lives.append(touches.pop(item) + [None])
                lives[-1].insert(0, item)
        if op.kind == "F_all" and "saved" in kinds:
            touches[("saved", op.stage)] = [position]
        elif op.kind in ("F_ck", "F_none") and "input" in kinds:
            touches[("input", op.stage + 1)] = [position]
    assert not touches
    before, after = {}, {}
    for item, *positions, _ in lives:
        for touch, read in zip(positions, positions[1:]):
            if read - touch - 1 >= 2:
                after.setdefault(touch, []).append(Op("Offload", item[1], item[0]))
                after.setdefault(touch + 1, []).append(Op("Release", item[1], item[0]))
                before.setdefault(read - 1, []).append(Op("Prefetch", item[1], item[0]))
    out = []
    for position, op in enumerate(schedule):
        out += before.get(position, []) + [op] + after.get(position, [])
    return tuple(out)


def without_transfers(schedule) -> tuple:
    return tuple(op for op in schedule if op.kind not in TRANSFER_OPS)


def plan_of(chain, schedule) -> Plan:
    """A plan for ``schedule``, predicted by the simulator (offload simulator when it moves data)."""
    moves = any(op.kind in TRANSFER_OPS for op in schedule)
    result = simulate(chain, schedule, CHANNEL if moves else None)
    return Plan(problem_name=chain.name, fingerprint=chain.fingerprint(), solver="by hand",
                budget_bytes=result.peak_bytes, predicted=Predicted(result.peak_bytes, result.time, result.time),
                schedule=tuple(schedule), transfer=CHANNEL if moves else None)


def measured_step(model, plan, chain):
    """``(loss, grads, measured peak)`` of one planned step from the fixed seed."""
    planned = apply_plan(model.stages, plan, chain)
    clear_grads(model)
    torch.manual_seed(SEED)
    with LiveMemoryTracker() as tracker:
        loss = model.loss_fn(planned(*model.example_inputs))
        loss.backward()
    result = grads(model)
    clear_grads(model)
    return loss.detach(), result, tracker.peak + input_bytes(model.example_inputs)


def rotor_offloaded(chain, kinds=("input",)):
    """A Rotor plan at half the store-all peak, with its standalone activations offloaded between reads."""
    rotor = solve(chain, int(0.5 * store_all_peak(chain)), "rotor")
    schedule = with_offloads(chain, rotor.schedule, kinds)
    assert any(op.kind == "Offload" and op.what in kinds for op in schedule)
    return schedule


# name -> (schedule from the chain, the most its measured peak may be of the same plan's without transfers, or
# None where the plan is not meant to lower the peak: prefetching everything after the loss, offloading only
# Rotor's checkpoints, which are not what its peak holds)
PLANS = {
    "store-all": (lambda chain: store_all_offloaded(chain.length), 0.5),
    "store-all, prefetch after the loss": (lambda chain: store_all_offloaded(chain.length, prefetch_ahead=True), None),
    "rotor, checkpoints offloaded": (rotor_offloaded, None),
    "rotor, everything offloaded": (lambda chain: rotor_offloaded(chain, ("input", "saved")), 0.95),
}


# --------------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def models():
    """``{name: (model, chain, plain loss, plain grads)}``."""
    return profiled_models({name: SPECS[name] for name in MODELS})


@pytest.fixture
def threaded(models, threads, per_thread_count):
    """``models`` profiled at ``threads`` (once per count; at the default count, ``models`` itself)."""
    if threads not in per_thread_count:
        per_thread_count[threads] = (models if threads == DEFAULT_THREADS
                                     else profiled_models({name: SPECS[name] for name in MODELS}))
    return per_thread_count[threads]


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if RATIOS:
        print("\nmeasured / predicted peak: offload plan, same plan without transfers; measured peak of the "
              "offload plan / of the plan without transfers")
        for (name, plan), (ratio, bare, versus) in sorted(RATIOS.items()):
            extra = "" if bare is None else f"  {bare:.4f}   {versus:.3f}"
            print(f"  {name:12s} {plan:36s} {ratio:.4f}{extra}")


# --------------------------------------------------------------------------------------------------
# 1. The plain step, at the predicted peak, with less memory than without the transfers


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_offload_plan_is_the_plain_step_at_the_predicted_peak(threaded, name, plan_name):
    model, chain, loss, reference = threaded[name]
    make, most = PLANS[plan_name]
    schedule = make(chain)
    plan = plan_of(chain, schedule)
    gc.collect()
    slots_before = live_copies()[0]  # (0 unless a failed step elsewhere still holds its boxes)

    planned_loss, planned, measured = measured_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)

    gc.collect()
    assert live_copies() == (slots_before, 0), "storages or host copies left in a box after the step"

    predicted = plan.predicted.peak_bytes
    RATIOS[(name, plan_name)] = (measured / predicted, None, None)
    assert abs(measured / predicted - 1) <= 0.02, (measured, predicted, measured / predicted)
    if most is not None:  # the memory is really freed: well below the same plan without its transfers
        bare = plan_of(chain, without_transfers(schedule))
        _, bare_grads, bare_measured = measured_step(model, bare, chain)
        assert_close(bare_grads, reference)
        RATIOS[(name, plan_name)] = (measured / predicted, bare_measured / bare.predicted.peak_bytes,
                                     measured / bare_measured)
        assert measured <= most * bare_measured, (measured, bare_measured, measured / bare_measured)


def transfer_deltas(model, plan, chain, monkeypatch) -> dict:
    """``{schedule position: bytes the tracker saw it allocate (+) or free (-)}`` for each transfer of one
    planned step."""
    tracker, seen = LiveMemoryTracker(), {}
    original = OffloadStepRun.run

    def run(self, position):
        before = tracker.current
        original(self, position)
        if self.planned.schedule[position].kind in TRANSFER_OPS:
            seen[position] = tracker.current - before

    monkeypatch.setattr(OffloadStepRun, "run", run)
    planned = apply_plan(model.stages, plan, chain)
    clear_grads(model)
    torch.manual_seed(SEED)
    with tracker:
        model.loss_fn(planned(*model.example_inputs)).backward()
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_each_transfer_changes_the_memory_as_simulated(models, name, monkeypatch):
    """Each Release frees, and each Prefetch allocates, exactly the bytes the simulator moves (Offload none):
    the device copies are really freed and allocated when the plan says. (Between operations the levels may
    differ where stages run fused: one autograd call then does several backwards at the first one's B.)"""
    model, chain, _, _ = models[name]
    plan = plan_of(chain, rotor_offloaded(chain, ("input", "saved")))
    timeline = simulate(chain, plan.schedule, CHANNEL).timeline
    seen = transfer_deltas(model, plan, chain, monkeypatch)
    clear_grads(model)
    transfers = [step for step in timeline if step.op.kind in TRANSFER_OPS]
    assert len(seen) == len(transfers) and any(step.op.kind == "Release" for step in transfers)
    for step in transfers:
        moved = step.memory_after - step.memory_before  # a recomputed BatchNorm also saves its statistics (copies)
        assert abs(seen[step.index] - moved) <= 0.01 * abs(moved), (str(step.op), seen[step.index],
                                                                            step.memory_after - step.memory_before)


@pytest.mark.parametrize("name", MODELS)
def test_a_plan_of_the_offload_solver(models, name):
    """A plan from solvers/offload/ (the greedy, at 60% of the store-all peak) runs as the hand-built ones."""
    model, chain, loss, reference = models[name]
    plan = solve(chain, int(0.6 * store_all_peak(chain)), "offload_greedy", transfer=CHANNEL)
    assert plan.moves_data and plan.transfer is not None
    planned_loss, planned, measured = measured_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)
    RATIOS[(name, "offload_greedy at 60%")] = (measured / plan.predicted.peak_bytes, None, None)
    assert abs(measured / plan.predicted.peak_bytes - 1) <= 0.02, (measured, plan.predicted.peak_bytes)


def test_batchnorm_statistics_are_updated_once(models):
    original, chain, _, _ = models["resnet-tiny"]
    plan = plan_of(chain, rotor_offloaded(chain, ("input", "saved")))
    assert plan.recomputed_forwards > 0
    plain_model, planned_model = copy.deepcopy(original), copy.deepcopy(original)
    plain_step(plain_model)
    measured_step(planned_model, plan, chain)
    buffers = [{f"{n}.{k}": b for n, m in model.stages for k, b in m.named_buffers()}
               for model in (plain_model, planned_model)]
    assert_close(buffers[1], buffers[0])


def test_dropout_masks_are_replayed(models):
    model, chain, loss, reference = models["gpt-tiny"]
    assert model.options["dropout"] > 0
    other, _ = plain_step(model, seed=SEED + 1)
    assert other != loss
    plan = plan_of(chain, rotor_offloaded(chain, ("input", "saved")))
    assert plan.recomputed_forwards > 0
    planned_loss, planned, _ = measured_step(model, plan, chain)
    assert_close(planned_loss, loss)
    assert_close(planned, reference)


def test_two_steps_accumulate_and_leave_nothing(models):
    model, chain, _, reference = models["mlp"]
    plan = plan_of(chain, store_all_offloaded(chain.length))
    planned = apply_plan(model.stages, plan, chain)
    clear_grads(model)
    for _ in range(2):
        torch.manual_seed(SEED)
        model.loss_fn(planned(*model.example_inputs)).backward()
    twice = grads(model)
    clear_grads(model)
    assert_close(twice, {key: 2 * g for key, g in reference.items()})
    gc.collect()
    assert live_copies()[1] == 0


# --------------------------------------------------------------------------------------------------
# 2. Reading an item on the host fails loudly; a plan without a channel is refused


def unvalidated_plan(chain, schedule) -> Plan:
    """A plan the simulator would refuse, built without asking it (the executor does not solve or simulate)."""
    return Plan(problem_name=chain.name, fingerprint=chain.fingerprint(), solver="by hand", budget_bytes=1,
                predicted=Predicted(1, 0.0, 0.0), schedule=tuple(schedule), transfer=CHANNEL)


@pytest.fixture
def unchecked(monkeypatch):
    """``apply_plan`` without the checks it makes first (planner/simulate's ``check_schedule`` and the replay of
    ``check_within_budget``, which refuse these schedules in one line; tests/cli/test_bad_inputs.py): the executor's
    own guards are what is tested."""
    monkeypatch.setattr("planner.execute.chain.check_schedule", lambda schedule, length: None)
    monkeypatch.setattr("planner.execute.chain.check_within_budget", lambda problem, plan: None)


def test_a_saved_item_read_by_the_backward_on_the_host_fails_loudly(models, unchecked):
    model, chain, _, _ = models["mlp"]
    schedule = [op for op in store_all_offloaded(chain.length) if op != Op("Prefetch", 1, "saved")]
    with pytest.raises(MemschedError, match="simulator|schedule"):
        simulate(chain, schedule, CHANNEL)  # the simulator refuses it...
    planned = apply_plan(model.stages, unvalidated_plan(chain, schedule), chain)
    with pytest.raises(MemschedError) as excinfo:  # ... and the executor's own guard catches it
        model.loss_fn(planned(*model.example_inputs)).backward()
    one_line(excinfo, "saved 1", "on the host", "Prefetch 1 saved")
    clear_grads(model)


def test_an_activation_read_by_a_forward_on_the_host_fails_loudly(models, unchecked):
    model, chain, _, _ = models["mlp"]
    # a_1 is offloaded and released after F_ck 0, then read by F_ck 1 without a prefetch.
    schedule = [Op("F_ck", 0), Op("Offload", 1, "input"), Op("Release", 1, "input"), Op("F_ck", 1)]
    schedule += [Op("F_all", i) for i in range(2, chain.length)] + [Op("Loss")]
    schedule += [Op("B", i) for i in reversed(range(2, chain.length))]
    schedule += [Op("F_all", 1), Op("B", 1), Op("F_all", 0), Op("B", 0)]
    planned = apply_plan(model.stages, unvalidated_plan(chain, schedule), chain)
    with pytest.raises(MemschedError) as excinfo:
        planned(*model.example_inputs)
    one_line(excinfo, "F_ck 1", "input 1", "on the host")


@pytest.mark.parametrize(("transfers", "words"), [
    ((Op("Release", 0, "saved"),), ("Release 0 saved", "on the device, not being offloaded")),
    ((Op("Offload", 0, "saved"), Op("Prefetch", 0, "saved")), ("Prefetch 0 saved", "not on the host")),
    ((Op("Offload", 3, "input"),), ("Offload 3 input", "never made")),
])
def test_transfers_out_of_order_fail_loudly(models, transfers, words, unchecked):
    model, chain, _, _ = models["mlp"]
    schedule = (Op("F_all", 0),) + transfers + without_transfers(store_all_offloaded(chain.length))[1:]
    planned = apply_plan(model.stages, unvalidated_plan(chain, schedule), chain)
    with pytest.raises(MemschedError) as excinfo:
        planned(*model.example_inputs)
    one_line(excinfo, *words)


@pytest.mark.parametrize("transfers", [(Op("Release", 0, "saved"),),
                                       (Op("Offload", 0, "saved"), Op("Prefetch", 0, "saved")),
                                       (Op("Offload", 3, "input"),)])
def test_apply_plan_refuses_a_schedule_out_of_order_before_running(models, transfers):
    """Without the monkeypatch above, ``apply_plan`` replays the simulator's rules first: one line naming the
    operation's index, nothing run."""
    model, chain, _, _ = models["mlp"]
    schedule = (Op("F_all", 0),) + transfers + without_transfers(store_all_offloaded(chain.length))[1:]
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(model.stages, unvalidated_plan(chain, schedule), chain)
    one_line(excinfo, "schedule[", str(transfers[-1]))


def test_a_plan_with_transfers_and_no_channel_is_refused(models):
    model, chain, _, _ = models["mlp"]
    plan = plan_of(chain, store_all_offloaded(chain.length))
    stripped = dataclasses.replace(plan, transfer=None)
    with pytest.raises(MemschedError) as excinfo:
        apply_plan(model.stages, stripped, chain)
    one_line(excinfo, "transfer")


# --------------------------------------------------------------------------------------------------
# 3. Hooks only for plans with transfers


def _seen_by_outer_hooks(model, forward) -> int:
    """How many saved tensors an outer ``saved_tensors_hooks`` sees in one step (an inner one hides them)."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        loss = model.loss_fn(forward())
    loss.backward()
    clear_grads(model)
    return len(seen)


def test_no_hooks_without_transfers(models):
    model, chain, _, _ = models["mlp"]
    bare = apply_plan(model.stages, plan_of(chain, without_transfers(store_all_offloaded(chain.length))), chain)
    offloaded = apply_plan(model.stages, plan_of(chain, store_all_offloaded(chain.length)), chain)
    output = bare(*model.example_inputs).detach().requires_grad_(True)
    loss_only = _seen_by_outer_hooks(model, lambda: output)
    assert bare.run_type.__name__ == "StepRun"
    assert _seen_by_outer_hooks(model, lambda: bare(*model.example_inputs)) > loss_only + 2 * chain.length
    assert _seen_by_outer_hooks(model, lambda: offloaded(*model.example_inputs)) == loss_only

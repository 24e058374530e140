"""Data parallelism with ZeRO 1 (ZeroRedundancyOptimizer), 2 and 3 (FSDP2): planner/sharding.py,
planner/execute/sharded.py and data_parallel.py.

The model of a rank's step is checked by hand on a small chain and against live modules' shards; then 2 gloo
processes train a ResNet-like (BatchNorm) and a tiny Hugging Face GPT-2 (tied embeddings, kept whole) for ZeRO 1,
2 and 3 by a plan that recomputes: each rank's measured peak is within 0.5% of the prediction (measured: 8 bytes;
at the machine's default thread count and at one), the losses of 3 Adam steps and the first step's gradients equal
single-process training (the whole batch in one step; for BatchNorm, which normalises over each rank's part as
data parallelism without SyncBatchNorm does, each part's step in one process, gradients averaged).

Each launch spawns 2 processes (5-15 s here): the six trainings share one launch per thread count (``trained``).
"""

import functools
import warnings

import pytest
import torch

import cli
import solvers
from checks import at_thread_count, one_after_another, one_error_line, one_line
from planner import MemschedError, load_plan
from planner.chain import Chain, Loss, Stage
from planner.execute import data_parallel
from planner.execute.data_parallel import run_data_parallel
from planner.execute.pipeline import launch_ranks
from planner.execute.records import parameter_layout
from planner.execute.stages import named_stages, rank_slice, run_stages, trainable_parameters
from planner.layout import ParameterRows
from planner.setup import TrainingSetup, lower
from planner.sharding import (
    ShardUnit,
    check_sharding,
    rank_residents,
    shard_units,
    sharded_chain,
    step_constant,
    zero1_partition,
)
from planner.simulate import simulate
from planner.units import describe_bytes
from profiles.chain_profiler import profile_chain
from profiles.memory import memory_meter
from profiles.spec import built_model
from solvers.minimum import minimum_budget

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available in this PyTorch build")

RESNET = "resnet-tiny:blocks=3,channels=16,size=16,batch=8"
GPT2 = "tests/fixtures/hf_gpt2.py:build"
STEPS, LR = 3, 1e-2
CONFIGS = [(RESNET, 3), (RESNET, 2), (RESNET, 1), (GPT2, 3), (GPT2, 2), (GPT2, 1)]  # (model, ZeRO stage)
# What trains at each thread count: every configuration at the default one, ZeRO 3 (each stage's parameters gathered
# and its gradients reduce-scattered: the others' steps and more) at one
AT_COUNT = {"default": CONFIGS, 1: [(RESNET, 3), (GPT2, 3)]}


def test_sharded_chain_by_hand():
    stage = dict(fwd_time=1.0, bwd_time=2.0, out_bytes=100, saved_bytes=300, fwd_tmp_bytes=10, bwd_tmp_bytes=50)
    chain = Chain(name="two", device="cpu", input_bytes=40, loss=Loss(),
                  stages=(Stage(name="a", param_bytes=1000, **stage), Stage(name="b", param_bytes=600, **stage)))
    units = [ShardUnit(gathered=1008, shard=504, gradients=1000), ShardUnit(gathered=600, shard=300, gradients=600)]
    three = sharded_chain(chain, 3, units)
    a, b = three.stages
    assert (a.fwd_tmp_bytes, a.nograd_tmp_bytes, a.param_bytes) == (10 + 2016, 10 + 2016, 504)
    # the backward: its temporaries + the whole parameters, the all-gather before δ_i (2 * 1008 - 40), or the
    # reduce-scatter input beside every gradient once the saved tensors and the output are gone
    assert a.bwd_tmp_bytes == max(50 + 1008, 2016 - 40, 1000 + 1008 - 300 - 100) == 1976
    assert b.bwd_tmp_bytes == max(50 + 600, 1200 - 100, 600 + 600 - 300 - 100) == 1100
    two = sharded_chain(chain, 2, units)
    assert [s.fwd_tmp_bytes for s in two.stages] == [10, 10]  # ZeRO 2 all-gathers at the step's start
    assert [s.bwd_tmp_bytes for s in two.stages] == [max(50, 1000 + 1008 - 400), max(50, 600 + 600 - 400)]
    assert [s.param_bytes for s in two.stages] == [504, 300]
    assert (step_constant(2, units), step_constant(3, units)) == (1608, 0)
    # the layout these units come from: 125 rows of 8 bytes (padded to 126) beside a shared 16-byte parameter
    layout = ((ParameterRows(125, 8, "trainable"), ParameterRows(4, 4, "shared")),
              (ParameterRows(150, 4, "trainable"),))
    assert shard_units(layout, 2) == units
    assert rank_residents(3, 2, layout) == [(804 + 16) * 3] * 2  # fp32 and Adam's two moments
    bf16 = TrainingSetup(precision="bf16", zero=3, dp=2).per_parameter_byte()  # 2-byte parameters, 4 + 8 of state
    assert rank_residents(3, 2, layout, bf16) == [(804 + 16) * (2 + 4 + 8) // 4] * 2
    one = sharded_chain(chain, 1, units)  # ZeRO 1: the chain's own step
    assert [s.bwd_tmp_bytes for s in one.stages] == [50, 50] and [s.param_bytes for s in one.stages] == [1000, 600]


def test_zero1_splits_the_state_as_zero_redundancy_optimizer_does():
    # the largest first, each to the rank holding least (the lowest on a tie), ties kept in order
    assert zero1_partition([40, 100, 60, 40, 20], 2) == [1, 0, 1, 0, 1]
    layout = (tuple(ParameterRows(size // 4, 4, "trainable") for size in (40, 100, 60, 40, 20)),)
    assert rank_residents(1, 2, layout) == [260 + 2 * 140, 260 + 2 * 120]


def test_units_pad_rows_and_leave_shared_parameters_whole():
    first, second = torch.nn.Linear(3, 5), torch.nn.Linear(5, 5)
    second.weight = torch.nn.Parameter(torch.zeros(5, 5))
    tied = torch.nn.Linear(5, 5)
    tied.weight = second.weight  # read by stages 1 and 2: kept whole
    units = shard_units(parameter_layout([("a", first), ("b", second), ("c", tied)]), dp=2)
    # weight 5x3: rows padded to 6, 3 per rank; bias 5 -> 6, 3 per rank
    assert units[0] == ShardUnit(gathered=6 * 3 * 4 + 6 * 4, shard=3 * 3 * 4 + 3 * 4, gradients=(15 + 5) * 4)
    assert units[1] == units[2] == ShardUnit(gathered=6 * 4, shard=3 * 4, gradients=5 * 4)


def test_refusals():
    for zero in (0, 4, True):
        with pytest.raises(MemschedError, match="data parallelism runs ZeRO 1"):
            check_sharding(zero, 2)
    with pytest.raises(MemschedError, match="at least 2 ranks"):
        check_sharding(3, 1)
    model = built_model(RESNET)
    with pytest.raises(MemschedError, match="batch of 8 does not split over 3 data-parallel ranks"):
        rank_slice(model, 0, 3)


def test_a_rank_slice_cuts_the_inputs_and_the_loss_target():
    model = built_model("gpt-tiny:layers=1,d=16,heads=2,seq=8,vocab=32,batch=4,dropout=0")  # a row per token
    whole = model.loss_fn(run_stages(model.stages, model.example_inputs))
    parts = [rank_slice(model, rank, 2) for rank in range(2)]
    assert [tuple(p.example_inputs[0].shape) for p in parts] == [(2, 8), (2, 8)]
    losses = [p.loss_fn(run_stages(p.stages, p.example_inputs)) for p in parts]
    torch.testing.assert_close(sum(losses) / 2, whole)


def _rank_chain(spec):
    """The chain of rank 0's part of ``spec``'s batch, profiled at the current thread count."""
    model = built_model(spec, part=(0, 2))
    return profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, warmup=1, repeats=1,
                         name=model.name)


def _planned(spec, zero, fraction=0.25, chain=None):
    """One rank's sharded chain (``chain``, or rank 0's part profiled now), a plan that recomputes (a ``fraction``
    of the way from the least feasible budget to the store-all peak), and its predicted peak."""
    chain = _rank_chain(spec) if chain is None else chain
    setup = TrainingSetup(zero=zero, dp=2)
    lowered = lower(chain, setup)  # one rank's step
    least = minimum_budget(lowered.chain) + lowered.held_bytes
    top = solvers.store_all_peak(lowered.chain) + lowered.held_bytes
    plan = solvers.solve(chain, int(least + (top - least) * fraction), "rotor", setup)
    assert any(op.kind in ("F_ck", "F_none") for op in plan.schedule), "the plan should recompute"
    assert simulate(chain, plan).peak_bytes == plan.predicted.peak_bytes  # the simulator lowers it the same way
    return chain, plan, plan.predicted.peak_bytes


@functools.cache
def _reference(spec, per_part: bool, threads: int):
    """Single-process training at ``threads`` torch threads (the current count): ``(losses, first gradients)``
    over STEPS Adam steps on the whole batch, or, with ``per_part``, on each rank's part in turn (the parts' mean
    loss and gradients)."""
    assert threads == torch.get_num_threads()
    model = built_model(spec)
    parts = [rank_slice(model, rank, 2) for rank in range(2)] if per_part else [model]
    parameters = trainable_parameters(model.stages)
    optimizer = torch.optim.Adam(parameters, lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for part in parts:
            loss = part.loss_fn(run_stages(part.stages, part.example_inputs)) / len(parts)
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        if grads is None:  # each named at the first stage reading it, as the ranks name them
            grads = {}
            for stage, module in named_stages(model.stages):
                for name, p in module.named_parameters():
                    if p.requires_grad and all(p is not q for q, _ in grads.values()):
                        grads[f"{stage}.{name}"] = (p, p.grad.clone())
            grads = {name: grad for name, (_, grad) in grads.items()}
        optimizer.step()
    return losses, grads


def _rank_jobs(planned: dict, threads: int) -> list:
    """What ``run_data_parallel`` would launch for each configuration (after its checks in this process: the
    chain's record against the model, the plan's kind), captured instead of launched."""
    jobs = []

    def capture(job, world, device, progress_timeout, label, threads):
        assert (world, device, label) == (2, "cpu", "data-parallel")
        jobs.append(job)
        return []

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data_parallel, "launch_ranks", capture)
        for (spec, zero), (sharded, plan, predicted) in planned.items():
            run_data_parallel(functools.partial(built_model, spec), plan, zero, 2, STEPS, meter=memory_meter, lr=LR,
                              predicted=predicted, chain=sharded, return_grads=True, progress_timeout=120,
                              threads=threads)
    return jobs


@pytest.fixture(scope="module")
def trained(request):
    """The configurations of AT_COUNT trained on 2 gloo ranks in one launch, at the machine's default thread count
    and then at one (``request.param``; each rank's and this process's, kept for the module's tests at that count):
    ``{(spec, zero): (predicted peak, each rank's DataParallelResult)}``. One launch per count, not one per
    configuration: a launch is 5-15 s of process start and imports."""
    configs = AT_COUNT[request.param]
    count = at_thread_count(request.param)
    threads = next(count)
    chains = {spec: _rank_chain(spec) for spec in dict.fromkeys(spec for spec, _ in configs)}  # one profile a model
    planned = {(spec, zero): _planned(spec, zero, chain=chains[spec]) for spec, zero in configs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes when the ranks build the model
        jobs = _rank_jobs(planned, threads)
        ranks = launch_ranks(functools.partial(one_after_another, jobs=jobs), 2, "cpu", 120, label="data-parallel",
                             threads=threads)
    yield {config: (planned[config][2], [results[i] for results in ranks]) for i, config in enumerate(configs)}
    next(count, None)  # the count before, restored


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("trained, spec, zero", [(count, spec, zero) for count, configs in AT_COUNT.items()
                                                 for spec, zero in configs], indirect=["trained"], scope="module")
def test_ranks_train_as_one_process_within_the_predicted_peak(trained, spec, zero):
    predicted, results = trained[spec, zero]
    assert [r.rank for r in results] == [0, 1] and all(r.predicted == predicted for r in results)
    for r in results:  # the issue asks for 2%; measured here: within 8 bytes
        assert abs(r.measured / predicted - 1) < 0.005, (r.rank, r.measured, predicted)
    losses, grads = _reference(spec, spec == RESNET, torch.get_num_threads())
    for r in results:
        assert r.losses == pytest.approx(losses, rel=1e-5)
        assert set(r.grads) == set(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(r.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.multiprocess
def test_cli_trains_on_two_ranks_within_what_a_device_leaves(capsys):
    assert cli.main(["train", RESNET, "--dp", "2", "--budget", "auto", "--device-memory", "4MiB", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "data parallel: 2 ranks, ZeRO 3 on FSDP2's fully_shard" in out
    assert "budget per rank: device 4194304 bytes (4.0 MiB)" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2
    for row in rows:
        measured, predicted = (int(value.replace(",", "")) for value in row[1:3])
        assert abs(measured / predicted - 1) < 0.02


@pytest.mark.multiprocess
def test_cli_trains_by_a_plan_solved_for_the_sharded_step(capsys, tmp_path):
    """profile one rank's part of the batch, solve it for ZeRO 2 over 2 ranks, train --dp by that plan."""
    chain, plan = tmp_path / "rank.chain.json", tmp_path / "zero2.plan.json"
    assert cli.main(["profile", RESNET.replace("batch=8", "batch=4"), "--warmup", "0", "--repeats", "1",
                     "--options", "0", "-o", str(chain)]) == 0
    assert cli.main(["solve", str(chain), "--zero", "2", "--dp", "2", "--budget", "70%", "-o", str(plan)]) == 0
    solved = load_plan(plan)
    assert solved.setup == TrainingSetup(zero=2, dp=2) and any(op.kind == "F_ck" for op in solved.schedule)
    capsys.readouterr()
    assert cli.main(["train", RESNET, "--dp", "2", "--zero", "2", "--plan", str(plan), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert f"predicted peak of a rank's step {describe_bytes(solved.predicted.peak_bytes)}" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2
    for row in rows:
        measured, predicted = (int(value.replace(",", "")) for value in row[1:3])
        assert predicted == solved.predicted.peak_bytes and abs(measured / predicted - 1) < 0.02
    for argv, message in (([*"--dp 2 --zero 3 --plan".split(), str(plan)], "give --zero 2 --dp 2"),
                          ([*"--dp 2 --zero 2 --budget 50% --plan".split(), str(plan)], "drop --budget")):
        one_error_line(cli.main(["train", RESNET, *argv]), *capsys.readouterr(), message)
    one_error_line(cli.main(["solve", str(chain), *"--zero 2 --dp 2 --budget 70% --solver pofo".split()]),
                   *capsys.readouterr(), "does not mix with --dp")
    one_error_line(cli.main(["train", RESNET.replace("batch=8", "batch=4"), "--plan", str(plan)]),  # one process
                   *capsys.readouterr(), "start 2 ranks (torchrun --nproc_per_node 2", "--dp 2 --zero 2 --plan")


@pytest.mark.parametrize("extra, message", [
    (["--dp", "2", "--zero", "4"], "zero: the ZeRO stage must be 0, 1, 2 or 3, got 4"),
    (["--zero", "3"], "give --dp and --budget"),
    (["--dp", "2", "--compile"], "--compile does not mix with --dp"),
    (["--dp", "2", "--update", "in-backward"], "--update in-backward does not mix with --dp"),
    (["--dp", "1"], "at least 2 ranks"),
])
def test_cli_refuses_what_a_sharded_run_cannot_do(extra, message, capsys):
    one_error_line(cli.main(["train", RESNET, "--budget", "50%", *extra]), *capsys.readouterr(), message)


def _fails_on_rank_1(part):
    if part[0] == 1:
        raise RuntimeError("broken on purpose")
    return built_model(RESNET, part=part)


@pytest.mark.multiprocess
def test_a_failing_rank_is_one_line_naming_it():
    model = _fails_on_rank_1((0, 2))
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, warmup=0, repeats=1)
    plan = solvers.solve(chain, 10**9, "store_all", TrainingSetup(zero=3, dp=2))
    with pytest.raises(MemschedError) as caught:
        run_data_parallel(_fails_on_rank_1, plan, 3, 2, 1, meter=memory_meter, predicted=1, progress_timeout=60)
    assert one_line(caught).startswith("data-parallel rank 1 failed: RuntimeError: broken on purpose")

"""The pipeline executor (planner/execute/pipeline.py): plans of kind ``pipeline`` from solvers/partition.py run on
``torch.distributed.pipelining`` with 2 gloo processes on the CPU.

Losses and parameter gradients equal single-process training of the same model on the same batch (the
schedules scale gradients by 1/m; the loss is a mean, so the micro-batch mean equals the batch mean), for
store-all devices and for a device that recomputes (planner/execute/chain.py inside the stage). Each rank's
measured peak (the last step's window: parameter gradients allocated inside it) is within 5% of the plan's
device peak less what exists before the window (resident parameters and optimizer state, the batch on rank
0, PipelineStage's receive buffers elsewhere), under 1F1B and GPipe (planner/simulate/pipeline.py walks
each device's phases in PyTorch's order); the first step's peak is larger by the receive buffers it makes.

Each run spawns 2 processes (5-15 s here).
"""

import dataclasses
import functools
import json

import pytest
import torch

from checks import one_after_another, one_error_line, one_line
from oracles.pipeline_plans import store_all_split
from planner import MemschedError
from profiles.chain_profiler import profile_chain
from profiles.memory import memory_meter
from profiles.spec import built_model, load_model
from solvers.partition import PartitionProblem, least_device_memory, partition

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with the gloo backend is not available in this PyTorch build")

SPEC = "mlp:layers=8,width=64"
MICRO, M = 64, 4


def profiled(spec, micro):
    """The chain profile of ``spec`` at one micro-batch of ``micro``."""
    model, _ = load_model(spec, batch=micro)
    return profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, warmup=1, repeats=1,
                         name=model.name)


@pytest.fixture(scope="module")
def chain():
    return profiled(SPEC, MICRO)


def plan_for(chain, schedule, tight):
    problem = PartitionProblem(chain, 2, 10 ** 12, M, schedule)
    least, store_all = least_device_memory(problem), least_device_memory(problem, store_all=True)
    assert least < store_all or not tight, "the test chain must leave room for a recomputing device"
    memory = least + (store_all - least) * 3 // 10 if tight else 10 * store_all
    return partition(chain, 2, memory, M, schedule)


def single_process(spec, batch):
    """Loss and gradients (by 'stage.parameter') of the whole batch in one process."""
    model, _ = load_model(spec, batch=batch)
    x = model.example_inputs[0]
    for _, module in model.stages:
        x = module(x)
    loss = model.loss_fn(x)
    loss.backward()
    return float(loss.detach()), {f"{name}.{n}": p.grad
                                  for name, module in model.stages for n, p in module.named_parameters()}


def check_training(results, spec, batch):
    loss, grads = single_process(spec, batch)
    merged = {}
    for result in results:
        merged.update(result.grads)
    assert set(merged) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert results[-1].losses and all(value == pytest.approx(loss, rel=1e-6) for value in results[-1].losses)
    assert all(not r.losses for r in results[:-1])


def model_of(spec, batch):
    """A picklable factory of the model at ``batch`` (what the ranks build)."""
    return functools.partial(built_model, spec, batch=batch)


def run(plan, steps=2):
    from planner.execute.pipeline import run_pipeline

    return run_pipeline(model_of(SPEC, M * MICRO), plan, steps, meter=memory_meter,
                        return_grads=True, progress_timeout=120)


def check_peaks(results, tolerance=0.05):
    """Every rank's measured peak within ``tolerance`` of its prediction; the first step larger by exactly the
    receive buffers PipelineStage allocates then (to 1%)."""
    for r in results:
        assert r.measured == pytest.approx(r.predicted_window, rel=tolerance), (r.rank, r.measured, r.predicted_window)
        assert r.peaks[0] - r.peaks[-1] == pytest.approx(r.recv_buffer_bytes, rel=0.01), (r.rank, r.peaks)


@pytest.mark.multiprocess
def test_1f1b_store_all_equals_single_process(chain):
    plan = plan_for(chain, "1f1b", tight=False)
    assert all(op.kind == "F_all" for d in plan.pipeline.devices for op in d.schedule if op.kind.startswith("F"))
    results = run(plan)
    assert [r.recomputes for r in results] == [False, False]
    check_training(results, SPEC, M * MICRO)
    check_peaks(results)


@pytest.mark.multiprocess
def test_1f1b_recomputing_device_equals_single_process(chain):
    plan = plan_for(chain, "1f1b", tight=True)
    results = run(plan)
    assert any(r.recomputes for r in results)
    check_training(results, SPEC, M * MICRO)
    check_peaks(results)


@pytest.mark.multiprocess
def test_gpipe_equals_single_process(chain):
    plan = plan_for(chain, "gpipe", tight=False)  # (GPipe holds all m micro-batches: no recomputing split fits less)
    results = run(plan)
    check_training(results, SPEC, M * MICRO)
    check_peaks(results)


@pytest.mark.multiprocess
def test_cli_train_pipeline_plan(chain, tmp_path, capsys):
    import cli
    from planner import save_chain, save_plan

    plan = plan_for(chain, "1f1b", tight=True)
    save_plan(plan, tmp_path / "plan.json")
    save_chain(chain, tmp_path / "chain.json")
    assert json.loads((tmp_path / "plan.json").read_text())["kind"] == "pipeline"
    code = cli.main(["train", SPEC, "--plan", str(tmp_path / "plan.json"), "--chain", str(tmp_path / "chain.json"),
                     "--batch", str(M * MICRO), "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("0", "1")]
    assert [row[0] for row in rows] == ["0", "1"]
    assert float(rows[1][-1]) == pytest.approx(single_process(SPEC, M * MICRO)[0], abs=2e-6)  # the last rank's loss


def test_cli_refuses_a_batch_that_does_not_split(chain, tmp_path, capsys):
    import cli
    from planner import save_plan

    save_plan(plan_for(chain, "1f1b", tight=False), tmp_path / "plan.json")
    code = cli.main(["train", SPEC, "--plan", str(tmp_path / "plan.json"), "--batch", str(M * MICRO - 1)])
    one_error_line(code, *capsys.readouterr(), "does not split into 4 equal micro-batches")


def test_refuses_1f1b_with_fewer_micro_batches_than_devices(chain):
    from planner.execute.pipeline import run_pipeline

    plan = plan_for(chain, "1f1b", tight=False)
    fewer = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, micro_batches=1))
    with pytest.raises(MemschedError, match="at least as many micro-batches as devices"):
        run_pipeline(model_of(SPEC, MICRO), fewer, 1, meter=memory_meter)


class _FailsOnRank1(torch.nn.Module):
    def forward(self, x):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            raise RuntimeError("stage broken on purpose")
        return x * 1.0


def mlp_ending_with(module):
    """The test mlp (whole batch) with ``module`` run after its last stage."""
    model, _ = load_model(SPEC, batch=M * MICRO)
    model.stages[-1] = (model.stages[-1][0], torch.nn.Sequential(model.stages[-1][1], module))
    return model


def failing_model():
    """The mlp with a last stage that fails on rank 1 (module-level: the spawned ranks unpickle it)."""
    return mlp_ending_with(_FailsOnRank1())


@pytest.mark.multiprocess
def test_a_rank_that_dies_is_reported_in_one_line(chain):
    from planner.execute.pipeline import run_pipeline

    plan = plan_for(chain, "1f1b", tight=False)
    with pytest.raises(MemschedError) as caught:
        run_pipeline(failing_model, plan, 1, meter=memory_meter, progress_timeout=60)
    message = one_line(caught, "stage broken on purpose")
    assert message.startswith("pipeline rank 1 failed:"), message


GPT = "gpt-tiny:layers=2,d=32,heads=2,seq=16,vocab=64,dropout=0"  # no dropout: the same numbers in any order


CUTS = (1, 2, 3)


@pytest.fixture(scope="module")
def gpt_cuts():
    """Each split of gpt-tiny at CUTS trained on 2 ranks, one after another in one launch: ``{cut: each rank's
    result}`` (run_pipeline's checks run here for each, its launch captured)."""
    from planner.execute import pipeline
    from planner.execute.pipeline import launch_ranks, run_pipeline

    micro, jobs = 2, []
    gpt_chain = profiled(GPT, micro)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "launch_ranks", lambda job, *args, **kwargs: jobs.append(job) or [])
        for cut in CUTS:
            plan = store_all_split(gpt_chain, [(0, cut), (cut, gpt_chain.length)], M, "1f1b")
            run_pipeline(model_of(GPT, M * micro), plan, 2, meter=memory_meter, return_grads=True,
                         progress_timeout=120)
    ranks = launch_ranks(functools.partial(one_after_another, jobs=jobs), 2, "cpu", 120)
    return {cut: [results[i] for results in ranks] for i, cut in enumerate(CUTS)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("cut", CUTS)
def test_gpt_tiny_integer_input_1f1b_equals_single_process(gpt_cuts, cut):
    """Every split of gpt-tiny (embedding | 2 blocks | head). A device holding only the embedding is
    over-predicted (0.84 here, the safe side): its profiled backward keeps the incoming gradient to its peak
    and makes both embeddings' gradients, while from the second micro-batch on each is added into ``.grad`` as
    made."""
    results = gpt_cuts[cut]
    check_training(results, GPT, M * 2)
    if cut > 1:
        check_peaks(results)
    else:
        embedding, rest = results
        assert 0.75 * embedding.predicted_window <= embedding.measured <= embedding.predicted_window
        check_peaks([rest])


class _HangsOnRank1(torch.nn.Module):
    def forward(self, x):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            import time

            time.sleep(60)
        return x * 1.0


def hanging_model():
    """The mlp with a last stage that hangs on rank 1."""
    return mlp_ending_with(_HangsOnRank1())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hung_run_times_out_and_leaves_no_process(chain):
    import multiprocessing

    from planner.execute.pipeline import run_pipeline

    plan = plan_for(chain, "1f1b", tight=False)
    with pytest.raises(MemschedError, match=r"timed out after 3 s \(ranks \[.*1\] still running\)"):
        run_pipeline(hanging_model, plan, 1, meter=memory_meter, progress_timeout=3)
    assert multiprocessing.active_children() == []


SPEC16 = "mlp:layers=16,width=64"  # long enough that GPipe's m in-flight micro-batches leave room to recompute


@pytest.mark.multiprocess
def test_gpipe_recomputing_devices_equal_single_process():
    from planner.execute.pipeline import run_pipeline

    long_chain = profiled(SPEC16, MICRO)
    plan = plan_for(long_chain, "gpipe", tight=True)
    results = run_pipeline(model_of(SPEC16, M * MICRO), plan, 2, meter=memory_meter,
                           return_grads=True, progress_timeout=120)
    assert any(r.recomputes for r in results)
    check_training(results, SPEC16, M * MICRO)
    check_peaks(results)


def test_a_cpu_run_of_more_devices_than_processes_it_may_start_is_refused():
    import os

    from planner.execute.pipeline import run_pipeline
    from profiles.synthetic import random_chain

    devices = 4 * os.cpu_count() + 1
    chain = random_chain(devices, seed=1)
    plan = store_all_split(chain, [(s, s + 1) for s in range(devices)], devices, "1f1b")
    with pytest.raises(MemschedError) as info:
        run_pipeline(model_of(SPEC, MICRO), plan, 1, meter=memory_meter)
    assert str(info.value).startswith(f"the plan has {devices} devices: a CPU run starts one process per device")
    one_line(info, f"at most {devices - 1} here (4 per core)")

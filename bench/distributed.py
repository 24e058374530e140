"""Several devices: ``fit`` inside DDP and FSDP2 against Hugging Face's gradient checkpointing in the same job.

    python bench/distributed.py [--layers N] [--steps N] [--wall-clock]

Launches itself on 2 gloo ranks with torchrun (one thread each). For an unmodified Hugging Face GPT-2 built from
a config (``--layers`` layers, width 256, sequence 128, 4 rows per rank, a padding mask, labels; no weights
downloaded), in one run, per engine:

* ``hf``: ``model.gradient_checkpointing_enable(use_reentrant=False)`` (every layer recomputed), then the engine:
  ``DDP(model)``, or ``fully_shard`` on every block then the root (torchtitan's order);
* ``fit``: the same engine around ``fit(model, batch, budget)`` (``DDP(fitted)``; for FSDP2 ``fit(...,
  setup=TrainingSetup(zero=3, dp=2))``, which shards its own stages), the budget at ``hf``'s measured per-rank
  peak: equal memory.

Peaks are each rank's step (forward, loss, backward, the engine's collectives) above what is live when it
starts, plus the rank's batch (which the chain counts), by the live-memory tracker, collectives settled before
each window; ``fit``'s beside its prediction (``fitted.ddp.step_peak`` or ``fitted.predicted``). Times: the
median over ``--steps`` interleaved pairs of the per-step ratio ``fit / hf``, each step timed by the process's CPU
time (every thread of the rank, gloo's included) unless ``--wall-clock``. Both start from the same parameters: the
first step's losses must be equal.
"""

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import TrainingSetup, fit  # noqa: E402
from planner.execute.live_memory import LiveMemoryTracker  # noqa: E402

WIDTH, SEQUENCE, ROWS, VOCAB = 256, 128, 4, 1000


def launch(args) -> None:
    """This script on 2 ranks under torchrun, passing the options on."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--rank-job", "--layers", str(args.layers), "--steps", str(args.steps)]
    sys.exit(subprocess.run(command + (["--wall-clock"] if args.wall_clock else []), cwd=ROOT).returncode)


def rank_job(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = [engine_rows(engine, rank, args) for engine in ("ddp", "fsdp2")]
    gathered = [None, None]
    dist.gather_object(rows, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        print_rows(args, gathered)
    dist.destroy_process_group()


def built(layers: int, rank: int):
    """The model (the same parameters on every rank) and this rank's batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=SEQUENCE)
    model = GPT2LMHeadModel(config).train()
    generator = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, VOCAB, (ROWS, SEQUENCE), generator=generator)
    mask = torch.ones(ROWS, SEQUENCE, dtype=torch.long)
    mask[0, SEQUENCE // 2:] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def engine_rows(engine: str, rank: int, args) -> dict:
    """``hf`` and ``fit`` under ``engine`` on this rank: peaks, prediction, times, first losses."""
    peer, batch = built(args.layers, rank)
    peer.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if engine == "ddp":
        peer_run = DDP(peer)
    else:
        for block in peer.transformer.h:
            fully_shard(block)
        peer_run = fully_shard(peer)
    inputs = batch_bytes(batch)
    peer_peak, peer_loss = measured(peer_run, batch)
    budget = peer_peak  # the step's bytes, the batch among them, as the chain counts them
    model, _ = built(args.layers, rank)
    if engine == "ddp":
        fitted = fit(model, batch, budget, progress=False)
        run = DDP(fitted)
    else:
        fitted = run = fit(model, batch, budget, progress=False, setup=TrainingSetup(zero=3, dp=2))
    fit_peak, fit_loss = measured(run, batch)
    predicted = fitted.ddp.step_peak if engine == "ddp" else fitted.predicted.peak_bytes
    ratios = interleaved(peer_run, run, batch, args)
    return {"engine": engine, "peer_peak": peer_peak, "fit_peak": fit_peak, "predicted": predicted,
            "inputs": inputs, "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "same_loss": peer_loss == fit_loss, "solver": fitted.plan.solver,
            "recomputed": fitted.plan.recomputed_forwards}


def batch_bytes(batch) -> int:
    return sum(t.untyped_storage().nbytes() for t in batch.values())


def settled() -> None:
    """Collectives' buffers dropped by gloo's threads before a window opens (tests/fixtures/fit_ranks_job.py)."""
    dist.barrier()
    time.sleep(0.05)
    gc.collect()


def step(run, batch) -> float:
    out = run(**batch)
    out.loss.backward()
    loss = float(out.loss.detach())
    del out
    for parameter in run.parameters():
        parameter.grad = None
    return loss


def measured(run, batch) -> tuple:
    """The step's peak above what is live at its start, plus the batch; and its loss (the first step's)."""
    loss = None
    peak = 0
    with LiveMemoryTracker() as tracker:
        for _ in range(2):  # the second step: after DDP's bucket rebuild
            settled()
            start = tracker.current
            tracker.peak = start
            value = step(run, batch)
            loss = value if loss is None else loss
            peak = max(peak, tracker.peak - start)
    return peak + batch_bytes(batch), loss


def interleaved(peer_run, run, batch, args) -> list:
    """Per pair of steps (the peer's, then fit's), ``fit / hf`` seconds."""
    clock = time.perf_counter if args.wall_clock else time.process_time
    ratios = []
    for _ in range(args.steps):
        seconds = []
        for each in (peer_run, run):
            settled()
            started = clock()
            step(each, batch)
            seconds.append(clock() - started)
        ratios.append(seconds[1] / seconds[0])
    return ratios


def print_rows(args, gathered) -> None:
    clock = "wall clock" if args.wall_clock else "process CPU time"
    print(f"GPT-2 {args.layers} layers, width {WIDTH}, sequence {SEQUENCE}, {ROWS} rows per rank, 2 gloo ranks, "
          f"one thread each; times: {clock}, median of {args.steps} interleaved pairs")
    print(f"{'engine':>6} {'rank':>4} {'hf peak':>10} {'fit peak':>10} {'predicted':>10} {'meas/pred':>9} "
          f"{'fit/hf time':>11} {'(range)':>13} {'loss equal':>10}  plan")
    for rank, rows in enumerate(gathered):
        for row in rows:
            print(f"{row['engine']:>6} {rank:>4} {row['peer_peak']:>10,} {row['fit_peak']:>10,} "
                  f"{row['predicted']:>10,} {row['fit_peak'] / row['predicted']:>9.4f} {row['ratio']:>11.3f} "
                  f"{row['low']:>6.3f}-{row['high']:<6.3f} {str(row['same_loss']):>10}  "
                  f"{row['solver']}, {row['recomputed']} forwards recomputed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--wall-clock", action="store_true")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job or "RANK" in os.environ:
        rank_job(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()

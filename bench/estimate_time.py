"""Estimated step time against measured, on this CPU: the roofline (profiles/roofline.py) at rates measured here.

    python bench/estimate_time.py [SPEC ...] [--threads N] [--repeats 5] [--statistic median|min]

First this CPU's rates (profiles/cpu_rates.py: GEMM FLOP/s, memory bandwidth, cost per operation) at the thread
count the models then run at. Then per model (default: Hugging Face GPT-2, Llama and BERT from tiny configs and
the built-in mlp, gpt-tiny and resnet-tiny): the step time of its ``--estimate`` profile (``chain.compute_time``)
at those rates, at the GEMM FLOP/s alone (FLOPs / throughput, the estimate before the roofline), and the part of
the first that is the fixed cost per operation (operations times ``op_overhead_s``); the measured
step time of the unmodified model (median of ``--repeats`` after two warm-ups) and of its real profile
(``chain.compute_time``). Prints each ratio estimated / measured step, and the band (least..most) over the models.
The same rates for every model: nothing is fitted to them. ``--statistic min``: the rates and the steps from their
fastest runs (the least disturbed on a shared machine) instead of the medians (the real profile's stay medians).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from planner.rates import Rates  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.cpu_rates import bare_op_s, measure_cpu_rates  # noqa: E402
from profiles.reference_step import measured_step_time  # noqa: E402
from profiles.spec import load_model  # noqa: E402

DEFAULT_SPECS = [
    "tests/discovery_models.py:gpt2", "tests/discovery_models.py:llama", "tests/discovery_models.py:bert",
    "mlp", "gpt-tiny", "resnet-tiny",
]


def estimated_seconds(spec: str, rates: Rates) -> float:
    """``chain.compute_time`` of ``spec``'s ``--estimate`` profile at ``rates``."""
    model, _ = load_model(spec, estimate=True)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, estimate=True, warmup=0,
                          repeats=1, rates=rates)
    return chain.compute_time


def measured_seconds(spec: str, repeats: int, statistic) -> tuple:
    """``(statistic of the seconds of a plain step of the unmodified model, its real profile's compute_time)``."""
    model, _ = load_model(spec)
    step = measured_step_time(model, repeats=repeats, statistic=statistic)
    chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, repeats=repeats)
    return step, chain.compute_time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="*", default=DEFAULT_SPECS)
    parser.add_argument("--threads", type=int, help="torch threads for the rates and the models (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="of the timed runs of the rates and the steps (default: median)")
    args = parser.parse_args()
    statistic = {"median": statistics.median, "min": min}[args.statistic]
    if args.threads:
        torch.set_num_threads(args.threads)
    rates = measure_cpu_rates(repeats=args.repeats, statistic=statistic)
    print(f"rates at {torch.get_num_threads()} threads ({args.statistic} of {args.repeats} runs): {rates.describe()} "
          f"(one bare operation: {bare_op_s(args.repeats, statistic):.3g} s)")
    flops_only, fixed_only = Rates(rates.flops_per_s), Rates(1e21, op_overhead_s=rates.op_overhead_s)
    print(f"{'model':<32} {'est s':>9} {'FLOPs s':>9} {'fixed s':>9} {'step s':>9} {'profile s':>9} {'est/step':>9} "
          f"{'FLOPs/step':>10} {'est/profile':>11} {'bench s':>8}")
    ratios = []
    for spec in args.specs:
        started = time.perf_counter()
        estimate, flops, fixed = (estimated_seconds(spec, r) for r in (rates, flops_only, fixed_only))
        step, profiled = measured_seconds(spec, args.repeats, statistic)
        ratios.append(estimate / step)
        print(f"{spec:<32} {estimate:9.4f} {flops:9.4f} {fixed:9.4f} {step:9.4f} {profiled:9.4f} "
              f"{estimate / step:9.3f} {flops / step:10.3f} {estimate / profiled:11.3f} "
              f"{time.perf_counter() - started:8.1f}")
    print(f"band of estimated / measured step: {min(ratios):.3f}..{max(ratios):.3f}")


if __name__ == "__main__":
    main()

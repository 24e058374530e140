"""This CPU's rates (profiles/cpu_rates.py) at torch's default thread count and at one thread.

    python bench/cpu_rates.py [--repeats 5]

Per thread count, the median and the fastest of the timed runs: fp32 GEMM FLOP/s, memory bandwidth (an add of
64 MiB tensors), the cost per operation in a tiny training step, and one bare operation's cost.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from profiles.cpu_rates import bare_op_s, measure_cpu_rates  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'threads':>7} {'of runs':>7} {'GEMM FLOP/s':>12} {'bytes/s':>10} {'s/op step':>10} {'s/op bare':>10}")
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        for name, statistic in (("median", statistics.median), ("min", min)):
            rates, bare = measure_cpu_rates(None, args.repeats, statistic), bare_op_s(args.repeats, statistic)
            print(f"{threads:7d} {name:>7} {rates.flops_per_s:12.3g} {rates.bytes_per_s:10.3g} "
                  f"{rates.op_overhead_s:10.3g} {bare:10.3g}")


if __name__ == "__main__":
    main()

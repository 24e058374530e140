"""Profile fidelity: does the measured chain predict a real training step of the unmodified model?

    python bench/profile_fidelity.py [SPEC ...] [--repeats 5]

For each model (default: the built-in models at two sizes), in one run: profile it, predict the
store-all peak and step time with the simulator, then measure one plain step
(``loss_fn(model(x)).backward()``) with the live-memory tracker and a wall clock. Prints
predicted/measured ratios for memory and time, and whether the estimate mode's sizes equal the
measured ones to the byte.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import simulate  # noqa: E402
from profiles.chain_profiler import profile_chain  # noqa: E402
from profiles.reference_step import measured_peak, measured_step_time  # noqa: E402
from profiles.spec import load_model  # noqa: E402
from solvers.extremes import store_all_schedule  # noqa: E402

DEFAULT_SPECS = [
    "mlp", "mlp:layers=12,width=384,batch=32",
    "gpt-tiny", "gpt-tiny:layers=3,d=192,heads=6,seq=48,batch=4",
    "resnet-tiny", "resnet-tiny:blocks=3,channels=48,size=24,batch=8",
]


def sizes(chain):
    return ([(s.out_bytes, s.saved_bytes, s.fwd_tmp_bytes, s.bwd_tmp_bytes, s.param_bytes) for s in chain.stages],
            chain.input_bytes, chain.loss.tmp_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="*", default=DEFAULT_SPECS)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':<48} {'pred peak':>11} {'meas peak':>11} {'peak ratio':>10} {'pred s':>9} {'meas s':>9} "
          f"{'time ratio':>10} {'estimate sizes':>14} {'profile s':>9}")
    for spec in args.specs:
        model, _ = load_model(spec)
        started = time.perf_counter()
        chain = profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=model.name,
                              repeats=args.repeats)
        profile_seconds = time.perf_counter() - started
        predicted = simulate(chain, store_all_schedule(chain.length))
        peak, seconds = measured_peak(model), measured_step_time(model, repeats=args.repeats)
        fake_model, _ = load_model(spec, estimate=True)
        estimate = profile_chain(fake_model.stages, fake_model.example_inputs, loss_fn=fake_model.loss_fn,
                                 estimate=True, warmup=0, repeats=1)
        print(f"{spec:<48} {predicted.peak_bytes:11d} {peak:11d} {predicted.peak_bytes / peak:10.4f} "
              f"{predicted.time:9.4f} {seconds:9.4f} {predicted.time / seconds:10.3f} "
              f"{'equal' if sizes(estimate) == sizes(chain) else 'DIFFERENT':>14} {profile_seconds:9.1f}")


if __name__ == "__main__":
    main()

"""The first solve of a new install (issue 40, item 1): CPU seconds in a fresh process with an empty numba kernel
cache, then in a second fresh process with the cache the first one left, one thread.

    python bench/first_solve.py [--repeats 3]

Cases: ``memsched solve`` on the 24-stage example chain (examples/example-L24.chain.json), on a synthetic 50-stage
chain, and on one with two options a stage (the hierarchical solver); and ``fit`` of the tiny Hugging Face GPT-2
of the tests (tests/fixtures/hf_gpt2.py) at "60%" (its planning: discovery, profiling, the solve). Each figure is
the CPU time of the call alone (imports left out), the median of ``--repeats`` fresh processes, beside the names
of the kernels numba compiled in it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import save_chain  # noqa: E402
from profiles.synthetic import random_chain  # noqa: E402

CHILD = textwrap.dedent('''
    import json, sys, time
    from numba.core import event

    compiled = []

    class Listener(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            name = ev.data["dispatcher"].py_func.__module__
            if name.startswith("solvers"):
                compiled.append(ev.data["dispatcher"].py_func.__qualname__)

    event.register("numba:compile", Listener())
    case, argument = sys.argv[1], sys.argv[2]
    if case == "fit":
        sys.path.insert(0, "tests")
        from fixtures.hf_gpt2 import build
        from planner import fit
        model, batch = build(batch=8)
        started = time.process_time()
        fit(model, batch, "60%", progress=False)
    else:
        import cli
        started = time.process_time()
        assert cli.main(["solve", argument, "--budget", "60%"]) == 0
    print(json.dumps([time.process_time() - started, compiled]))
''')


def run(case: str, argument: str, cache: str) -> tuple:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, case, argument], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=900, check=True)
    seconds, compiled = json.loads(done.stdout.splitlines()[-1])
    return seconds, compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        chains = {"solve, example L24": str(ROOT / "examples" / "example-L24.chain.json")}
        for name, options in (("solve, synthetic L50", 0), ("solve, L50 with options", 2)):
            path = str(Path(folder) / f"{options}.chain.json")
            save_chain(random_chain(50, 3, tmp=True, params=True, options=options), path)
            chains[name] = path
        cases = [("solve", path, name) for name, path in chains.items()] + [("fit", "", "fit, tiny GPT-2 60%")]
        print(f"{'case (one thread, CPU s)':28} {'empty cache':>12} {'warm cache':>11}  compiled with an empty cache")
        for case, argument, name in cases:
            first, second, names = [], [], set()
            for repeat in range(args.repeats):
                cache = str(Path(folder) / f"cache-{name}-{repeat}")
                seconds, compiled = run(case, argument, cache)
                first.append(seconds)
                names.update(compiled)
                second.append(run(case, argument, cache)[0])
            print(f"{name:28} {statistics.median(first):12.2f} {statistics.median(second):11.2f}  "
                  f"{', '.join(sorted(names)) or 'none'}")


if __name__ == "__main__":
    main()

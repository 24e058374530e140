"""The chains the benchmarks share: the profiled example, random heterogeneous chains, built-in models."""

from pathlib import Path

from planner.chain import load_chain
from profiles.synthetic import random_chain

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "example-L24.chain.json"


def bench_chains(lengths, model_specs=(), estimate: bool = False):
    """examples/example-L24, ``random_chain(L, 1)`` with temporaries, parameter gradients and own_saved_bytes
    for each L of ``lengths``, then each built-in model of ``model_specs`` profiled here (``estimate``: on
    fake tensors, times from FLOPs)."""
    yield load_chain(EXAMPLE)
    for length in lengths:
        yield random_chain(length, 1, tmp=True, params=True, own_saved=True, name=f"random-L{length}")
    if model_specs:
        from profiles.chain_profiler import profile_chain
        from profiles.spec import load_model

        for spec in model_specs:
            model, _ = load_model(spec, estimate=estimate)
            extra = {"estimate": True, "warmup": 0, "repeats": 1} if estimate else {}
            yield profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn, name=spec, **extra)

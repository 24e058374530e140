"""A model's size without allocating it: its trainable parameters and chain, built on fake tensors."""

from typing import NamedTuple, Optional

from planner.chain import Chain
from planner.execute.stages import named_stages, trainable_parameters
from profiles.chain_profiler import profile_chain
from profiles.spec import load_model


class Estimate(NamedTuple):
    """A model's name, its trainable parameters (each counted once) and its estimated chain (or None)."""

    name: str
    parameters: int
    chain: Optional[Chain]


def estimate_chain(spec: str, batch: int = None, *, with_chain: bool = True, device_spec=None,
                   rates=None, autocast: str = None) -> Estimate:
    """The :class:`Estimate` of a model SPEC (as for :func:`profiles.spec.load_model`), built on fake tensors:
    nothing is allocated; the chain's sizes are exact, its times estimated at ``rates`` (a
    :class:`planner.rates.Rates`; default: FLOPs at the default throughput), or for a target ``device_spec``
    (:func:`profiles.chain_profiler.profile_chain`) (``with_chain=False``: no chain); ``autocast`` (``"bf16"``,
    ``"fp16"``): its step under that autocast, as the target casts."""
    model, _ = load_model(spec, batch=batch, estimate=True, autocast=autocast, device_spec=device_spec)
    parameters = sum(p.numel() for p in trainable_parameters(named_stages(model.stages)))
    chain = None if not with_chain else profile_chain(model.stages, model.example_inputs, loss_fn=model.loss_fn,
                                                      name=model.name, estimate=True, warmup=0, repeats=1,
                                                      device_spec=device_spec, rates=rates)
    return Estimate(name=model.name, parameters=parameters, chain=chain)

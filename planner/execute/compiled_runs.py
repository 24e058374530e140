"""Compiled chain plans: the stages a schedule always runs together run as one compiled call.

Under ``torch.compile`` each stage call pays the compiled code's own costs (its guards, AOT autograd's runtime
wrappers) and ends what the compiler may fuse at its edges: measured on the 32-stage mlp (one thread), stage by
stage compiled steps took 2.4-7 times the eager plain step. A schedule often runs consecutive stages
together (:func:`planner.execute.fusion.merged_runs`: each forward of one directly followed by the next's, their
backwards likewise); :func:`merged_for_compile` makes each such run one stage, a :class:`MergedStages` module,
and the executor runs its operations through a :class:`CompiledRun`: the run's stages in one compiled
function, each plainly, or as a selective-checkpoint region (planner/execute/compiled_option.py) where its
``F_all`` runs with an option, so one compiled forward and one backward do what the run's operations did.
The schedule is the same (its operations on a run done at once, the stages' outputs inside the compiled
code), so are the eager bytes the plan counts; compiled code frees otherwise, as for any compiled stage. A run
with an option whose graph writes in place (an exported BatchNorm's statistics) cannot be a region: that run
goes stage by stage, as without merging.
"""

import contextlib

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from planner.execute.autograd import rng_devices, running_statistics_kept
from planner.execute.compiled_option import own_code
from planner.execute.fusion import merged_runs, merged_schedule
from planner.execute.selective import compiled_region, run_with_option, stage_graph, unobserved


def merged_for_compile(pairs, schedule, recomputes) -> tuple:
    """``(pairs, schedule, recomputes)`` with each run of :func:`merged_runs` of several stages one
    :class:`MergedStages` stage (named ``first+...+last``); ``recomputes`` re-indexed for the stages left
    alone. For a schedule without transfers."""
    runs = merged_runs(schedule, len(pairs))
    if len(runs) == len(pairs):
        return pairs, schedule, recomputes
    merged_pairs, merged_recomputes = [], {}
    for k, (first, last) in enumerate(runs):
        if first == last:
            merged_pairs.append(pairs[first])
            if first in recomputes:
                merged_recomputes[k] = recomputes[first]
            continue
        names = [name for name, _ in pairs[first:last + 1]]
        modules = [module for _, module in pairs[first:last + 1]]
        merged_pairs.append(("+".join(names), MergedStages(modules, [recomputes.get(i) for i in range(first, last + 1)],
                                                           names)))
    return merged_pairs, merged_schedule(schedule, runs), merged_recomputes


class MergedStages(torch.nn.Module):
    """Consecutive stages as one: ``forward(x, *extra)`` runs them in turn (each given the extra inputs), eagerly
    and whole; ``recomputes[k]``: what stage k's ``F_all`` recomputes (None: nothing), for :class:`CompiledRun`."""

    def __init__(self, modules, recomputes, names):
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)
        self.recomputes, self.names = list(recomputes), list(names)

    def forward(self, x, *extra):
        for module in self.parts:
            x = module(x, *extra)
        return x


class CompiledRun:
    """A :class:`MergedStages` through one ``torch.compile``; its stages with options become regions at the
    first call with gradients (their graphs are taken on fake copies of that call's inputs, one forward without
    gradients on fake tensors, random state and running statistics kept)."""

    def __init__(self, merged: MergedStages):
        self.merged = merged
        self.regions = None  # per stage: its SelectiveRegion, or None (run whole)
        self.stepwise = None  # the stages' own compiled calls, where the run cannot be one
        regions = self

        def forward(x, *extra):
            with_grad = torch.is_grad_enabled()
            for module, region in zip(regions.merged.parts, regions.regions or [None] * len(regions.merged.parts)):
                x = region(x, *extra) if with_grad and region is not None else module(x, *extra)
            return x

        self.compiled = torch.compile(own_code(forward), dynamic=False)

    def __call__(self, x, *extra):
        if self.regions is None and torch.is_grad_enabled() and any(r is not None for r in self.merged.recomputes):
            self._prepare(x, extra)
        if self.stepwise is not None:
            return self._stage_by_stage(x, extra)
        return self.compiled(x, *extra)

    def _prepare(self, x, extra) -> None:
        """The regions, from a forward without gradients on fake copies of ``x`` and ``extra`` (nothing allocated
        in the step that prepares them), hidden from the caller's dispatch modes."""
        regions = []
        parts = zip(self.merged.parts, self.merged.recomputes, self.merged.names)
        with unobserved(), torch.random.fork_rng(devices=rng_devices()), contextlib.ExitStack() as kept:
            mode = detect_fake_mode(tree_flatten([x, extra])[0]) or FakeTensorMode(allow_non_fake_inputs=True)
            x, extra = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (x, extra))
            with mode:
                for module in self.merged.parts:
                    kept.enter_context(running_statistics_kept(module))
            for module, recompute, name in parts:
                region = None
                if recompute is not None:
                    region = compiled_region(stage_graph(module, (x, *extra)), recompute, (x, *extra), name, module)
                    if region is None:  # its graph writes in place
                        self.stepwise = [torch.compile(part, dynamic=False) for part in self.merged.parts]
                        self.regions = []
                        return
                regions.append(region)
                with torch.no_grad(), mode:
                    x = module(x, *extra)
        self.regions = regions

    def _stage_by_stage(self, x, extra):
        with_grad = torch.is_grad_enabled()
        for module, compiled, recompute in zip(self.merged.parts, self.stepwise, self.merged.recomputes):
            x = (run_with_option(module, recompute, x, *extra, compiled=True) if with_grad and recompute is not None
                 else compiled(x, *extra))
        return x

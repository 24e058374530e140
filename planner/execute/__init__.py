"""The only torch code of the planner: running a plan in a real training step.

Chain plans run with :func:`apply_plan` (or :func:`apply_schedule`, the same without the plan's checks): one
step loop (``steprun``), its offload variant (``offload``, on ``copies`` and ``host_weights``), the torch-free
fusion rules (``fusion``) and the autograd helpers every executor shares (``autograd``). Graph plans run with
:class:`GraphExecutor`; pipeline plans with :func:`run_pipeline`; a chain plan on FSDP2's sharded stages over
data-parallel ranks with :func:`run_data_parallel` (``data_parallel``, on ``sharded``). A stage that a chain plan
runs with one of its options keeps only that option's results (``selective``: ``torch.utils.checkpoint`` with a
selective policy). The mechanics (fusion, boxes, host weights, stage options) are in docs/execution.md.
"""

import importlib

# name -> the module that defines it, imported on first use (PEP 562): a chain plan does not load the graph
# capture (torch._functorch) or the pipeline runtime.
_HOMES = {"PlannedChain": "chain", "apply_plan": "chain", "apply_schedule": "chain", "GraphExecutor": "graph",
          "run_pipeline": "pipeline", "run_data_parallel": "data_parallel", "run_with_option": "selective",
          "StagedModel": "stages"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'planner.execute' has no attribute {name!r}")
    return getattr(importlib.import_module(f"planner.execute.{_HOMES[name]}"), name)

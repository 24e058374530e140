"""memsched's planner, torch-free: the problems (chain, graph), the plan format and the simulators that judge
plans. The torch code that runs plans is in planner/execute/; docs/model.md gives the simulators' rules.

``planner.fit`` is the one call from a model to planned training (:func:`profiles.fit.fit`); it is loaded on
first use, so that ``import planner`` stays torch-free."""

from planner.chain import Chain, Loss, Stage, load_chain, save_chain
from planner.errors import MemschedError
from planner.ops import Op
from planner.plan import Plan, Predicted, check_plan_matches, load_plan, save_plan
from planner.setup import TrainingSetup
from planner.simulate import check_plan_schedules, simulate
from planner.simulate.chain import ChainSimulator
from planner.simulate.replay import ScheduleError, SimResult

__all__ = [
    "Chain", "Loss", "Stage", "load_chain", "save_chain", "MemschedError", "Op", "Plan", "Predicted",
    "check_plan_matches", "load_plan", "save_plan", "check_plan_schedules", "ChainSimulator", "ScheduleError",
    "SimResult", "simulate", "TrainingSetup",
]


def __getattr__(name):
    if name == "fit":
        from profiles.fit import fit

        return fit
    raise AttributeError(f"module 'planner' has no attribute {name!r}")

"""memsched's planner, torch-free: the problems (chain, graph), the plan format and the simulators that judge
plans. The torch code that runs plans is in planner/execute/; docs/model.md gives the simulators' rules."""

from planner.chain import Chain, Loss, Stage, load_chain, save_chain
from planner.errors import MemschedError
from planner.ops import Op
from planner.plan import Plan, Predicted, check_plan_matches, load_plan, save_plan
from planner.simulate import check_plan_schedules, simulate
from planner.simulate.chain import ChainSimulator
from planner.simulate.replay import ScheduleError, SimResult

__all__ = [
    "Chain", "Loss", "Stage", "load_chain", "save_chain", "MemschedError", "Op", "Plan", "Predicted",
    "check_plan_matches", "load_plan", "save_plan", "check_plan_schedules", "ChainSimulator", "ScheduleError",
    "SimResult", "simulate",
]

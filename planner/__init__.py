"""memsched's planner: the chain problem, the plan format and the simulator that judges plans."""

from planner.chain import Chain, Loss, Stage, load_chain, save_chain
from planner.errors import MemschedError
from planner.ops import Op
from planner.plan import Plan, Predicted, check_plan_matches, load_plan, save_plan
from planner.simulate.chain import ChainSimulator, ScheduleError, SimResult, simulate

__all__ = [
    "Chain", "Loss", "Stage", "load_chain", "save_chain", "MemschedError", "Op", "Plan", "Predicted",
    "check_plan_matches", "load_plan", "save_plan", "ChainSimulator", "ScheduleError", "SimResult", "simulate",
]

"""The training setup as one value: what it is (:mod:`.training`), which of its parts mix (:mod:`.rules`), the
chain it makes of a chain (:mod:`.lower`) and what a device holds for its step (:mod:`.account`). No torch."""

from planner.setup.account import Account, account
from planner.setup.lower import Lowered, lower
from planner.setup.rules import FLAGS, NEEDS, RULES, Run, check
from planner.setup.training import TrainingSetup

__all__ = ["TrainingSetup", "RULES", "NEEDS", "FLAGS", "Run", "check", "lower", "Lowered", "account", "Account"]

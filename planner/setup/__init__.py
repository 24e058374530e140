"""The training setup as one value: what it is (:mod:`.training`), which of its parts mix (:mod:`.rules`), and
the chain it makes of a chain (:mod:`.lower`). No torch."""

from planner.setup.lower import Lowered, lower
from planner.setup.rules import FLAGS, RULES, Run, check
from planner.setup.training import TrainingSetup

__all__ = ["TrainingSetup", "RULES", "FLAGS", "Run", "check", "lower", "Lowered"]

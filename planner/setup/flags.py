"""The command line's flags for a training setup: the flag of each field, and the setup the given flags make
(no torch). planner/setup/rules.py spells the run's features (``--compile``, ``--graph``...) for its messages."""

from planner.setup.training import TrainingSetup

FIELD_FLAGS = {"optimizer": "--optimizer", "precision": "--precision", "zero": "--zero", "dp": "--dp",
               "update": "--update", "accumulate": "--accumulate", "host_weights": "--offload-weights"}
SIZING_FLAGS = tuple(FIELD_FLAGS[field] for field in TrainingSetup().sizing())  # what sizes the resident state
SEARCHED = {"update": "auto"}  # a value asking for a search over setups (solvers/budgets.py), not for one setup


def setup_from_flags(values: dict) -> TrainingSetup:
    """The setup ``values`` give (``{field: the flag's value, None when not given}``): a field searched over
    (:data:`SEARCHED`) keeps the default; a bad value is the setup's one-line error naming its field."""
    return TrainingSetup(**{field: value for field, value in values.items()
                            if value is not None and value != SEARCHED.get(field)})

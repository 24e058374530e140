"""The judges: torch-free simulators that replay a plan and predict its peak bytes and seconds.

:func:`simulate` is the one entry; the rules each simulator applies are in docs/model.md.
"""

from planner.simulate.chain import simulate

__all__ = ["simulate"]

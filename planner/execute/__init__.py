"""The only torch code of the planner: running a plan in a real training step.

The mechanics (fusion, boxes, host weights, selective alignment) are in docs/execution.md.
"""

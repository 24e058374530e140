"""Text for ``memsched plan`` (alias ``memory``): what a training setup keeps on a device, the budget the device
leaves for the step, what sets the least memory of a whole step, and the micro-batches tried for a target device.

Pure text: sizes in bytes and durations in seconds on input, shown in bytes and binary units
(planner.units.format_bytes); planner/render.py holds the other commands' text.
"""

from planner.setup.training import ITEMS
from planner.units import describe_bytes, format_bytes


def setup_lines(setup, parameters: int, sizes: dict = None, resident: int = None) -> list:
    """``memsched memory``'s table for a :class:`planner.setup.training.TrainingSetup`: per item, bytes per
    parameter and bytes per device for ``parameters`` (``sizes``, when given: a chain's,
    :func:`planner.setup.training.device_sizes`), then the ``resident`` bytes (default: parameters, master copy
    and optimizer state of ``sizes``) and those with gradients."""
    per_parameter, sizes = setup.per_parameter(), sizes or setup.breakdown(parameters)
    labels = {"params": "parameters", "grads": "gradients", "master": "fp32 master copy",
              "optimizer": "optimizer state"}
    lines = [f"setup      {setup.describe()}", "", f"{'per device':<18} {'bytes/param':>11} {'bytes':>16} {'':>11}"]
    for item in ITEMS:
        lines.append(f"{labels[item]:<18} {per_parameter[item]:>11.6g} {sizes[item]:>16} "
                     f"{format_bytes(sizes[item]):>11}")
    resident = sizes["params"] + sizes["master"] + sizes["optimizer"] if resident is None else resident
    total = resident + sizes["grads"]
    return lines + [f"{'resident':<18} {'':>11} {resident:>16} {format_bytes(resident):>11}   "
                    "parameters + master copy + optimizer state, before the step",
                    f"{'with gradients':<18} {'':>11} {total:>16} {format_bytes(total):>11}   "
                    "gradients are made by the step, inside its budget", ""]


_UPDATE_WORDS = {"after": "update after the backward", "in-backward": "update in the backward (--update in-backward)",
                 "on-host": "update on the host (--update on-host)"}


def floor_lines(floors) -> list:
    """What sets the least memory of a whole step (:func:`solvers.budgets.whole_step_floors`): today's floor
    (the update after the backward) in parts, then what each other update would make it."""
    labels = {"params": "parameters", "master": "master copy", "optimizer": "optimizer state"}
    first = floors[0]
    parts = ", ".join(f"{labels[item]} {format_bytes(size)}" for item, size in first.parts.items() if size)
    largest = max([(size, labels[item]) for item, size in first.parts.items()]
                  + [(first.gradients, "gradients"), (first.step - first.gradients, "activations and temporaries")])
    lines = [f"floor      {describe_bytes(first.total)} for the whole step ({_UPDATE_WORDS[first.update]}): "
             f"resident {format_bytes(first.resident)} ({parts or 'nothing'}) + least step {format_bytes(first.step)}",
             f"  set by {largest[1]}, the largest part; the least step peaks at {first.at}, holding "
             f"{format_bytes(first.gradients)} of gradients and {format_bytes(first.step - first.gradients)} of "
             "activations and temporaries"]
    for floor in floors[1:]:
        saved = first.total - floor.total
        change = f"{saved / first.total:.0%} lower" if saved > 0 and first.total else "not lower"
        lines.append(f"  with the {_UPDATE_WORDS[floor.update]}: {format_bytes(floor.total)}, {change} (resident "
                     f"{format_bytes(floor.resident)}, least step {format_bytes(floor.step)})")
    return lines


def device_budget_lines(device_memory: int, budget: int, store_all_peak: int, least: int) -> list:
    """The step budget a device of ``device_memory`` bytes leaves, against the chain's store-all peak and its
    least feasible budget (bytes)."""
    fits = ("fits without recomputation" if store_all_peak <= budget else
            "fits with recomputation" if least <= budget else "does not fit even with recomputation")
    return [f"device     {describe_bytes(device_memory)}",
            f"budget     {describe_bytes(budget)} for the step: activations, temporaries and the "
            "chain's parameter gradients (memsched solve --budget auto)",
            f"step       store-all peak {describe_bytes(store_all_peak)}, least feasible "
            f"{describe_bytes(least)}: {fits}"]


def workspace_lines(device, memory: int) -> list:
    """The cuBLAS workspaces ``device`` (a :class:`planner.devices.DeviceSpec`) holds once a matmul has run
    (planner/blas_workspace.py) and what its ``memory`` bytes leave beside them; nothing for a CPU."""
    if device.allocator != "cuda":
        return []
    workspace = device.blas_workspace()
    if device.compute_capability is None:
        return [f"workspace  cuBLAS's {workspace.why} (add it, e.g. \"9.0\", to count it)"]
    return [f"workspace  cuBLAS {describe_bytes(workspace.held)} held from the first matmul: {workspace.why}",
            f"  the device's {describe_bytes(memory)} less it leave {describe_bytes(memory - workspace.held)} for the "
            "resident state and the step"]


def device_plan_lines(device, tried, chosen) -> list:
    """``memsched plan --device-spec``'s table: per micro-batch tried (profiles/device_plan.py's candidates), the
    micro-batches per optimizer step, whether it fits ``device`` (a :class:`planner.devices.DeviceSpec`), the
    plan's solver, the device's peak, the optimizer step's seconds and samples per second, then ``chosen`` (the
    smallest micro-batch within 1% of the most samples per second)."""
    lines = [f"target     {device.name}: {describe_bytes(device.memory_bytes)}, {device.fp32_flops:.3g} FLOP/s fp32, "
             f"{device.bf16_flops:.3g} bf16, {device.memory_bandwidth:.3g} B/s"
             + (f", {device.op_overhead_s:.3g} s/op" if device.op_overhead_s else "")
             + "; times are estimates (a roofline at the spec's peaks), sizes exact", "",
             f"{'batch':>7} {'micro':>6} {'solver':<13} {'peak':>11} {'step s':>11} {'samples/s':>11}"]
    for c in tried:
        if c.plan is None:
            lines.append(f"{c.batch:>7} {c.accumulate:>6} does not fit: {c.why}")
        else:
            lines.append(f"{c.batch:>7} {c.accumulate:>6} {c.plan.solver:<13} {format_bytes(c.peak):>11} "
                         f"{c.seconds:>11.4g} {c.samples_per_second:>11.4g}")
    return lines + [f"chosen     micro-batch {chosen.batch} x {chosen.accumulate}: peak {describe_bytes(chosen.peak)} "
                    f"of {describe_bytes(device.memory_bytes)}, {chosen.seconds:.4g} s per optimizer step, "
                    f"{chosen.samples_per_second:.4g} samples/s (estimated)"]

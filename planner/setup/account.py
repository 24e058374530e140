"""The one sum of a device's memory for a training step (no torch): what a device holds while a chain's step runs
under a setup, part by part.

A device holds, at the step's peak: the cuBLAS workspaces its matmuls leave (planner/blas_workspace.py; 0 without
a device, or on a CPU), the setup's resident state (parameters, master copy, optimizer state:
:func:`planner.setup.training.resident_on_device`), the gradients the setup keeps beyond the chain's own
(:func:`planner.setup.training.extra_gradient_bytes`: fp32 gradients of a model built in bf16), and the step's own
peak (a plan's predicted peak, or the least one). Every "does it fit", "what is left" and "what does it need" of
the device planner reads :func:`account`, so that they cannot disagree: :func:`activation_budget` is a device's
memory less what the account holds beside the step (``--budget auto``), and :func:`describe_auto_budget` says how.
"""

from typing import NamedTuple

from planner.errors import MemschedError
from planner.setup.training import (
    TrainingSetup,
    chain_gradient_bytes,
    extra_gradient_bytes,
    parameters_of,
    resident_on_device,
)
from planner.units import describe_bytes, format_bytes


class Account(NamedTuple):
    """Bytes on one device: ``workspace`` (cuBLAS), ``resident`` (before the step), ``extra_gradients`` (the
    setup's beyond the chain's), ``step`` (the step's peak above them); ``total`` their sum."""

    workspace: int
    resident: int
    extra_gradients: int
    step: int

    @property
    def total(self) -> int:
        return self.workspace + self.resident + self.extra_gradients + self.step

    @property
    def beside_step(self) -> int:
        """What the device holds besides the step: its workspace, the resident state and the extra gradients."""
        return self.workspace + self.resident + self.extra_gradients


def account(chain, setup: TrainingSetup, device=None, step: int = 0) -> Account:
    """The :class:`Account` of ``chain``'s step under ``setup`` on ``device`` (a
    :class:`planner.devices.DeviceSpec`; None: no workspace counted) whose own peak is ``step`` bytes."""
    workspace = device.blas_workspace().held if device is not None else 0
    return Account(workspace, resident_on_device(chain, setup), extra_gradient_bytes(chain, setup), step)


def activation_budget(chain, setup: TrainingSetup, device_memory: int) -> int:
    """Bytes left for the chain's step budget (activations, temporaries and the chain's parameter gradients) on a
    device of ``device_memory`` bytes (its workspaces already taken off: :meth:`DeviceSpec.step_memory_bytes`):
    ``device_memory`` less what :func:`account` holds beside the step, the resident state and the gradients the
    setup keeps beyond the chain's (the chain's gradients stand in for the setup's, which are never larger:
    16-bit or ZeRO-sharded gradients are smaller; the difference is not credited: docs/model.md). A one-line
    :class:`MemschedError` when nothing is left."""
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 1:
        raise MemschedError(f"device memory: expected a whole number of bytes >= 1, got {device_memory!r}")
    held = account(chain, setup)
    budget = device_memory - held.beside_step
    if budget <= 0:
        extra = f" and {held.extra_gradients} bytes of gradients beyond the chain's" if held.extra_gradients else ""
        raise MemschedError(
            f"no memory left for activations: {parameters_of(chain)} parameters with {setup.describe()} keep "
            f"{held.resident} bytes resident{extra}, at least the device's {device_memory} bytes; "
            "use a larger device, more ranks or a higher ZeRO stage")
    return budget


def describe_auto_budget(chain, setup: TrainingSetup, device_memory: int) -> str:
    """How :func:`activation_budget` comes from ``device_memory`` bytes: ``device ... - resident ... for P
    parameters (setup)``, with the gradients beyond the chain's it takes off, and a note when the chain counts
    more gradient bytes than the setup has."""
    parameters, held = parameters_of(chain), account(chain, setup)
    some = "" if setup.host_stages is None else f" for {len(setup.host_stages)} of {chain.length} stages"
    how = (f"device {describe_bytes(device_memory)} - resident {describe_bytes(held.resident)} for {parameters} "
           f"parameters ({setup.describe()}{some})")
    if held.extra_gradients:
        how += f" - {held.extra_gradients} bytes of gradients beyond the chain's"
    if setup.gradient_bytes(parameters) < chain_gradient_bytes(chain) and not setup.sharded:  # (sharded: lowered)
        how += (f"; the chain counts its gradients ({format_bytes(chain_gradient_bytes(chain))}), the setup's "
                f"are {format_bytes(setup.gradient_bytes(parameters))}")
    return how

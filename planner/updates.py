"""When the optimizer updates the parameters, and what that does to a chain's memory (no torch).

A training step makes every parameter gradient during its backward. With the update **after** the backward
(``optimizer.step()`` once ``loss.backward()`` returns: the usual step, and the chain model's default) the
gradients of stage ``i`` live from ``B i`` to the end of the step (``param_bytes``). Two other updates free them
sooner:

- **in-backward**: the optimizer updates stage ``i``'s parameters as soon as ``B i`` has made their gradients
  and frees them (PyTorch's optimizer-in-backward recipe, torchtitan's ``early_step_in_backward``): a stage's
  gradients are a transient of its backward.
- **on-host**: as in-backward, but the gradients are copied to the host, where the optimizer state (and the
  fp32 master copy of mixed precision) lives and the update runs; the updated parameters are copied back
  (ZeRO-Offload, Ren et al. 2021). The device keeps the parameters only; the copies take the channel's time.

:func:`updated_chain` turns a chain into the chain the solvers and the simulator see for an update, so that every
chain solver plans it unchanged. A parameter shared by several stages (tied embeddings: planner/shared.py) is
complete only after the backward of the first stage reading it, the last to run: its gradient stays counted in
its owner's ``param_bytes`` to the end of the step. Why the transform is exact is in docs/model.md,
"Whole-step memory".
"""

import dataclasses

from planner.errors import MemschedError

UPDATES = ("after", "in-backward", "on-host")


def check_update(update, where: str = "update") -> str:
    """``update`` if it is one of :data:`UPDATES`, else a one-line :class:`MemschedError`."""
    if update not in UPDATES:
        raise MemschedError(f"{where}: unknown optimizer update {update!r}; use one of {', '.join(UPDATES)} "
                            "(after: after the backward; in-backward: each stage's parameters as soon as their "
                            "gradients are made; on-host: the same, with gradients and optimizer state on the host)")
    return update


def check_channel(update: str, transfer) -> None:
    """Refuse, in one line, to plan ``"on-host"`` without a usable copy channel (``transfer``)."""
    if update == "on-host" and (transfer is None or not transfer.usable):
        raise MemschedError("update on-host copies gradients to the host and parameters back: give the copy "
                            "channel (--bandwidth, e.g. 16GB/s), or profile the chain on CUDA, which measures it")


def host_stages_of(chain, update: str, host=None) -> frozenset:
    """The stages whose parameters update on the host: none but for ``"on-host"``, where ``host`` (stage indices;
    None: every stage) names them; an index outside the chain is a one-line :class:`MemschedError`."""
    if update != "on-host":
        return frozenset()
    if host is None:
        return frozenset(range(chain.length))
    wrong = [i for i in host if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < chain.length]
    if wrong:
        raise MemschedError(f"host_stages: stage {wrong[0]!r} is not one of chain '{chain.name}''s stages "
                            f"0..{chain.length - 1}")
    return frozenset(host)


def updated_chain(chain, update: str, transfer=None, host=None):
    """``chain`` as the step with ``update`` allocates it (the chain itself for ``"after"``).

    Stage ``i``'s gradients, but those of parameters it shares with earlier stages (kept in ``param_bytes``), no
    longer persist after ``B i``: they all exist at its end, before the update frees them, so its backward
    temporaries become ``max(bwd_tmp_bytes, param_bytes - own_saved_bytes - out_bytes)`` (the memory right after
    its backward in the chain model, less what the backward left), for the stage and each of its options. For
    ``"on-host"`` the backward of each stage in ``host`` (:func:`host_stages_of`: every stage when None; the others
    update on the device, as in-backward) also takes the copy of those gradients to the host and of the stage's
    parameters (as many bytes) back, over ``transfer`` (the chain's when None; without a usable channel the
    bytes are exact and the copies take no time: :func:`check_channel` refuses that for a plan).
    """
    check_update(update)
    if update == "after":
        return chain
    on_host = host_stages_of(chain, update, host)
    channel = transfer or chain.transfer
    if channel is not None and not channel.usable:
        channel = None
    kept = [0] * chain.length
    for parameter in chain.shared:
        kept[parameter.owner] += parameter.bytes
    stages = []
    for i, stage in enumerate(chain.stages):
        made = stage.param_bytes
        stays = min(made, kept[i])
        copies = 0.0
        if i in on_host and made and channel is not None:
            copies = channel.seconds(made - stays, "d2h") + channel.seconds(made, "h2d")
        options = tuple(dataclasses.replace(option, bwd_time=option.bwd_time + copies,
                                            bwd_tmp_bytes=backward_transient(option.bwd_tmp_bytes, made,
                                                                             option.own_saved_bytes, stage.out_bytes))
                        for option in stage.options)
        stages.append(dataclasses.replace(
            stage, param_bytes=stays, bwd_time=stage.bwd_time + copies, options=options, held_bwd_tmp_bytes=None,
            bwd_tmp_bytes=backward_transient(stage.bwd_tmp_bytes, made, stage.own_saved_bytes, stage.out_bytes)))
    return dataclasses.replace(chain, stages=tuple(stages))


def backward_transient(bwd_tmp: int, gradients: int, own_saved: int, out: int) -> int:
    """A backward's temporaries (bytes) once the ``gradients`` it makes are freed at its end: at least the moment
    all exist (planner/accumulate.py makes them transient too)."""
    return max(bwd_tmp, gradients - own_saved - out)

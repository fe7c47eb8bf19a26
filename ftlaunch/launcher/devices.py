"""Which GPUs each replica group of an ``ftlaunch`` job gets on this machine.

Why: every group is one torchelastic agent, and torchelastic gives each worker the machine's GPUs
by local rank. With several groups on one machine, rank r of every group would then land on GPU
r -- and the cross-group NCCL communicator, whose members are exactly those ranks, refuses two of
its ranks on one device ("Duplicate GPU detected"). So when the machine has a GPU per worker of
every group, each group gets its own slice through ``CUDA_VISIBLE_DEVICES``, as a scheduler would
give each of its nodes; otherwise the groups share the GPUs and the launcher says so. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_devices(visible: Sequence[str], nproc_per_node: int, groups: int) -> list[tuple[str, ...]] | None:
    """Each group's devices (a slice of ``visible``, in order) when there are enough for
    ``groups`` groups of ``nproc_per_node`` workers, else None (they must share)."""
    if nproc_per_node < 1 or groups < 1 or len(visible) < nproc_per_node * groups:
        return None
    return [tuple(visible[g * nproc_per_node : (g + 1) * nproc_per_node]) for g in range(groups)]


def sharing_warning(gpus: int, nproc_per_node: int, groups: int) -> str | None:
    """One line for a job whose groups must share GPUs (None when they need not, or there are none)."""
    if gpus == 0 or groups < 2 or gpus >= nproc_per_node * groups:
        return None
    return (
        f"{groups} replica groups x {nproc_per_node} worker(s) on {gpus} GPU(s): the groups share GPUs, "
        "and NCCL refuses two ranks of one communicator on one device; give each group its own GPUs "
        "(fewer groups or workers, or more GPUs), or run the cross-group backend on CPU "
        "(FTLAUNCH_BACKEND=baby-gloo)"
    )

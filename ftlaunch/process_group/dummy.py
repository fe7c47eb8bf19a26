"""`ProcessGroupDummy`: a group that communicates nothing and completes every op at once.

Why: to run code written against a process group where there is nothing to talk to (a single
replica group, a test) without touching the caller's tensors. It does not simulate results: an
allreduce leaves its input as it is, whatever the world size.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.work import DoneWork
from ftlaunch.timeouts import as_timedelta

__all__ = ["ProcessGroupDummy"]


class ProcessGroupDummy(ProcessGroup):
    """Discards all data and returns success at once (to silence ops without touching the caller).

    Every operation leaves its tensors untouched and completes immediately; `configure` only
    records the rank and world size (and counts calls in ``configure_count``).
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"bad rank/world: {rank}/{world}")
        self.configure_count = 0
        self._auto_register()

    def getBackendName(self) -> str:  # noqa: N802
        return "ftlaunch-dummy"

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self._begin_configure(store_addr, rank, world_size)
        self.configure_count += 1

    def set_timeout(self, timeout: timedelta | float) -> None:
        as_timedelta(timeout)

    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        return DoneWork(tensors)

    def _do_allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        return DoneWork(tensors)

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        return DoneWork(outputs)

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work:
        return DoneWork([output])

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        return DoneWork(tensors)

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        return DoneWork(outputs)

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        return DoneWork([output])

    def _do_all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        return DoneWork([output])

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        return DoneWork(outputs)

    def _do_send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return DoneWork(tensors)

    def _do_recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return DoneWork(tensors)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        return DoneWork([])

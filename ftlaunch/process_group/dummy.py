"""`ProcessGroupDummy`: a group that communicates nothing and completes every op at once.

Why: to run code written against a process group where there is nothing to talk to (a single
replica group, a test, the placeholder group under torch's DDP) without touching the caller's
inputs. Ops that only *produce* data fill their outputs with what this rank would receive if every
peer were itself, with no arithmetic: gathers copy the input into every slot, scatters and
all-to-alls hand the rank its own share. So with one member (torchft's only case) every result is
exact, and torch code that reads gathered values (DDP's parameter-shape check,
``all_gather_object``) works. Reductions leave their tensors as they are, whatever the world size.
Lists of outputs and inputs are paired as far as both go, as torchft's dummy does: a wrapper whose
size is not the dummy's (``ManagedProcessGroup`` reports the quorum's) hands it lists sized for
its own world, and a group that communicates nothing has no peer to disagree with.
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
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.work import DoneWork
from ftlaunch.timeouts import as_timedelta

__all__ = ["ProcessGroupDummy"]


class ProcessGroupDummy(ProcessGroup):
    """Communicates nothing and returns success at once (to silence ops without touching the caller).

    Every operation completes immediately; inputs and reduced tensors are left as they are,
    outputs of gathers, scatters and all-to-alls get this rank's own data (see the module
    docstring). `configure` only records the rank and world size (and counts calls in
    ``configure_count``; ``reconfigure_count`` is the same count under torchft's current name,
    since a `reconfigure` is a `configure` on the rendezvous its handles name).
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"bad rank/world: {rank}/{world}")
        self.configure_count = 0
        self._auto_register()

    def getBackendName(self) -> str:  # noqa: N802
        return "ftlaunch-dummy"

    @property
    def reconfigure_count(self) -> int:
        """How many times this group was set up, by `configure` or `reconfigure` (torchft's name)."""
        return self.configure_count

    def __repr__(self) -> str:
        # Nothing to show but the rank and size, and those only when they are not a lone member's.
        if (self.rank(), self.size()) == (0, 1):
            return "ProcessGroupDummy()"
        return f"ProcessGroupDummy(rank={self.rank()}, size={self.size()})"

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
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
        for outs, inp in zip(outputs, inputs, strict=False):
            for o in outs:
                o.copy_(inp)
        return DoneWork(outputs)

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work:
        if output.numel() % max(input.numel(), 1):
            raise ValueError(
                f"all_gather_single: output of {output.numel()} elements does not hold "
                f"whole copies of an input of {input.numel()}"
            )
        if input.numel():
            output.view(-1, input.numel()).copy_(input.reshape(1, -1))
        return DoneWork([output])

    def _do_all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        for o, i in zip(outputs, inputs, strict=False):
            self._do_all_gather_single(o, i, opts)
        return DoneWork(outputs)

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        return DoneWork(tensors)

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        rank = self.rank()
        for out, ins in zip(outputs, inputs, strict=False):
            out.copy_(ins[rank] if rank < len(ins) else ins[0])
        return DoneWork(outputs)

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        n = output.numel()
        flat = input.reshape(-1)
        start = self.rank() * n if flat.numel() >= (self.rank() + 1) * n else 0
        output.copy_(flat[start : start + n].view_as(output))
        return DoneWork([output])

    def _do_reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions
    ) -> dist.Work:
        for o, i in zip(outputs, inputs, strict=False):
            self._do_reduce_scatter_single(o, i, opts)
        return DoneWork(outputs)

    def _do_all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        world, rank = self.size(), self.rank()
        ins = input_splits or [input.shape[0] // world] * world
        outs = output_splits or [output.shape[0] // world] * world
        start = sum(ins[:rank])
        mine = input[start : start + ins[rank]]
        at = 0
        for n in outs:  # every peer sends us what we would send ourselves
            if n != mine.shape[0]:
                raise ValueError(
                    f"all_to_all_single: output split {n} does not match this rank's own share "
                    f"{mine.shape[0]}"
                )
            output[at : at + n].copy_(mine)
            at += n
        return DoneWork([output])

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        own = inputs[self.rank()] if self.rank() < len(inputs) else inputs[0]
        for o in outputs:
            o.copy_(own)
        return DoneWork(outputs)

    def _do_send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return DoneWork(tensors)

    def _do_recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return DoneWork(tensors)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        return DoneWork([])

    def _do_reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> dist.Work:
        self._check_root("reduce", opts.rootRank)
        return DoneWork(tensors)

    def _do_gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions
    ) -> dist.Work:
        self._check_root("gather", opts.rootRank)
        for outs in outputs:  # the root's list (others pass none)
            for o in outs:
                o.copy_(inputs[0])
        return DoneWork(outputs)

    def _do_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> dist.Work:
        self._check_root("scatter", opts.rootRank)
        if inputs and inputs[0]:  # the root: its own share; others have nothing to copy from
            outputs[0].copy_(inputs[0][self.rank()])
        return DoneWork(outputs)

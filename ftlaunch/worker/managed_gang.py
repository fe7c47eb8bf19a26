"""`ManagedGang`: the replica dimension as a fairseq2 gang, through the Manager; and the `Gangs` of
``ft.gangs()``.

The gang is this worker and the workers with the same group rank in the other replica groups of
the step's quorum, over the Manager's reconfigurable process group. So, unlike a torch gang:

* its ``rank`` and ``size`` are the quorum's and change from step to step - a failed group leaves,
  a restarted one rejoins;
* a step has boundaries, which the gang's user marks: `ManagedGang.begin_step` (the Manager's
  ``start_quorum``) before the step's first collective, `ManagedGang.should_commit` (the Manager's
  ``should_commit``) before applying the update; apply it only if that returns True;
* a communication failure never raises: it is reported to the Manager, the collective's result is
  undefined, and ``should_commit`` returns False on every group. The next step carries on with the
  groups that are left. Only what training cannot survive raises (the lighthouse is gone, this group
  was evicted, too many failed steps in a row);
* a group that heals in this step (its weights are stale until the commit) contributes nothing to
  a reduction: zeros to SUM, the identity to PRODUCT/MIN/MAX, and MEAN divides by the number of
  up-to-date groups - what DDP's gradient average does through the Manager.

`fault_tolerant_gangs` builds the rest around it: ``sdp``/``tp``/``pp`` inside the replica group
(`create_parallel_gangs` over the group's own process group), ``dp`` and ``root`` as products of the
replica dimension and the group's gangs (`ProductGang`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ftlaunch.errors import InvalidOperationError, NotSupportedError
from ftlaunch.gang.base import (
    Gang,
    ReduceOperation,
    broadcast_pickled,
    check_all_gather,
    check_all_gather_list,
    check_objects,
    check_ranks,
    check_reduce_operation,
    check_source_rank,
)
from ftlaunch.gang.gangs import Gangs, create_parallel_gangs
from ftlaunch.gang.product import ProductGang
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.worker.managed_pg import ManagedProcessGroup
from ftlaunch.worker.manager import Manager

__all__ = ["FaultTolerantGangs", "ManagedGang", "fault_tolerant_gangs"]

_TORCH_OP = {
    ReduceOperation.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOperation.MIN: dist.ReduceOp.MIN,
    ReduceOperation.MAX: dist.ReduceOp.MAX,
}


def _identity(op: ReduceOperation, dtype: torch.dtype) -> float | int | bool:
    """The value that leaves a PRODUCT/MIN/MAX unchanged: what a group without a say contributes."""
    if op is ReduceOperation.PRODUCT:
        return 1
    if dtype == torch.bool:
        return op is ReduceOperation.MIN
    if dtype.is_floating_point:
        return float("inf") if op is ReduceOperation.MIN else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if op is ReduceOperation.MIN else info.min


class ManagedGang(Gang):
    """``ManagedGang(manager, device)``: the fault-tolerant gang across replica groups."""

    def __init__(self, manager: Manager, device: torch.device) -> None:
        self._manager = manager
        self._device = torch.device(device)
        self._in_step = False
        self._began = False
        self._closed = False
        self._process_group: dist.ProcessGroup | None = None

    @property
    def manager(self) -> Manager:
        return self._manager

    # ---- step boundaries ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Begin a step: ask for its quorum (in the background). Idempotent within a step, so a
        loop may call it at the top of every iteration even after ``ft.gangs()`` began the first."""
        self._check_open("begin_step")
        if not self._in_step:
            self._manager.start_quorum()
            self._in_step = True
            self._began = True

    def should_commit(self) -> bool:
        """End the step: True if every rank of every group in the quorum finished it cleanly (then
        apply the update), False if it failed anywhere (then skip it, everywhere alike)."""
        self._check_open("should_commit")
        if not self._in_step:
            raise InvalidOperationError("should_commit() outside a step: call begin_step() first")
        self._in_step = False
        return self._manager.should_commit()

    @property
    def in_step(self) -> bool:
        return self._in_step

    # ---- identity: the quorum's ------------------------------------------------------------------
    def _quorum(self, what: str) -> ProcessGroup:
        """The cross-group process group, configured for this step's quorum (waiting for it)."""
        self._check_open(what)
        if not self._began:
            raise InvalidOperationError(
                f"{what}: the replica gang's membership is the step's quorum; call begin_step()"
            )
        if self._in_step:
            self._manager.wait_quorum()
        return self._manager.pg

    @property
    def rank(self) -> int:
        """This replica group's rank in the quorum of the current (else the last) step."""
        return self._quorum("rank").rank()

    @property
    def size(self) -> int:
        """The number of replica groups in the quorum of the current (else the last) step."""
        return self._quorum("size").size()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def supports_process_group(self) -> bool:
        return True

    # ---- collectives -----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidOperationError(f"{what}: the gang is closed")

    def _in_a_step(self, what: str) -> ProcessGroup:
        if not self._in_step:
            self._check_open(what)
            raise InvalidOperationError(f"{what} outside a step: call begin_step() first")
        return self._quorum(what)

    def _run(self, pg: ProcessGroup, issue: Callable[[ProcessGroup], dist.Work]) -> bool:
        """Run one collective on the step's group; a failure is reported, never raised. False when
        nothing was exchanged (no usable group this step, or the op failed)."""
        m = self._manager
        if m.num_participants() == 0 or pg.errored() is not None:
            return False  # the quorum or the group failed: already reported, the step will not commit
        try:
            issue(pg).wait()
        except (ValueError, TypeError):
            raise  # misuse is the caller's, on every rank alike
        except Exception as e:  # noqa: BLE001 - a communication failure: reported, not raised
            m.report_error(e)
            return False
        return True

    def barrier(self) -> None:
        pg = self._in_a_step("barrier")
        if pg.size() > 1:
            self._run(pg, lambda g: g.barrier())

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        op = check_reduce_operation(op)
        pg = self._in_a_step("all_reduce")
        m = self._manager
        if op is ReduceOperation.SUM or op is ReduceOperation.MEAN:
            if op is ReduceOperation.MEAN and (tensor.is_floating_point() or tensor.is_complex()):
                m.allreduce(tensor, "avg").wait()
                return
            m.allreduce(tensor, "sum").wait()
            if op is ReduceOperation.MEAN and m.num_participants() > 1:
                tensor.div_(m.num_participants(), rounding_mode="floor")  # integers round down
            return
        if pg.size() == 1 or m.num_participants() == 0:
            return  # alone, the reduction is the tensor; without a quorum there is nothing to do
        if not m.is_participating() or m.errored() is not None:
            tensor.fill_(_identity(op, tensor.dtype))  # stale or failed: no say in the result
        self._run(pg, lambda g: g.allreduce([tensor], _TORCH_OP[op]))

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        pg = self._in_a_step("all_gather")
        check_all_gather(output_tensor, input_tensor, pg.size())
        if pg.size() == 1:
            output_tensor[0].copy_(input_tensor)
            return
        # Flat views: gloo (in a Baby child too) takes a concatenation, not a stack, of the inputs.
        self._run(pg, lambda g: g.all_gather_single(output_tensor.view(-1), input_tensor.reshape(-1)))

    def all_gather_to_list(self, output_tensors: list[torch.Tensor], input_tensor: torch.Tensor) -> None:
        pg = self._in_a_step("all_gather_to_list")
        check_all_gather_list(output_tensors, input_tensor, pg.size())
        if pg.size() == 1:
            output_tensors[0].copy_(input_tensor)
            return
        self._run(pg, lambda g: g.allgather(output_tensors, input_tensor))

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        pg = self._in_a_step("broadcast")
        check_source_rank(source_rank, pg.size())
        if pg.size() > 1:
            self._run(pg, lambda g: g.broadcast_one(tensor, source_rank))

    def broadcast_objects(self, objects: list[object], source_rank: int = 0) -> None:
        pg = self._in_a_step("broadcast_objects")
        check_objects(objects)
        check_source_rank(source_rank, pg.size())
        if pg.size() == 1:
            return

        def send(t: torch.Tensor, src: int) -> bool:
            return self._run(pg, lambda g: g.broadcast_one(t, src))

        broadcast_pickled(send, objects, source_rank, pg.rank() == source_rank, self._device, safe=True)

    def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        check_ranks(ranks, self.size)
        raise NotSupportedError(
            "the replica gang's membership changes at every step: it has no fixed sub-gangs "
            "(create sub-gangs inside the replica group)"
        )

    def as_process_group(self) -> dist.ProcessGroup:
        """A torch ProcessGroup whose allreduce goes through the Manager (for DDP or FSDP's
        replicate dimension): `ftlaunch.worker.managed_pg.ManagedProcessGroup`."""
        self._check_open("as_process_group")
        if self._process_group is None:
            self._process_group = ManagedProcessGroup(self._manager)
        return self._process_group

    def close(self) -> None:
        """Shut the Manager down: leave the quorum, stop its threads, its transport and its
        process group (with a Baby group, its child process). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._in_step = False
        self._process_group = None
        self._manager.shutdown()

    def __repr__(self) -> str:
        if self._closed or not self._began:
            state = "closed" if self._closed else "before the first step"
            return f"ManagedGang({state}, device={self._device})"
        pg = self._manager.pg
        return (
            f"ManagedGang(rank={pg.rank()}, size={pg.size()}, step={self._manager.current_step()}, "
            f"device={self._device})"
        )


@dataclass(frozen=True, kw_only=True)
class FaultTolerantGangs(Gangs):
    """The `Gangs` of ``ft.gangs()``: closing them also runs ``release`` (``ft.shutdown``), so that
    nothing of the worker's fault tolerance outlives ``gangs.close()`` - ``ft`` itself holds the
    replica group's process group, whose gloo threads and sockets live as long as a reference."""

    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    def close(self) -> None:
        super().close()
        self.release()


def fault_tolerant_gangs(
    manager: Manager, group_root: Gang, *, tp_size: int = 1, release: Callable[[], None] | None = None
) -> FaultTolerantGangs:
    """The `Gangs` of a worker of a fault-tolerant job (what ``ft.gangs()`` returns).

    ``group_root`` is the replica group's own gang (every worker of the group; a `FakeGang` for a
    group of one). Inside it, `create_parallel_gangs` lays out ``tp_size`` tensor parallelism and
    the group's data parallel gang, which is ``sdp``; ``rdp`` is the `ManagedGang` across groups,
    ``dp`` = ``rdp`` x ``sdp`` and ``root`` = ``rdp`` x ``group_root``. Begins the first step (the
    coordinator check of `Gangs` needs the quorum's ranks). Every worker of the group calls it.
    ``release`` runs after the gangs close (``ft.gangs()`` passes ``ft.shutdown``).
    """
    inner = create_parallel_gangs(group_root, tp_size=tp_size)
    rdp = ManagedGang(manager, group_root.device)
    rdp.begin_step()
    return FaultTolerantGangs(
        root=ProductGang(rdp, group_root),
        dp=ProductGang(rdp, inner.dp),
        rdp=rdp,
        sdp=inner.dp,
        tp=inner.tp,
        pp=inner.pp,
        release=release or (lambda: None),
    )

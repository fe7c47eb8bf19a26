"""`ManagedProcessGroup`: a process group whose allreduce goes through a Manager.

For code that takes a process group (FSDP2 all-reduce hooks, custom gradient sync) rather than a
Manager: it gets fault tolerance for free. Its size is the number of up-to-date replica groups in
this step's quorum, and errors are reported to the Manager instead of raised — the step then simply
does not commit.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.process_group.wrappers import ProcessGroupWrapper
from ftlaunch.worker.manager import Manager, ReduceOpLike


class _FuturesWork(dist.Work):
    """A Work over Manager futures (which never fail: errors went to the Manager)."""

    def __init__(self, futures: list[torch.futures.Future[torch.Tensor]]) -> None:
        super().__init__()
        self._futures = futures

    def wait(self, timeout: timedelta | None = None) -> bool:
        for f in self._futures:
            f.wait()
        return True

    def is_completed(self) -> bool:
        return all(f.done() for f in self._futures)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        out: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        torch.futures.collect_all(self._futures).then(
            lambda fs: out.set_result([f.value() for f in fs.value()])
        )
        return out


def _op_of(opts: Any) -> ReduceOpLike:
    """The reduce op of torch's ``opts`` argument: None (average), a ReduceOp, or an options object."""
    if opts is None:
        return "avg"
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        return opts
    op: ReduceOpLike = getattr(opts, "reduceOp", "avg")  # AllreduceOptions and its relatives
    return op


class ManagedProcessGroup(ProcessGroupWrapper):
    """``ManagedProcessGroup(manager)``: allreduce through ``manager.allreduce``."""

    def __init__(self, manager: Manager) -> None:
        # ``_pg``, the attribute torchft's ManagedProcessGroup reads: tests written for torchft
        # stand a ``Mock(spec=Manager)`` in for the Manager and set its ``_pg`` to a real group,
        # which every operation but allreduce goes to. On a real Manager it is ``manager.pg``.
        super().__init__(manager._pg)
        self._manager = manager

    # Takes torch's overload forms positionally (a tensor or a list; opts or a ReduceOp), like the
    # base class; the stub's op=/timeout= keyword forms are not supported, hence ignore[override].
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = _op_of(opts)
        if len(tensors) == 1:
            # The Manager's own Work (torchft's): its wait() says whether the step is still good.
            return self._manager.allreduce(tensors[0], reduce_op=op)
        return _FuturesWork([self._manager.allreduce(t, reduce_op=op).get_future() for t in tensors])

    def size(self) -> int:
        return self._manager.num_participants()

    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        return "ftlaunch-managed"

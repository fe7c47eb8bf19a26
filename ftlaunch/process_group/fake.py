"""`FakeProcessGroup`: a world of identical peers, simulated in one process (for unit tests).

In the spirit of fairseq2's ``FakeGang``, but a simulation rather than a no-op: every collective
returns what it would return if each of the ``size()`` ranks had passed the same tensors as this
one. So allreduce SUM multiplies by the world size, AVG/MIN/MAX leave the value, allgather
replicates, broadcast keeps, reduce_scatter and alltoall hand this rank its share of that
replicated world. Code written against `ProcessGroup` (the Manager's averaging and commit vote)
then runs unchanged in one process, and its arithmetic can be checked.

Failures behave as in the real groups:

- `fail_next` makes the next operation fail with a `CommunicationError` (from ``Work.wait()`` and
  the Work's future, or raised when issued); `errored()` then reports it and every later operation
  fails fast, until the next `configure` starts a new configuration.
- `hang_next` leaves the next operation pending, as a peer that stopped (SIGSTOP) would. It never
  times out by itself (tests control time): ``Work.wait(timeout)`` gives up after ``timeout``,
  `abort` fails it (and errors the group, as the real groups' abort does), `resume` completes it.
- `configure` takes effect (rank and size change, errors are forgotten, pending operations of the
  old configuration fail) and can be failed too: ``fail_next("configure")``.

Every call is recorded (`configure_calls`, `ops` with a copy of the inputs) for assertions.
Point-to-point ``send``/``recv`` are not simulated: which tensor an identical peer sends to whom
is not defined by this one's calls, so they raise NotImplementedError; so does ``scatter`` on a
rank other than the root (it would receive the root's list, which this rank does not pass).
``reduce``, ``gather`` and the root's ``scatter`` are the base class's composites over
allreduce, allgather and broadcast, recorded as those ops.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from ftlaunch.addresses import parse_store_addr
from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.failures import FailureRecord
from ftlaunch.timeouts import as_timedelta

__all__ = ["FakeOp", "FakeProcessGroup"]

_ZERO = timedelta(0)


@dataclass(frozen=True)
class FakeOp:
    """One recorded operation: its name, reduce op (if any) and a copy of its inputs when issued."""

    name: str
    reduce_op: dist.ReduceOp | None
    inputs: tuple[torch.Tensor, ...]


_R = dist.ReduceOp
_SIMULATED = (_R.SUM, _R.PRODUCT, _R.BXOR, _R.AVG, _R.MIN, _R.MAX, _R.BAND, _R.BOR)


def _kind(op: dist.ReduceOp) -> Any:
    """``op``'s kind, one of `_SIMULATED` (a ReduceOp equals its kind only from its own side)."""
    for kind in _SIMULATED:
        if op == kind:
            return kind
    raise ValueError(f"FakeProcessGroup does not simulate reduce op {op}")


def _reduce_identical(t: torch.Tensor, kind: Any, world: int) -> torch.Tensor:
    """The reduction of ``world`` copies of ``t``."""
    if kind == _R.SUM:
        return t * world
    if kind == _R.PRODUCT:
        return t**world
    if kind == _R.BXOR:
        return t.clone() if world % 2 else torch.zeros_like(t)
    return t.clone()  # AVG, MIN, MAX, BAND, BOR of equal values


class _FakeWork(dist.Work):
    """A Work that is done, failed, or pending until the group resolves it."""

    def __init__(self, failures: FailureRecord, op: str, result: Any, apply: Callable[[], None]) -> None:
        super().__init__()
        self._failures = failures
        self._op = op
        self._result = result
        self._apply = apply
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._done = threading.Event()
        self._error: CommunicationError | None = None
        self.generation = failures.generation

    def _resolve(self, error: CommunicationError | None) -> None:
        """Complete once: write the results (success) or fail with ``error``."""
        if self._done.is_set():
            return
        if error is None:
            self._apply()
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta = _ZERO) -> bool:
        if not self._done.wait(timeout.total_seconds() if timeout else None):
            raise self._failures.record(self._op, f"not completed within wait(timeout={timeout})")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> CommunicationError | None:
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class FakeProcessGroup(ProcessGroup):
    """``FakeProcessGroup(rank, world_size)``: usable at once; `configure` changes rank and size."""

    def __init__(
        self, rank: int = 0, world_size: int = 1, timeout: timedelta | float = timedelta(seconds=60)
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        super().__init__(rank, world_size)
        self.timeout = as_timedelta(timeout)
        #: ``(store_addr, rank, world_size)`` of every configure call, failed ones included.
        self.configure_calls: list[tuple[str, int, int]] = []
        #: Every operation issued, in order (failed and hung ones included).
        self.ops: list[FakeOp] = []
        #: Number of `abort` calls.
        self.aborts = 0
        self._lock = threading.Lock()
        self._closed = False
        self._faults: list[
            tuple[str | None, str, BaseException | None]
        ] = []  # (op, "fail"/"hang"/"issue", exc)
        self._pending: list[_FakeWork] = []

    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        return "ftlaunch-fake"

    # ---- fault injection --------------------------------------------------------------------------
    def fail_next(
        self, op: str | None = None, exc: BaseException | None = None, *, on_issue: bool = False
    ) -> None:
        """The next operation named ``op`` (any, if None; ``"configure"`` too) fails with a
        `CommunicationError` made from ``exc``: from its Work, or raised by the call with ``on_issue``."""
        with self._lock:
            self._faults.append((op, "issue" if on_issue else "fail", exc))

    def hang_next(self, op: str | None = None) -> None:
        """The next operation named ``op`` (any, if None) stays pending (see the module docstring)."""
        with self._lock:
            self._faults.append((op, "hang", None))

    def resume(self) -> None:
        """Complete every pending operation successfully (the stopped peer continued)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for work in pending:
            work._resolve(None)

    def _take_fault(self, op: str) -> tuple[str, BaseException | None] | None:
        with self._lock:
            for i, (name, kind, exc) in enumerate(self._faults):
                if name is None or name == op:
                    del self._faults[i]
                    return kind, exc
        return None

    def _fail_pending(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for work in pending:
            work._resolve(self._failures.as_error(work._op, reason))

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        parse_store_addr(store_addr)  # malformed addresses are misuse, as in the real groups
        self.configure_calls.append((store_addr, rank, world_size))
        self._fail_pending("aborted (the group was reconfigured)")
        self._begin_configure(store_addr, rank, world_size)
        self._closed = False
        fault = self._take_fault("configure")
        if fault is not None:
            raise self._failures.record("configure", fault[1] or "injected failure")

    def abort(self) -> None:
        """Fail the operations in flight and error the group until the next `configure`."""
        self.aborts += 1
        self._failures.record("abort", "process group aborted", quiet=True)
        self._fail_pending("aborted (the group failed, was aborted or was reconfigured)")

    def shutdown(self) -> None:
        super().shutdown()
        self._closed = True
        self._fail_pending("aborted (the group was shut down)")

    def set_timeout(self, timeout: timedelta | float) -> None:
        self.timeout = as_timedelta(timeout)

    # ---- one place where every operation is issued ------------------------------------------------
    def _issue(
        self,
        op: str,
        inputs: list[torch.Tensor],
        result: Any,
        apply: Callable[[], None],
        reduce_op: dist.ReduceOp | None = None,
    ) -> dist.Work:
        """Record ``op``, then run ``apply`` (which writes the outputs) now, later, or never."""
        if self._closed:
            raise self._unusable_error(op)
        self.ops.append(FakeOp(op, reduce_op, tuple(t.detach().clone() for t in inputs)))
        if self._failures.error is not None:
            raise self._failures.error  # errored: fail fast until the next configure
        work = _FakeWork(self._failures, op, result, apply)
        fault = self._take_fault(op)
        if fault is None:
            work._resolve(None)
            return work
        kind, exc = fault
        if kind == "hang":
            with self._lock:
                self._pending.append(work)
            return work
        error = self._failures.record(op, exc or "injected failure")
        if kind == "issue":
            raise error
        work._resolve(error)
        return work

    # ---- the simulated collectives ------------------------------------------------------------------
    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        op, world = _kind(opts.reduceOp), self.size()

        def apply() -> None:
            for t in tensors:
                t.copy_(_reduce_identical(t, op, world))

        return self._issue("allreduce", tensors, tensors, apply, opts.reduceOp)

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        world = self.size()
        if any(len(out) != world for out in outputs):
            raise ValueError(f"allgather: every output list needs world size {world} tensors")

        def apply() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                for o in out:
                    o.copy_(inp)

        return self._issue("allgather", inputs, outputs, apply)

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        if not 0 <= opts.rootRank < self.size():
            raise ValueError(
                f"broadcast: root rank {opts.rootRank} out of range for world size {self.size()}"
            )
        return self._issue("broadcast", tensors, tensors, lambda: None)  # every peer holds the same

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        op, world, rank = _kind(opts.reduceOp), self.size(), self.rank()
        if len(outputs) != len(inputs) or any(len(ins) != world for ins in inputs):
            raise ValueError(f"reduce_scatter: expected {world} inputs per output")

        def apply() -> None:
            for out, ins in zip(outputs, inputs, strict=True):
                out.copy_(_reduce_identical(ins[rank], op, world))

        return self._issue(
            "reduce_scatter", [t for ins in inputs for t in ins], outputs, apply, opts.reduceOp
        )

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        op, world, rank, n = _kind(opts.reduceOp), self.size(), self.rank(), output.numel()
        if input.numel() != n * world:
            raise ValueError(
                f"reduce_scatter_single: input has {input.numel()} elements, expected {n} x {world}"
            )

        def apply() -> None:
            mine = input.reshape(-1)[rank * n : (rank + 1) * n].view_as(output)
            output.copy_(_reduce_identical(mine, op, world))

        return self._issue("reduce_scatter_single", [input], [output], apply, opts.reduceOp)

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        world, rank = self.size(), self.rank()
        if len(outputs) != world or len(inputs) != world:
            raise ValueError(f"alltoall: expected {world} outputs and inputs")

        def apply() -> None:
            for out in outputs:  # peer j sends us its inputs[rank], which equals ours
                out.copy_(inputs[rank])

        return self._issue("alltoall", inputs, outputs, apply)

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
        if len(ins) != world or len(outs) != world or any(o != ins[rank] for o in outs):
            raise ValueError(
                f"all_to_all_single: identical peers each send us {ins[rank] if len(ins) == world else '?'} "
                f"rows, so output splits must all equal that (got {outs})"
            )

        def apply() -> None:
            start = sum(ins[:rank])
            chunk = input[start : start + ins[rank]]
            output.copy_(torch.cat([chunk] * world))

        return self._issue("all_to_all_single", [input], [output], apply)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        return self._issue("barrier", [], [], lambda: None)

    def _do_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> dist.Work:
        if self.rank() != opts.rootRank:
            raise NotImplementedError(
                "FakeProcessGroup does not simulate scatter on a non-root rank (the root's data is "
                "unknown here)"
            )
        return super()._do_scatter(outputs, inputs, opts)

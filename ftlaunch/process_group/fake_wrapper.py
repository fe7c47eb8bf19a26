"""`FakeProcessGroupWrapper`: torchft's failure-injecting wrapper, for users' own tests.

torchft ships ``FakeProcessGroupWrapper(pg)`` with ``report_future_error(e)``: the next allreduce
issued on the group fails with ``e`` when its result is read, while the collective itself still
runs on the real group underneath (so peers are not left waiting). Tests written for torchft
inject "this rank's allreduce failed at step N" that way; with this class they run unchanged over
ftlaunch's groups. A ``configure`` (reconfigure) forgets an injected error not yet used, as
torchft's does. ftlaunch's own in-process simulation is `ftlaunch.process_group.fake.FakeProcessGroup`.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions

from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.work import NO_TIMEOUT
from ftlaunch.process_group.wrappers import ProcessGroupWrapper

__all__ = ["FakeProcessGroupWrapper"]


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Wraps any group; `report_future_error` makes the next allreduce's result an error."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._inject_lock = threading.Lock()
        self._future_error: Exception | None = None

    def report_future_error(self, e: Exception) -> None:
        """The next allreduce's ``wait()`` raises ``e`` and its future completes with ``e``."""
        with self._inject_lock:
            self._future_error = e

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        with self._inject_lock:
            self._future_error = None
        super()._configure(store_addr, rank, world_size)

    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        work = super()._do_allreduce(tensors, opts)
        with self._inject_lock:
            error, self._future_error = self._future_error, None
        return work if error is None else _FailingWork(work, error)


class _FailingWork(dist.Work):
    """The collective runs; its result is replaced by the injected error."""

    def __init__(self, inner: dist.Work, error: Exception) -> None:
        super().__init__()
        self._inner = inner
        self._error = error

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        if timeout:
            self._inner.wait(timeout)
        else:
            self._inner.wait()
        raise self._error

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        error = self._error

        def _done(fut: torch.futures.Future) -> None:
            out.set_exception(error)

        self._inner.get_future().add_done_callback(_done)
        return out

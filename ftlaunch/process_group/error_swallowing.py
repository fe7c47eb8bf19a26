"""`ErrorSwallowingProcessGroupWrapper`: communication errors become a report, not an exception.

Why: modeling code (a forward pass, DDP's reducer, an FSDP hook) should not need error handling
for a peer that died mid-step. After the first error every operation returns a completed Work that
leaves its tensors as they are, until the next `configure`; the owner (the Manager) checks
`error()` once per step and discards the step instead of committing it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.work import NO_TIMEOUT, DoneWork, wait_on
from ftlaunch.process_group.wrappers import ProcessGroupWrapper

logger = logging.getLogger(__name__)

__all__ = ["ErrorSwallowingProcessGroupWrapper", "SwallowingWork"]


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Turns communication errors into reported errors and dummy results.

    After the first error every operation returns a completed Work (tensors left as they are)
    until the next `configure`, so modeling code needs no error handling; the owner (Manager)
    checks `error()` once per step and discards the step.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        if not isinstance(pg, ProcessGroup):
            raise TypeError("ErrorSwallowingProcessGroupWrapper needs an ftlaunch ProcessGroup")
        super().__init__(pg=pg)
        self._swallowed: Exception | None = None

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self._swallowed = None
        super()._configure(store_addr, rank, world_size)

    def error(self) -> Exception | None:
        """The error reported since the last configure, if any."""
        return self._swallowed

    def report_error(self, e: Exception) -> None:
        """Record `e`; all following operations are skipped until the next configure."""
        if self._swallowed is None:
            logger.warning("ftlaunch.process_group: swallowing error, skipping ops until reconfigure: %s", e)
            self._swallowed = e

    def errored(self) -> Exception | None:
        return self._swallowed or super().errored()

    def _forward(self, op: str, method: str, *args: Any, peer: int | None = None) -> dist.Work:
        result = _result_of(method, args)
        if self._swallowed is not None:
            return DoneWork(result)
        try:
            work = super()._forward(op, method, *args, peer=peer)
        except CommunicationError as e:
            self.report_error(e)
            return DoneWork(result)
        return SwallowingWork(self, work, result)


def _result_of(method: str, args: tuple[Any, ...]) -> Any:
    """What a completed op's future holds: the tensors it wrote (the first argument, as torch)."""
    if method == "barrier":
        return []
    first = args[0]
    return first if isinstance(first, list) else [first]


class SwallowingWork(dist.Work):
    """Reports a failure to its wrapper instead of raising it."""

    def __init__(self, pg: ErrorSwallowingProcessGroupWrapper, inner: dist.Work, result: Any) -> None:
        super().__init__()
        self._pg = pg
        self._inner = inner
        self._result = result

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        try:
            wait_on(self._inner, timeout)
        except Exception as e:
            self._pg.report_error(e)
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        pg, result = self._pg, self._result

        def _done(fut: torch.futures.Future) -> None:
            try:
                value = fut.value()
            except Exception as e:
                pg.report_error(e)
                value = result
            out.set_result(value)

        self._inner.get_future().add_done_callback(_done)
        return out

"""The Work `Manager.allreduce` returns, and `wrap_future`'s timeout: torchft's shapes for both.

Why a Work rather than the future itself: torchft's ``Manager.allreduce`` returns a Work
(``.wait()``, ``.get_future()``), and code written for it - DDP comm hooks, DiLoCo-style outer
loops - calls those. The failure model is the Manager's: the future never fails (a failed
collective is reported to the Manager, and the step is not committed), so ``wait()`` never raises;
it says whether the step is still good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError

__all__ = ["ManagedWork", "WorkOnManager", "with_default"]

T = TypeVar("T")


def _timed_wait(future: torch.futures.Future[Any], seconds: float) -> bool:
    """Whether ``future`` completed within ``seconds`` (torch futures have no timed wait)."""
    if future.done():
        return True
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done.wait(seconds)


class ManagedWork(dist.Work):
    """One fault-tolerant allreduce: ``get_future()`` completes with the (averaged) tensor.

    ``wait(timeout)`` blocks until then and returns True, or False when this step has failed
    (somewhere: the result must not be used; ``should_commit`` will refuse the step). A
    ``timeout`` that passes first is reported to the Manager as a `CommunicationError` (False).
    """

    def __init__(
        self,
        future: torch.futures.Future[torch.Tensor],
        step_failed: Callable[[], bool],
        report_error: Callable[[Exception], None],
    ) -> None:
        super().__init__()
        self._future = future
        self._step_failed = step_failed
        self._report_error = report_error

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout:
            if not _timed_wait(self._future, timeout.total_seconds()):
                self._report_error(
                    CommunicationError(f"allreduce did not complete within wait(timeout={timeout})")
                )
                return False
        else:
            self._future.wait()
        return not self._step_failed()

    def synchronize(self) -> None:
        """torchft's name for waiting (the result is ready for the current stream afterwards)."""
        self.wait()

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and not self._step_failed()

    def exception(self) -> None:
        return None  # failures are the Manager's (errored()), never this Work's

    def get_future(self) -> torch.futures.Future[torch.Tensor]:
        return self._future


def with_default(
    future: torch.futures.Future[T],
    default: T,
    seconds: float,
    report_error: Callable[[Exception], None],
) -> torch.futures.Future[T]:
    """A future that completes with ``future``'s value, or with ``default`` when ``future`` fails or
    takes longer than ``seconds`` (the failure or the timeout is reported, never raised)."""
    out: torch.futures.Future[T] = torch.futures.Future()
    lock = threading.Lock()
    settled = [False]

    def settle(value: T, error: Exception | None) -> None:
        with lock:
            if settled[0]:
                return
            settled[0] = True
        if error is not None:
            report_error(error)
        out.set_result(value)

    def on_timeout() -> None:
        settle(default, CommunicationError(f"future did not complete within {seconds:g} s"))

    timer = threading.Timer(seconds, on_timeout)
    timer.daemon = True
    timer.name = "ftlaunch-wrap-future"
    timer.start()

    def on_done(f: torch.futures.Future[T]) -> None:
        timer.cancel()
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - reported to the Manager, the step will not commit
            settle(default, e)
        else:
            settle(value, None)

    future.add_done_callback(on_done)
    return out


class WorkOnManager(dist.Work):
    """A backend Work bound to a Manager, torchft's ``_ManagedWork(manager, work, default_result)``.

    Code written for torchft builds one around a Work of its own (a DDP comm hook, a test's fake
    allreduce): ``wait()`` reports a failure to the manager and returns False instead of raising;
    ``get_future()`` waits as torchft's does, then completes with the work's result, or with
    ``default_result`` when the work failed (reported, never raised: a comm hook must hand DDP a
    finished future). The Manager's own allreduce returns a `ManagedWork`, which does not block.
    """

    def __init__(self, manager: Any, work: dist.Work, default_result: object) -> None:
        super().__init__()
        self._manager = manager
        self._work = work
        self._default = default_result
        self._ok: bool | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._ok is None:
            try:
                if timeout:
                    self._work.wait(timeout)
                else:
                    self._work.wait()
                self._ok = True
            except Exception as e:  # noqa: BLE001 - reported to the Manager, the step will not commit
                self._manager.report_error(e)
                self._ok = False
        return self._ok

    def is_completed(self) -> bool:
        return self._ok is not None or self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        if not self.wait():
            out.set_result(self._default)
            return out
        manager, default = self._manager, self._default

        def _done(fut: torch.futures.Future) -> None:
            try:
                out.set_result(fut.value())
            except Exception as e:  # noqa: BLE001 - reported to the Manager, the step will not commit
                manager.report_error(e)
                out.set_result(default)

        self._work.get_future().add_done_callback(_done)
        return out

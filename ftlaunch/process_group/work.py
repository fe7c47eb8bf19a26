"""The `Work` objects ftlaunch's process groups return, and the one already-completed future.

Why our own: torch's callers (``dist.all_reduce(..., async_op=True)``, DDP's reducer through the
pybind trampoline) only need a ``torch.distributed.Work`` with ``wait`` and ``get_future``; by
subclassing it we decide what a failure looks like. Every failure surfaces as
`ftlaunch.errors.CommunicationError` and is recorded on the group (`FtWork`), several ops can be
seen as one with a final copy step (`ComposedWork`, for the base class's composite ops), and an op
that was skipped or needs no communication completes at once (`DoneWork`). These objects are
created for every operation, so they stay thin: no threads, no copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group.failures import FailureRecord

__all__ = ["NO_TIMEOUT", "ComposedWork", "DoneWork", "FtWork", "PollableWork", "completed_future", "wait_on"]

T = TypeVar("T")

#: ``Work.wait``'s default: no timeout of the caller's own (the op's timeout still applies).
NO_TIMEOUT = timedelta(0)


@runtime_checkable
class PollableWork(Protocol):
    """A Work that can be waited for a while without failing when the time runs out (torch's
    ``wait(timeout)`` records a failure). A caller that must look at a condition of its own every
    few milliseconds (the commit vote: has the lighthouse declared a peer lost?) waits in slices on
    the thread that needs the answer, instead of through a future completed by another thread: one
    thread wake-up per op instead of three (Baby process groups)."""

    def done_within(self, seconds: float) -> bool:
        """Whether the op completed (successfully or not) within ``seconds``; fails nothing."""
        ...


def wait_on(work: dist.Work, timeout: timedelta = NO_TIMEOUT) -> bool:
    """``work.wait(timeout)``, or ``work.wait()`` for `NO_TIMEOUT` (a backend's own default)."""
    return work.wait(timeout) if timeout else work.wait()


def completed_future(value: T) -> torch.futures.Future[T]:
    """A torch future that already holds ``value``."""
    fut: torch.futures.Future[T] = torch.futures.Future()
    fut.set_result(value)
    return fut


class DoneWork(dist.Work):
    """An already completed Work whose future holds `result` (used by Dummy and error swallowing)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        return completed_future(self._result)


class FtWork(dist.Work):
    """Wraps a backend's Work so that failures surface as `CommunicationError` and mark the group.

    Kept deliberately thin (one Python object, no thread): it is created for every operation.
    `release` drops the backend Work when the group aborts after an error: a gloo Work keeps its
    communication context - and so its sockets - alive, and peers blocked on us only fail fast
    once those sockets close.
    """

    def __init__(
        self,
        failures: FailureRecord,
        inner: dist.Work,
        op: str,
        peer: int | None = None,
        devices: tuple[torch.device, ...] = (),
    ) -> None:
        """``devices``: the CUDA devices the op's results live on (NCCL). The future `get_future`
        returns is then CUDA-aware, as the backend's own: a consumer on another stream waits for
        the collective instead of reading its output early (FSDP2 reads on a stream of its own)."""
        super().__init__()
        self._failures = failures
        self._devices = devices
        self._inner: dist.Work | None = inner
        self._op = op
        self._peer = peer
        self._generation = failures.generation

    def release(self) -> None:
        self._inner = None

    def _released_error(self) -> CommunicationError:
        return self._failures.record(
            self._op,
            "aborted (the group failed, was aborted or was reconfigured)",
            self._peer,
            self._generation,
        )

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        inner = self._inner
        if inner is None:
            raise self._released_error()
        try:
            # Not `wait_on`: its frame, kept by the recorded error's traceback, would hold ``inner``.
            return inner.wait(timeout) if timeout else inner.wait()
        except Exception as e:
            error = e
        # Drop the failed backend Work before recording the error: the error (and with it this
        # frame, through its traceback) is kept by the group, and the Work would keep the
        # backend's sockets open.
        inner = None
        self._inner = None
        raise self._failures.record(self._op, error, self._peer, self._generation) from error

    def is_completed(self) -> bool:
        inner = self._inner
        return True if inner is None else inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = (
            torch.futures.Future(devices=list(self._devices)) if self._devices else torch.futures.Future()
        )
        inner = self._inner
        if inner is None:
            out.set_exception(self._released_error())
            return out
        failures, op, peer, generation = self._failures, self._op, self._peer, self._generation

        def _done(fut: torch.futures.Future) -> None:
            try:
                value = fut.value()
            except Exception as e:
                # Runs on a backend thread: the group must not tear its backend down here.
                out.set_exception(failures.record(op, e, peer, generation, on_backend_thread=True))
            else:
                out.set_result(value)

        try:
            fut = inner.get_future()
        except RuntimeError as e:
            if "not implemented" not in str(e):
                raise
            # Some backend ops (Gloo's reduce_scatter) have no future: complete ours when the op
            # completes, waited for on a thread of its own (this is the rare path, not every op's).
            self._complete_after_wait(inner, out)
            return out
        fut.add_done_callback(_done)
        return out

    def _complete_after_wait(self, inner: dist.Work, out: torch.futures.Future) -> None:
        """Complete ``out`` with the op's result (None: the backend gives none without a future)
        once ``inner`` is done; a failure is recorded on the group as `wait` records it."""

        def finish() -> None:
            try:
                wait_on(inner)
            except Exception as e:
                out.set_exception(
                    self._failures.record(self._op, e, self._peer, self._generation, on_backend_thread=True)
                )
            else:
                out.set_result(None)

        if inner.is_completed():
            finish()
        else:
            threading.Thread(target=finish, name="ftlaunch-work-future", daemon=True).start()


class ComposedWork(dist.Work):
    """Several Works seen as one, plus an optional step to run once all finished (copy results)."""

    def __init__(
        self,
        works: Sequence[dist.Work],
        result: Any,
        after: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._works = list(works)
        self._result = result
        self._after = after
        self._after_lock = threading.Lock()
        self._after_done = False

    def _finish(self) -> None:
        with self._after_lock:
            if not self._after_done:
                self._after_done = True
                if self._after is not None:
                    self._after()

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        for work in self._works:
            wait_on(work, timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works) and self._after_done

    def get_future(self) -> torch.futures.Future:
        out: torch.futures.Future = torch.futures.Future()
        futures = [w.get_future() for w in self._works]

        def _done(_: torch.futures.Future) -> None:
            try:
                for fut in futures:
                    fut.value()
                self._finish()
            except Exception as e:
                out.set_exception(e)
            else:
                out.set_result(self._result)

        torch.futures.collect_all(futures).add_done_callback(_done)
        return out

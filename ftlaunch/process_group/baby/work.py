"""The `dist.Work` of one Baby request: completion, errors and the op deadline, in the parent.

Kept apart from `group.py` (what to send the child, when to replace it): a Work only waits on its
request's `Pending` and reports failures to the issuing group's `FailureRecord`.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.process_group.baby.handle import Child, Pending
from ftlaunch.process_group.failures import FailureRecord
from ftlaunch.process_group.work import NO_TIMEOUT

__all__ = ["BabyWork", "BabyWorkNCCL"]


class BabyWork(dist.Work):
    """Completion of one request to the child; `wait` enforces the op deadline in this process."""

    def __init__(
        self, failures: FailureRecord, child: Child, pending: Pending, result: Any, peer: int | None
    ) -> None:
        super().__init__()
        self._failures = failures
        self._child = child
        self._pending = pending
        self._result = result
        self._peer = peer
        self._generation = failures.generation

    def _raise_if_failed(self) -> None:
        error = self._pending.error
        if error is None:
            return
        kind, text = error
        if kind == "value":
            raise ValueError(text)
        if kind == "notimpl":
            raise NotImplementedError(text)
        raise self._failures.record(self._pending.op, text, self._peer, self._generation)

    def _after_success(self) -> None:
        """Hook for backends that must synchronise streams (NCCL)."""

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        pending = self._pending
        limit = pending.deadline - time.monotonic()
        if timeout:
            limit = min(limit, timeout.total_seconds())
        if not self._child.wait_for(pending, max(0.0, limit)):
            if time.monotonic() >= pending.deadline:
                self._child.check_deadlines()
                pending.event.wait(5.0)
            else:
                raise self._failures.record(
                    pending.op, f"not completed within wait(timeout={timeout})", self._peer, self._generation
                )
        self._raise_if_failed()
        self._after_success()
        return True

    def done_within(self, seconds: float) -> bool:
        """`PollableWork`: whether the request completed within ``seconds``, reading the reply on
        this thread; running out of time fails nothing (the op's own deadline still applies)."""
        return self._child.wait_for(self._pending, max(0.0, seconds))

    def is_completed(self) -> bool:
        return self._pending.event.is_set()

    def is_success(self) -> bool:
        return self._pending.event.is_set() and self._pending.error is None

    def _new_future(self) -> torch.futures.Future:
        return torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        fut = self._new_future()

        def _done() -> None:
            try:
                self._raise_if_failed()
                self._after_success()
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(self._result)

        self._pending.needs_reader = True
        self._child.wake_reader()
        self._pending.on_done(_done)
        return fut


class BabyWorkNCCL(BabyWork):
    """CUDA: completion means "enqueued on the child's stream"; wait() orders our stream after it."""

    def __init__(
        self, failures: FailureRecord, child: Child, pending: Pending, result: Any, peer: int | None
    ) -> None:
        super().__init__(failures, child, pending, result, peer)
        self._device = torch.cuda.current_device()  # the group's: the op was submitted on it

    def _new_future(self) -> torch.futures.Future:
        """A CUDA-aware future, as torch's own NCCL Work gives: completing it (after `_after_success`
        made the completing thread's stream wait for the child's work) records an event there, and
        ``wait()`` on it makes the waiter's current stream wait for that event. With a plain future,
        a result read on any other stream than the completing thread's raced the child's collective
        -- as FSDP2 reads its all-reduce hook's output, on its own stream (fault-tolerant HSDP)."""
        return torch.futures.Future(devices=[torch.device("cuda", self._device)])

    def _after_success(self) -> None:
        extra = self._pending.extra
        if extra is None:
            return
        device, handle = extra
        event = torch.cuda.Event.from_ipc_handle(device, handle)
        torch.cuda.current_stream(device).wait_event(event)

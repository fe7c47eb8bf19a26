"""One replica group's steps: how many it committed (`StepCount`) and the one in progress (`StepAttempt`).

Why two objects: the count survives every step and travels with a heal (torchft's ``state_dict``
of the Manager), while an attempt lives from ``start_quorum`` to ``should_commit`` and is dropped,
whatever happened to it. A fresh attempt per step means nothing of a failed step (its error, its
pending allreduces, a heal state it received) can leak into the next one.

Threads: the training thread creates and fills an attempt; the leader's heartbeat thread and the
lost-peer abort only read when its waits began (`blocked_since`, `allreduce_pending_for`), and any
thread may report an error (a collective's completion callback does).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ftlaunch.worker.plan import StepPlan

__all__ = ["StepAttempt", "StepCount"]


class StepCount:
    """What this replica group committed: its step and the batches its steps trained (torchft's
    Manager state), and the failed attempts since its last commit (``max_retries`` counts them;
    the quorum request reports them, so that a healer whose heal failed moves to another source)."""

    def __init__(self) -> None:
        self.step = 0
        self.batches_committed = 0
        self.commit_failures = 0

    def committed(self, num_participants: int) -> None:
        self.step += 1
        self.batches_committed += num_participants
        self.commit_failures = 0

    def failed(self) -> int:
        """Count a step that did not commit; returns the consecutive failures."""
        self.commit_failures += 1
        return self.commit_failures

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step = int(state_dict["step"])
        self.batches_committed = int(state_dict["batches_committed"])


class StepAttempt:
    """The step in progress: its plan once the quorum is known, the heal state it received, its
    allreduces, when its waits began, and its first failure (a failure anywhere means no commit)."""

    def __init__(self) -> None:
        #: This group's plan (`plan.plan_step`), set when the step's quorum is taken
        #: (`Manager.wait_quorum`); None until then, and for good when the quorum round failed.
        self.plan: StepPlan | None = None
        #: The healed state this rank received and has not loaded yet.
        self.received: dict[str, Any] | None = None
        #: The healed state was loaded before the forward pass (`Manager.start_quorum`).
        self.healed_at_start = False
        self._quorum_taken = False
        #: This step's allreduces (`Manager.allreduce`); the commit waits for them.
        self.pending: list[torch.futures.Future[torch.Tensor]] = []
        self._issued_at = 0.0  # when the first of them went out
        #: When the commit's waits began (None: not waiting).
        self.waiting_since: float | None = None
        self._error: Exception | None = None
        self._error_lock = threading.Lock()

    # ------------------------------------------------------------------ the quorum
    def take_quorum(self, plan: StepPlan, received: dict[str, Any] | None) -> None:
        """The quorum round's result, taken once (``wait_quorum`` is called by every step call)."""
        if not self._quorum_taken:
            self._quorum_taken = True
            self.plan, self.received = plan, received

    def take_received(self) -> dict[str, Any] | None:
        """The received heal state, handed over once (to be loaded)."""
        state, self.received = self.received, None
        return state

    # ------------------------------------------------------------------ failures
    def report_error(self, e: Exception) -> bool:
        """Record a failure; True when it is the step's first (the caller logs it)."""
        with self._error_lock:
            if self._error is not None:
                return False
            self._error = e
            return True

    @property
    def error(self) -> Exception | None:
        """The step's first failure, or None."""
        return self._error

    # ------------------------------------------------------------------ collectives in flight
    def issued(self, future: torch.futures.Future[torch.Tensor]) -> None:
        """An allreduce of this step went out."""
        if not self.pending:
            self._issued_at = time.monotonic()
        self.pending.append(future)

    def settled(self) -> None:
        """The commit waited for the allreduces (done, or given up on and aborted): none is pending."""
        self.pending = []

    def allreduce_pending_for(self, now: float) -> float:
        """Seconds an allreduce of this step has been pending (0 when none is)."""
        if any(not f.done() for f in list(self.pending)):
            return now - self._issued_at
        return 0.0

    def blocked_since(self, configuring_since: float | None) -> float | None:
        """When this step's earliest wait on its peers that is still going on began: the configure
        of its quorum (``configuring_since``, the quorum round's), its allreduces, the commit's
        waits. None when it waits on nobody."""
        starts = [t for t in (configuring_since, self.waiting_since) if t is not None]
        if any(not f.done() for f in list(self.pending)):
            starts.append(self._issued_at)
        return min(starts) if starts else None

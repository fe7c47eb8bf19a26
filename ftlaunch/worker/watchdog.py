"""Progress-based hang detection: a group whose training thread stopped making steps leaves.

The lighthouse judges liveness by heartbeats, which a daemon thread sends. When the *training*
thread hangs (stuck in an intra-group collective that has no timeout, a deadlocked data loader, a
hung device) the heartbeats keep coming: the group stays live, its peers give up their step after
the collective timeout, and then wait for it at every quorum until the join timeout, each round.
With two groups it is worse: the split-brain guard needs more than half of the live groups, so the
healthy one alone can never form a quorum while the hung one keeps beating.

`ProgressWatchdog` watches the Manager's step calls instead. If neither ``start_quorum`` nor
``should_commit`` was called for ``limit`` seconds while no quorum request was in flight (waiting
for the lighthouse is not a hang), it calls ``on_stall`` once: the Manager leaves the lighthouse, so
the others go on without the group at once. The next step call calls ``on_resume``: the Manager
beats again, its next quorum request re-admits the group, and it heals like any group that fell
behind. The clock starts at the first step (a long compile before it is not a hang).

``limit`` is ``FTLAUNCH_PROGRESS_TIMEOUT`` (a duration; ``0`` turns the watchdog off), by default
`PROGRESS_FACTOR` x the collective timeout: a group that makes no step call for that long has made
its peers' collectives time out already (they wait for it at most the collective timeout), and it
must leave before their next quorum request gives up (2x the collective timeout after that). A pause
between steps longer than ``limit`` (an evaluation, a checkpoint save) is treated the same way:
the group leaves and rejoins (a reconfigure, a heal if it fell behind), never a wrong step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ftlaunch import env

log = logging.getLogger(__name__)

#: Default limit = this many collective timeouts without a step call.
PROGRESS_FACTOR = 1.5


def progress_timeout(collective_timeout: float, value: float | None = None) -> float:
    """``value`` (``FTLAUNCH_PROGRESS_TIMEOUT``, read into `ftlaunch.env.WorkerEnv`; 0 = off), else
    `PROGRESS_FACTOR` x ``collective_timeout`` (seconds). `ConfigurationError` for a value out of
    `ftlaunch.env.PROGRESS_TIMEOUT`'s range."""
    if value is None:
        return PROGRESS_FACTOR * collective_timeout
    return env.PROGRESS_TIMEOUT.checked(value, "progress timeout")


class ProgressWatchdog:
    """Calls ``on_stall(seconds)`` once when no `touch` came for ``limit`` seconds (and ``waiting()``
    is False), then ``on_resume()`` at the next `touch`. Callbacks must not raise for long: errors
    are logged. A daemon thread; `close` stops it."""

    def __init__(
        self,
        limit: float,
        *,
        on_stall: Callable[[float], None],
        on_resume: Callable[[], None],
        waiting: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._on_stall, self._on_resume, self._waiting, self._clock = on_stall, on_resume, waiting, clock
        self._last: float | None = None  # armed at the first touch
        self._stalled = False
        self._lock = threading.Lock()
        # Held while a callback runs: a resume that races a stall waits for the stall's callback
        # (leave) to finish, so the group never ends up left with its heartbeat restarted first.
        self._callbacks = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if limit > 0:
            self._thread = threading.Thread(target=self._run, name="ftlaunch-progress-watchdog", daemon=True)
            self._thread.start()

    @property
    def stalled(self) -> bool:
        return self._stalled

    def touch(self) -> None:
        """The training thread made progress (a step call)."""
        with self._lock:
            self._last = self._clock()
            resumed, self._stalled = self._stalled, False
        if resumed:
            with self._callbacks:
                self._call(self._on_resume)

    def check(self) -> bool:
        """One look (the thread calls it; tests call it directly). True if it stalled just now."""
        with self._callbacks:
            with self._lock:
                if self._stalled or self._last is None or self.limit <= 0:
                    return False
                age = self._clock() - self._last
                if age <= self.limit or self._waiting():
                    return False
                self._stalled = True
            self._call(self._on_stall, age)
        return True

    def _run(self) -> None:
        poll = min(max(self.limit / 10, 0.05), 1.0)
        while not self._closed.wait(poll):
            self.check()

    @staticmethod
    def _call(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a watchdog must keep watching
            log.exception("progress watchdog: callback failed")

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)


def watch_progress(
    client: object | None,
    replica_id: str,
    limit: float,
    heartbeat_interval: float,
    waiting: Callable[[], bool],
    logger: logging.Logger | logging.LoggerAdapter[Any] = log,
) -> ProgressWatchdog | None:
    """The group leader's watchdog (None for other ranks, or when ``limit`` is 0): on a stall it
    leaves the lighthouse through ``client`` (a `QuorumClient`), so that the other groups go on; at
    the next step call it beats again, and its next quorum request re-admits it. ``waiting()`` is
    True while a quorum request is in flight (waiting for the lighthouse is not a hang)."""
    leave = getattr(client, "leave", None)
    start_heartbeat = getattr(client, "start_heartbeat", None)
    if client is None or leave is None or start_heartbeat is None or limit <= 0:
        return None

    def stalled(age: float) -> None:
        logger.warning(
            "no step progress for %.0fs (progress timeout %gs, %s): leaving the lighthouse so that the "
            "other groups go on; this group rejoins and heals when it steps again",
            age, limit, env.FTLAUNCH_PROGRESS_TIMEOUT,
        )  # fmt: skip
        leave(replica_id)

    def resumed() -> None:
        logger.warning("stepping again: rejoining the lighthouse")
        start_heartbeat(replica_id, heartbeat_interval)

    return ProgressWatchdog(limit, on_stall=stalled, on_resume=resumed, waiting=waiting)

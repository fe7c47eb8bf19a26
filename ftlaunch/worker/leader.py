"""What a replica group's leader (rank 0) keeps up with the lighthouse besides its quorum requests.

Only the leader talks to the lighthouse; the other ranks learn its answers through the group store.
Beside the quorum request (`quorum_request`), the leader's link is: the heartbeats (started with
its first request: a live group that has not asked holds up its peers' quorums), the training
progress it reports on them (`progress`: the launcher's summary and ``/metrics`` read it there,
whatever the script prints), the progress watchdog (`watchdog`: a hung training thread leaves), the
lost-peer abort (`hang_abort`: the heartbeat answers say when a participant of the quorum in use is
gone) and, at the end, the leave. The Manager holds one `LeaderLink`; on other ranks every part is
absent and every call a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ftlaunch.errors import LighthouseError
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.worker.hang_abort import LostPeerAbort
from ftlaunch.worker.progress import ProgressTracker
from ftlaunch.worker.watchdog import ProgressWatchdog, watch_progress

log = logging.getLogger(__name__)


class LeaderLink:
    """Heartbeats, progress reports, the progress watchdog and the lost-peer abort of one group's
    leader (``client`` None on other ranks: then nothing)."""

    def __init__(
        self,
        client: QuorumClient | None,
        replica_id: str,
        *,
        heartbeat_interval: float,
        progress_limit: float,
        in_flight: Callable[[], bool],
        hang_abort: LostPeerAbort,
        blocked: Callable[[], tuple[int, float] | None] | None = None,
        logger: logging.Logger | logging.LoggerAdapter[Any] = log,
    ) -> None:
        """``blocked``: (quorum id, seconds) while the step waits in a collective of the quorum in
        use; the heartbeats report it, so that the lighthouse declares a hung peer lost on evidence
        (lighthouse/hung.py)."""
        self.client = client
        self.replica_id = replica_id
        self._interval = heartbeat_interval
        self._log = logger
        self._beating = False
        self.progress: ProgressTracker | None = None
        set_progress = getattr(client, "set_progress", None)
        if set_progress is not None:
            self.progress = ProgressTracker(lambda report: set_progress(replica_id, report))
        self.watchdog: ProgressWatchdog | None = watch_progress(
            client, replica_id, progress_limit, heartbeat_interval, in_flight, logger
        )
        on_lost = getattr(client, "on_quorum_lost", None)
        if on_lost is not None:
            on_lost(lambda _rid, quorum_id, lost: hang_abort.lost(quorum_id, lost))
        report_blocked = getattr(client, "report_blocked", None)
        if report_blocked is not None and blocked is not None:
            report_blocked(blocked)

    def touch(self) -> None:
        """The training thread made a step call (the watchdog's clock)."""
        if self.watchdog is not None:
            self.watchdog.touch()

    def start_heartbeat(self) -> None:
        """Start beating (once; the first quorum request, when every rank is ready)."""
        if self.client is not None and not self._beating:
            self._beating = True
            self.client.start_heartbeat(self.replica_id, self._interval)

    def close(self, step: int, snapshot: Callable[[], Any] | None, *, leave: bool) -> None:
        """Stop the watchdog, send the final progress report (with the state's ``snapshot`` only
        after a clean exit) on the leave -- or, with ``leave=False`` (training failed), only close
        the connections, so that the lighthouse counts a failure, as for a crash."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.progress is not None:
            self.progress.finish(step, snapshot)
        if self.client is not None:
            if leave:
                try:
                    self.client.leave(self.replica_id)  # also stops the heartbeat
                except LighthouseError as e:
                    self._log.debug("leave failed (lighthouse gone?): %s", e)
            self.client.close()

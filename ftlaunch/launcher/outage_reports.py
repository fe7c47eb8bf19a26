"""Failures the supervisor could not tell a dead lighthouse, told to its successor.

Why: the supervisor tells the lighthouse at once when a group's worker or agent dies, so the others'
next quorum goes on without it. While the hosted lighthouse is down (crashed, restarting) that report
fails. The restarted lighthouse then learns the job from the groups' resume reports, which still
name the dead group as a member of the last quorum -- and waits up to a heartbeat timeout (5 s) for
it, which the survivors wait too, unless its replacement comes back sooner. In the soak's 12 s
outage an agent killed during the outage held the resumed quorum 3.2 s that way.

So a report that failed is kept (`failed`), and once the restarted lighthouse knows the group again
(a resume report named it: `due` is given the ids it knows) it is sent again -- but only while no
process of the group is running: a replacement that started may already be talking to the new
lighthouse, and reporting it failed would throw a live group out of the quorum. A group that is
back (committed again) or ended well needs no report either; one that failed for good does. Pure bookkeeping
(no clock, no lighthouse): the supervisor sends what `due` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ftlaunch.launcher.group import STOPPED, SUCCEEDED, Group
from ftlaunch.launcher.lighthouse_host import HostedLighthouse, JobLighthouse

#: Seconds after which an unsent report is dropped: the restarted lighthouse has stopped waiting for
#: the group by then (its heartbeat timeout), or the group is back.
KEEP_S = 30.0
#: Seconds between two looks at the restarted lighthouse's groups while reports wait.
LOOK_S = 0.1


class UnreportedFailures:
    """Failure reports that could not reach the lighthouse, by group id (thread-safe: the reporter
    thread records, the supervisor's main thread drains)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[str, float]] = {}
        self._looked_at = 0.0

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def failed(self, gid: int, reason: str, now: float) -> None:
        """The report of group ``gid``'s failure did not reach the lighthouse."""
        with self._lock:
            self._pending[gid] = (reason, now)

    def due(self, groups: Sequence[Group], known: Iterable[str], now: float) -> list[tuple[Group, str]]:
        """The reports to send now: their group is known to the lighthouse (``known``: the replica ids
        it lists) and none of its processes runs; forgets those, and those no longer needed."""
        known_ids = set(known)
        out: list[tuple[Group, str]] = []
        with self._lock:
            for gid, (reason, since) in list(self._pending.items()):
                group = groups[gid]
                ended = group.state in (SUCCEEDED, STOPPED)  # a group that failed for good is reported
                if ended or group.failure_at is None or group.worker_pids or now - since > KEEP_S:
                    del self._pending[gid]  # ended, back, running again (maybe talking to it), or too old
                elif group.replica_id in known_ids:
                    del self._pending[gid]
                    out.append((group, reason))
        return out

    def resend(
        self, lighthouse: JobLighthouse | None, groups: Sequence[Group], now: float
    ) -> list[tuple[Group, str]]:
        """`due` against a hosted lighthouse that serves again (every `LOOK_S`; nothing otherwise)."""
        if not len(self) or not isinstance(lighthouse, HostedLighthouse) or not lighthouse.serving:
            return []
        if now - self._looked_at < LOOK_S:
            return []
        self._looked_at = now
        try:
            known = [g.replica_id for g in lighthouse.snapshot().groups]
        except Exception:  # noqa: BLE001 - look again at the next interval
            return []
        return self.due(groups, known, now)

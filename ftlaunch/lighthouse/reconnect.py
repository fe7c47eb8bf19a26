"""Riding out a lighthouse outage: the group leader waits for the lighthouse to come back.

The lighthouse is a single process (docs/lighthouse.md, *When the lighthouse dies*). When it dies,
`LighthouseClient` retries each request for ``connect_timeout`` (10 s at most) and then raises
`LighthouseUnavailableError`; without this module every worker of the job would raise it into its
training loop at the same moment, and the job would be lost to a lighthouse restart that takes 15 s.

`OutageTolerantClient` wraps the leader's quorum client and keeps asking, with backoff, for up to
``outage_timeout`` seconds from the first failure (default `DEFAULT_OUTAGE_TIMEOUT`, env
``FTLAUNCH_LIGHTHOUSE_OUTAGE``). Only once the lighthouse answered this group: one that was never
reached (a wrong address, one not started yet) still fails after the connect timeout, so a
misconfiguration is reported at once; except in a worker that torchelastic restarted
(``known_reachable``: the job reached its lighthouse before), which waits from the start, so a group
restarted during an outage joins the others when the lighthouse is back. Nothing is committed meanwhile: a
step needs its quorum before its collectives, so a group waits at the start of the step (a step whose quorum
had already formed finishes and commits normally; its collectives do not involve the lighthouse).

A lighthouse that comes back knows nothing. So the first quorum request after the leader noticed
the lighthouse unreachable (a failed quorum call or any failed connection, heartbeats included)
carries a *resume report*: the id and members of the last quorum this group was part of (member
``data`` key `RESUME_KEY`). The restarted lighthouse adopts the newest report as its previous
quorum: it waits (at most its heartbeat timeout) for the reported members it has not heard of yet
and forms at once when they all asked, instead of forming a quorum of whoever reconnected first;
its new quorum ids are above every reported one (lighthouse/resume.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ftlaunch import env
from ftlaunch.errors import LighthouseUnavailableError
from ftlaunch.lighthouse.client import LighthouseClient, QuorumClient
from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.lighthouse.protocol import RESUME_KEY
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember

log = logging.getLogger(__name__)

#: How long a group leader waits for an unreachable lighthouse before giving up (seconds; the
#: environment's ``FTLAUNCH_LIGHTHOUSE_OUTAGE`` is read into `ftlaunch.env.WorkerEnv`).
DEFAULT_OUTAGE_TIMEOUT = env.DEFAULT_LIGHTHOUSE_OUTAGE


def never_reached(address: str) -> str:
    """The fix named when the lighthouse never answered this group: a wrong address, or none started."""
    bind = address.removeprefix("http://") if address.startswith("http://") else "HOST:PORT"
    return (
        f"No lighthouse has answered there: start one (`ftlaunch-lighthouse --bind {bind}`) or fix "
        f"{env.FTLAUNCH_LIGHTHOUSE}, or launch with `ftlaunch --replicas N script.py`, which starts one"
    )


#: Pause between two attempts while the lighthouse is down (each attempt itself retries connects
#: for the client's ``connect_timeout``).
_PAUSE_START = 0.1
_PAUSE_MAX = 2.0


def resume_report(quorum: Quorum) -> dict:
    """What a group tells a lighthouse that may have restarted: its last quorum's id and members."""
    return {"quorum_id": quorum.quorum_id, "members": list(quorum.replica_ids)}


class OutageTolerantClient:
    """A `QuorumClient` whose ``quorum`` waits out a lighthouse outage (see the module docstring).

    Everything else is the wrapped client's. ``close`` also ends a wait in progress, which then
    raises `LighthouseUnavailableError`.
    """

    def __init__(
        self,
        client: QuorumClient,
        outage_timeout: float = DEFAULT_OUTAGE_TIMEOUT,
        *,
        known_reachable: bool = False,
    ) -> None:
        self._client = client
        #: The job reached this lighthouse before (e.g. this worker is a restart): wait from the start.
        self._known_reachable = known_reachable
        self.outage_timeout = env.LIGHTHOUSE_OUTAGE.checked(outage_timeout, "lighthouse outage timeout")
        self._closed = threading.Event()
        self._last: Quorum | None = None  # the last quorum this group got
        self._report_due = False  # the lighthouse was unreachable since then
        self._failures_seen = self._connection_failures()
        report_resume = getattr(client, "report_resume", None)
        if report_resume is not None:  # the heartbeats carry the report too (LighthouseClient.report_resume)
            report_resume(self._resume_for_heartbeat)

    @property
    def inner(self) -> QuorumClient:
        return self._client

    def _reached(self) -> bool:
        """Whether the lighthouse ever answered this group (a quorum, or any request of the real client)."""
        if self._known_reachable or self._last is not None:
            return True
        return isinstance(self._client, LighthouseClient) and self._client.answered

    def _connection_failures(self) -> int:
        # The real client counts failed connections (heartbeats included); a fake may count its own.
        failures = getattr(self._client, "connection_failures", 0)
        return failures if isinstance(failures, int) else 0

    @property
    def lost_since_last_quorum(self) -> bool:
        """Whether the lighthouse was unreachable (a refused or failed request, a failed connection
        of any of the client's channels, heartbeats included) since this group's last quorum: a
        lighthouse that answers now may have restarted since (worker/outage.py)."""
        return self._last is not None and (
            self._report_due or self._connection_failures() != self._failures_seen
        )

    def _resume_for_heartbeat(self) -> dict | None:
        """The resume report while the lighthouse may have restarted since this group's last quorum."""
        last = self._last
        return resume_report(last) if last is not None and self.lost_since_last_quorum else None

    def quorum(self, member: QuorumMember, timeout: float, *, give_up_after: float | None = None) -> Quorum:
        """The quorum for ``member``, waiting out an outage (see the module docstring).

        ``give_up_after``: the caller has something better to do than wait (a group stepping on its
        last quorum, worker/outage.py): connection failures are retried for that long only, then
        `LighthouseUnavailableError` is raised (the resume report still goes with the next request)."""
        started: float | None = None  # first failure of this outage
        pause = _PAUSE_START
        while True:
            failures = self._connection_failures()
            if failures != self._failures_seen:
                self._report_due = True
            request = member
            if self._report_due and self._last is not None:
                request = dataclasses.replace(
                    member, data={**member.data, RESUME_KEY: resume_report(self._last)}
                )
            try:
                if give_up_after is not None and isinstance(self._client, LighthouseClient):
                    quorum = self._client.quorum(request, timeout, unreachable_after=give_up_after)
                else:
                    quorum = self._client.quorum(request, timeout)
            except LighthouseUnavailableError as e:
                self._report_due = True
                if give_up_after is not None and self._reached():
                    raise  # the wrapped client retried for give_up_after already
                now = time.monotonic()
                if started is None:
                    started = now
                    if self.outage_timeout > 0 and self._reached():
                        log.warning(
                            "lighthouse client: %s; %s waits up to %gs for the lighthouse to come back "
                            "(nothing is committed meanwhile)", e, member.replica_id, self.outage_timeout,
                        )  # fmt: skip
                waited = now - started
                if not self._reached() or self._closed.is_set() or waited >= self.outage_timeout:
                    if self._reached() and self.outage_timeout > 0 and not self._closed.is_set():
                        raise LighthouseUnavailableError(
                            f"lighthouse unreachable for {waited:.0f}s (outage timeout "
                            f"{self.outage_timeout:g}s, "
                            f"{env.FTLAUNCH_LIGHTHOUSE_OUTAGE}): {e}"
                        ) from None
                    if not self._reached() and not self._closed.is_set():
                        address = str(getattr(self._client, "address", ""))
                        raise LighthouseUnavailableError(f"{e}. {never_reached(address)}") from None
                    raise
                self._closed.wait(min(pause, self.outage_timeout - waited))
                pause = min(pause * 2, _PAUSE_MAX)
                continue
            if started is not None:
                log.info(
                    "lighthouse client: lighthouse reachable again after %.1fs; %s got quorum %d",
                    time.monotonic() - started, member.replica_id, quorum.quorum_id,
                )  # fmt: skip
            self._last = quorum
            self._report_due = False
            self._failures_seen = failures
            return quorum

    def start_heartbeat(self, replica_id: str, interval: float) -> object:
        return self._client.start_heartbeat(replica_id, interval)

    def leave(self, replica_id: str) -> None:
        self._client.leave(replica_id)

    def set_progress(self, replica_id: str, report: ProgressReport) -> None:
        """The group leader's progress report (it rides on the wrapped client's next request)."""
        forward = getattr(self._client, "set_progress", None)
        if forward is not None:
            forward(replica_id, report)

    def on_quorum_lost(self, callback: Callable[[str, int, tuple[str, ...]], None] | None) -> None:
        """Forwarded to the wrapped client (`LighthouseClient.on_quorum_lost`)."""
        forward = getattr(self._client, "on_quorum_lost", None)
        if forward is not None:
            forward(callback)

    def report_blocked(self, probe: Callable[[], tuple[int, float] | None] | None) -> None:
        """Forwarded to the wrapped client (`LighthouseClient.report_blocked`)."""
        forward = getattr(self._client, "report_blocked", None)
        if forward is not None:
            forward(probe)

    def close(self) -> None:
        self._closed.set()
        self._client.close()

"""The supervisor's side of the job's lighthouse: open it, restart a hosted one that stopped serving
(and crash it for ``--chaos lighthouse=``), tell it of failures off the main thread, keeping those a
down lighthouse missed to tell its successor (docs/lighthouse.md, *When the lighthouse dies*).

Why apart: the supervisor (`ftlaunch.launcher.supervisor`) is the agents' lifecycle loop; what it
does with the lighthouse -- which may live in this process (`HostedLighthouse`) or elsewhere
(``--lighthouse``) and may die and come back -- reads on its own. Everything but the failure
reports runs on the supervisor's main thread; the reports go through one worker thread so that a
slow or dead lighthouse never holds up the loop.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from ftlaunch import env
from ftlaunch.launcher.group import Group
from ftlaunch.launcher.lighthouse_host import (
    HostedLighthouse,
    JobLighthouse,
    LighthouseSettings,
    open_job_lighthouse,
)
from ftlaunch.launcher.options import LaunchOptions
from ftlaunch.launcher.outage_reports import UnreportedFailures
from ftlaunch.launcher.output import Console
from ftlaunch.launcher.spares import holder_name
from ftlaunch.lighthouse.status import LighthouseStatus

logger = logging.getLogger(__name__)


class LighthouseKeeper:
    """The job's lighthouse as the supervisor keeps it (see the module docstring)."""

    def __init__(self, opts: LaunchOptions, token: str, console: Console) -> None:
        self._opts = opts
        self._token = token
        self._console = console
        self.lighthouse: JobLighthouse | None = None
        self._reporter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftlaunch-report")
        self._back_at = 0.0  # a crashed hosted lighthouse is restarted from then on
        self._unreported = UnreportedFailures()

    def open(self) -> JobLighthouse:
        """Host the lighthouse, or connect to ``--lighthouse``. Raises `LaunchError`."""
        opts = self._opts
        settings = LighthouseSettings(
            bind=opts.lighthouse_bind,
            min_replicas=opts.min_replicas,
            expected_replicas=opts.replicas,
            join_timeout=opts.join_timeout,
            heartbeat_timeout=opts.heartbeat_timeout,
            token=self._token,
            stragglers=opts.stragglers or env.stragglers() or "report",
        )
        self.lighthouse = open_job_lighthouse(opts.lighthouse, settings)
        return self.lighthouse

    def watch(self, now: float) -> bool:
        """Restart a hosted lighthouse that stopped serving, on the same address. The groups wait
        for it (FTLAUNCH_LIGHTHOUSE_OUTAGE) and resume with one quorum of all of them. Returns
        whether it was restarted now."""
        lighthouse = self.lighthouse
        if not isinstance(lighthouse, HostedLighthouse) or not lighthouse.needs_restart:
            return False
        if now < self._back_at:
            return False
        try:
            lighthouse.restart()
        except (OSError, ValueError) as e:  # ConfigurationError: the port is taken; try again later
            self._console.err(
                f"[ftlaunch] cannot restart the lighthouse on {lighthouse.address}: {e}; retrying"
            )
            self._back_at = now + 1.0
            return False
        self._console.err(
            f"[ftlaunch] lighthouse {lighthouse.address} stopped serving; restarted on the same address "
            f"(restart {lighthouse.restarts})"
        )
        return True

    def crash(self, down_for: float) -> bool:
        """``--chaos lighthouse=``: crash the hosted lighthouse; `watch` restarts it ``down_for``
        seconds later. False when the lighthouse is not hosted here."""
        lighthouse = self.lighthouse
        if not isinstance(lighthouse, HostedLighthouse):
            return False
        lighthouse.crash()
        self._back_at = time.monotonic() + down_for
        return True

    def report_failure(self, group: Group, reason: str) -> None:
        """Tell the lighthouse off the main thread; it notices a lost connection anyway. A hosted
        lighthouse that is down gets it again once restarted (`outage_reports`; not with spares,
        whose slot names change hands)."""
        lighthouse, rid, spares = self.lighthouse, group.replica_id, self._opts.spares > 0

        def report() -> None:
            try:
                if lighthouse is not None:
                    name = holder_name(lighthouse, group.gid) if spares else rid
                    if name is not None:  # with spares: None while the group waits as a spare
                        lighthouse.report_failure(name, reason)
            except Exception as e:  # noqa: BLE001 - the lighthouse still notices the lost connection
                logger.debug("report_failure(%s) failed: %s", rid, e)
                if isinstance(lighthouse, HostedLighthouse) and not lighthouse.serving and not spares:
                    self._unreported.failed(group.gid, reason, time.monotonic())

        self._reporter.submit(report)

    def resend_missed(self, groups: list[Group], now: float) -> None:
        """Report again the failures a down hosted lighthouse missed, once its successor may use them."""
        for group, reason in self._unreported.resend(self.lighthouse, groups, now):
            self.report_failure(group, f"{reason} (while the lighthouse was down)")

    def final_status(self) -> LighthouseStatus | None:
        """The lighthouse's status for the summary, or None when it cannot be read."""
        try:
            return self.lighthouse.snapshot() if self.lighthouse is not None else None
        except Exception:  # noqa: BLE001 - the summary does without the lighthouse's figures
            return None

    def close(self) -> None:
        """Close the lighthouse (a hosted one stops serving), then wait for the reports under way."""
        if self.lighthouse is not None:
            self.lighthouse.close()
        self._reporter.shutdown(wait=True)

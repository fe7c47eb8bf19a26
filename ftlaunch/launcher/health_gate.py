"""The health check a group's agent runs before its workers start or restart (``--health-check``,
docs/launcher.md, *Health checks*).

Why at the rendezvous: torchelastic's agent rendezvouses before every start and restart of its
workers -- under ``ftlaunch`` and under ``torchrun --rdzv-backend ftlaunch`` alike -- so the
handler (launcher/rendezvous.py) runs `HealthGate.wait_until_healthy` there, once per round and
on every node of the group. A failing check keeps the group out: it does not rendezvous, so it
never asks the lighthouse for a quorum and the other groups train on without it. Each run is
reported to the lighthouse (lighthouse/health.py: ``/status``, ``/metrics``, the launcher's
summary) and retried with a growing pause (`retry_delay`) until it passes. A hanging check is
bounded: after its timeout its whole process group is killed and the run counts as failed.

The check is a shell command (exit 0: healthy; its output's last line is its reason), run in its
own session with the group's environment (``REPLICA_GROUP_ID``, ``FTLAUNCH_LIGHTHOUSE``,
``CUDA_VISIBLE_DEVICES``...). ``python -m ftlaunch.health`` is the built-in one, and takes Python
hooks (``--hook MODULE:FUNCTION``).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftlaunch.errors import TrainingFinishedError
from ftlaunch.lifetime import die_with_parent
from ftlaunch.lighthouse.health import HealthReport

logger = logging.getLogger(__name__)

#: The first pause after a failed check, and the longest (seconds): a node that heals in seconds
#: (a GPU reset, a mount) is back soon, a dead one costs a run a minute.
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 60.0
#: Output kept of a run (its tail: the last line is what counts).
_TAIL_BYTES = 64 * 1024


def retry_delay(failures: int, first: float = FIRST_RETRY_S, cap: float = MAX_RETRY_S) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (1, 2, ...): doubling from
    ``first``, at most ``cap``."""
    if failures < 1:
        return 0.0
    return min(cap, first * 2.0 ** min(failures - 1, 62))


@dataclass(frozen=True)
class CheckRun:
    """One run of the check."""

    ok: bool
    #: Its exit code (None: killed at the timeout).
    code: int | None
    #: The last non-empty line it printed, or what ended it.
    last_line: str
    seconds: float
    pid: int


def last_line(output: bytes) -> str:
    """The last non-blank line of ``output`` (decoded leniently, stripped)."""
    for line in reversed(output.decode(errors="replace").splitlines()):
        if line.strip():
            return line.strip()
    return ""


def run_check(command: str, timeout: float) -> CheckRun:
    """Run ``command`` through the shell, in its own session, stdout and stderr together into a
    file (a pipe would block a chatty check); past ``timeout`` its process group is killed."""
    started = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills all of it
            # Dies with the agent, also one killed outright (a shell running a single command execs it).
            preexec_fn=functools.partial(die_with_parent, signal.SIGKILL, os.getpid()),
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        # Whatever it left behind (a child of the shell) goes with it, also after a clean exit.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if code is None:
            proc.wait()
        out.seek(max(0, out.seek(0, os.SEEK_END) - _TAIL_BYTES))
        line = last_line(out.read())
    seconds = time.monotonic() - started
    if code is None:
        tail = f" (its last line: {line})" if line else ""
        return CheckRun(False, None, f"timed out after {timeout:g}s and was killed{tail}", seconds, proc.pid)
    if code != 0 and not line:
        line = f"exited with code {code}" if code > 0 else f"killed by {_signal_name(-code)}"
    return CheckRun(code == 0, code, line, seconds, proc.pid)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


#: Reports a run to the lighthouse (replica id, report); may raise: the gate logs and goes on.
Reporter = Callable[[str, HealthReport], None]


class HealthGate:
    """Runs the check until it passes: `wait_until_healthy`. One per rendezvous handler."""

    def __init__(
        self,
        command: str,
        timeout: float,
        replica_id: str,
        report: Reporter | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        finished: Callable[[], bool] | None = None,
        first_retry: float = FIRST_RETRY_S,
        max_retry: float = MAX_RETRY_S,
    ) -> None:
        self.command = command
        self.timeout = timeout
        self.replica_id = replica_id
        self._report = report
        self._sleep = sleep
        #: Asked after each failure: whether the job's training finished meanwhile (then the gate
        #: gives up: a group that joined now would train alone; may raise, read as "not yet").
        self._finished = finished
        self._first, self._cap = first_retry, max_retry
        #: Runs that failed, in all (this agent's).
        self.failures = 0

    def wait_until_healthy(self) -> int:
        """Run the check until it passes; returns the failed runs it took (0: passed at once).
        Raises `TrainingFinishedError` when the training finished while the check kept failing."""
        streak = 0
        while True:
            run = run_check(self.command, self.timeout)
            if run.ok:
                if streak:
                    logger.warning(
                        "[ftlaunch] %s: health check passed after %d failure(s); the group joins",
                        self.replica_id,
                        streak,
                    )
                self._tell(HealthReport(self.command, True, run.last_line))
                return streak
            streak += 1
            self.failures += 1
            pause = retry_delay(streak, self._first, self._cap)
            logger.warning(
                "[ftlaunch] %s: health check failed (%s): %s; the group stays out, the job trains on; "
                "next try in %gs",
                self.replica_id,
                "timeout" if run.code is None else f"exit {run.code}",
                run.last_line,
                pause,
            )
            self._tell(HealthReport(self.command, False, run.last_line, pause))
            if self._job_finished():
                raise TrainingFinishedError(
                    f"{self.replica_id}: the training finished while its health check kept it out "
                    f"({streak} failure(s) in a row; last: {run.last_line})"
                )
            self._sleep(pause)

    def _job_finished(self) -> bool:
        if self._finished is None:
            return False
        try:
            return self._finished()
        except Exception:  # noqa: BLE001 - an unreadable lighthouse is no verdict: try again later
            return False

    def _tell(self, report: HealthReport) -> None:
        if self._report is None:
            return
        try:
            self._report(self.replica_id, report)
        except Exception as e:  # noqa: BLE001 - informational: the check decides, not the report
            logger.info(
                "[ftlaunch] %s: could not report the health check to the lighthouse: %s", self.replica_id, e
            )

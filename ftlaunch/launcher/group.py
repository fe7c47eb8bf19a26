"""What the supervisor knows about one replica group, and how each piece of news changes it.

The supervisor's main thread hands a `Group` every piece of news about it -- an agent started, the
agent's events (workers started, a worker exited), the agent's exit, rank 0's step lines -- and the
status line and the summary read the counts back. A `Group` starts no process and reads no clock
(times are arguments), so the accounting is unit-tested in one process.

**One failure is one count.** A failure ends one *attempt* of the group, ``(incarnation, generation)``:
which agent (the supervisor respawns a dead one) and which of torchelastic's restarts inside it.
Several reports can arrive for one attempt -- the dying worker's exit, its siblings' exits (torchelastic
stops them), the next generation's workers appearing (when torchelastic reaped the dead worker before
the agent read its status), the agent's own exit when it dies while its group is down -- and
`failures` is the number of distinct failed attempts, so every report after the first is the same
failure.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from ftlaunch import env
from ftlaunch.lighthouse.progress import GroupProgress

STARTING = "starting"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
STOPPED = "stopped"
TERMINAL = (SUCCEEDED, FAILED, STOPPED)

#: ``(incarnation, generation)``: one agent's one start of the group's workers.
Attempt = tuple[int, int]


@dataclass(frozen=True)
class AgentExit:
    """What the supervisor does after a group's agent process exited."""

    #: Start a new agent for the group.
    respawn: bool = False
    #: The agent died with workers possibly left behind: kill the group's orphans first.
    kill_orphans: bool = False
    #: Tell the lighthouse the group failed, with this reason.
    report: str | None = None
    #: A line for the console.
    message: str | None = None


@dataclass
class Group:
    """The supervisor's view of one replica group (everything else is derived from these)."""

    gid: int
    state: str = STARTING
    #: Agents started for this group so far (1 = the first one).
    incarnation: int = 0
    #: torchelastic's restart count (``TORCHELASTIC_RESTART_COUNT``) of the current agent's workers.
    generation: int = 0
    #: Rank -> pid of the current workers.
    worker_pids: dict[int, int] = field(default_factory=dict)
    #: torchelastic restarts plus agent respawns.
    restarts: int = 0
    failed_attempts: set[Attempt] = field(default_factory=set)
    committed: int = 0
    last_step: int | None = None
    #: Committed a step since its current workers started.
    stepped: bool = False
    #: Since when the group has been down (failed or hung) without committing again.
    failure_at: float | None = None
    #: Failure -> next committed step, per recovery.
    rejoin_times: list[float] = field(default_factory=list)
    #: The state checksum its leader reported at a clean exit, and the step it was taken at.
    checksum: str | None = None
    checksum_step: int | None = None
    #: The process (session) its leader reports from, per the lighthouse, and the one that was
    #: running when the current failure began (None for a hang: the same process carries on).
    session: str = ""
    down_session: str | None = None
    #: Processes of the group that trained from behind the job without healing (lighthouse).
    unsynced_sessions: int = 0
    root_cause: str | None = None
    #: A worker of it ended on a configuration error (`misconfigured`): the job stops.
    misconfigured: bool = False
    #: One of its workers exited 0: the training is ending.
    finishing: bool = False
    #: The lighthouse refused its current process a quorum: the training had finished at a step it
    #: was behind, nobody left to heal from (its workers then exit 0, as stragglers of the job).
    stopped_after_end: bool = False
    #: Its workers are SIGSTOPped (chaos).
    paused: bool = False
    #: Durable checkpoints its leader reported (`GroupProgress`): the newest it published (step,
    #: the writer's wall clock, seconds the write took), its current process's saves, skipped and
    #: failed saves, and the step the group resumed from (None: none).
    durable_step: int | None = None
    durable_time: float | None = None
    durable_seconds: float = 0.0
    durable_saves: int = 0
    durable_skipped: int = 0
    durable_failed: int = 0
    resumed_from: int | None = None
    #: Every step one of its processes resumed from a durable checkpoint (the job's start, and each
    #: time every group was lost while the job ran): tells a rewind to a checkpoint from a loss.
    resumed_steps: set[int] = field(default_factory=set)

    # --- derived ---------------------------------------------------------------------------------

    @property
    def replica_id(self) -> str:
        return env.replica_id(self.gid)

    @property
    def attempt(self) -> Attempt:
        return (self.incarnation, self.generation)

    @property
    def failures(self) -> int:
        return len(self.failed_attempts)

    @property
    def agent_respawns(self) -> int:
        return max(0, self.incarnation - 1)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def healthy(self) -> bool:
        """Running with workers up and not recovering from a failure or a hang."""
        return self.state == RUNNING and self.failure_at is None and not self.paused

    @property
    def recovering(self) -> bool:
        """Down and not back yet: a committed line now is in-flight output of the dead (or stopped)
        workers, not a rejoin."""
        return self.paused or self.state == STARTING or self.attempt in self.failed_attempts

    # --- news ------------------------------------------------------------------------------------

    def agent_started(self) -> None:
        """A new agent runs the group (the first one, or a respawn): a new attempt, no workers yet."""
        if self.incarnation > 0:
            self.restarts += 1
        self.incarnation += 1
        self.state = STARTING
        self.generation = 0
        self.worker_pids = {}
        self.stepped = False
        self.paused = False

    def workers_started(self, restart: int, pids: dict[int, int], now: float) -> str | None:
        """The agent saw workers of torchelastic restart ``restart``.

        Returns a failure to report when this is the first news of one: a new generation means the
        previous one failed, even if its exit status was reaped before the agent could read it.
        """
        failure = None
        if restart > self.generation:
            failure = self._fail(self.attempt, now, f"workers of restart {self.generation} failed")
            self.restarts += restart - self.generation
            self.generation = restart
            self.worker_pids = dict(pids)
            self.stepped = False
        else:
            self.worker_pids.update(pids)
        if self.state == STARTING:
            self.state = RUNNING
        return failure

    def worker_exited(
        self, pid: int, rank: Any, restart: int, failed: bool | None, how: str, now: float
    ) -> str | None:
        """A worker of restart ``restart`` exited (``failed`` None: its status is unknown).

        Returns the failure to report when it is the first news of its attempt's failure.
        """
        self.worker_pids = {r: p for r, p in self.worker_pids.items() if p != pid}
        if failed is False:
            self.finishing = True  # a worker completed: the training is ending
        if not failed:
            return None
        return self._fail((self.incarnation, restart), now, f"rank {rank} (pid {pid}) {how}")

    def worker_misconfigured(self, pid: int, rank: Any, restart: int, message: str, now: float) -> str:
        """A worker ended on a configuration error (its torchelastic error file says so): the group
        failed for good -- its agent would restart it into the same error -- and so does the job
        (`configuration_stop`). Returns the root cause."""
        self.worker_pids = {r: p for r, p in self.worker_pids.items() if p != pid}
        self._fail((self.incarnation, restart), now, "configuration error")
        self.state = FAILED
        self.misconfigured = True
        self.root_cause = f"replica group {self.gid} rank {rank} (pid {pid}): configuration error: {message}"
        return self.root_cause

    def agent_exited(
        self, code: int, result: dict[str, Any], max_agent_restarts: int, now: float
    ) -> AgentExit:
        """The agent process exited with ``code``, leaving ``result`` (its result file, or {})."""
        status = result.get("status")
        if code == 0 and status == "succeeded":
            if self.stopped_after_end:  # not a result of the job: ended like a straggler the launcher stops
                self.state = STOPPED
                return AgentExit(
                    message=(
                        f"[ftlaunch] replica group {self.gid}: the training finished while it was recovering "
                        "(nobody left to heal it from); it ended (the lighthouse refused it a quorum)"
                    )
                )
            self.state = SUCCEEDED
            return AgentExit()
        if status == "failed":  # torchelastic gave up: restarts exhausted
            self.state = FAILED
            self.root_cause = (
                f"replica group {self.gid} failed: {describe_root_cause(result.get('root_cause', {}))}"
            )
            return AgentExit(report="workers failed, no restarts left")
        # The agent itself died (killed, crashed, or an exception outside the workers).
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        detail = f": {result['message']}" if status == "error" and result.get("message") else ""
        report = self._fail(self.attempt, now, f"agent {how}")
        if status == "error" and self.state == STARTING:  # it never started a worker: respawning cannot help
            self.state = FAILED
            self.root_cause = f"replica group {self.gid}: agent {how}{detail}"
            return AgentExit(kill_orphans=True, report=report)
        if self.agent_respawns >= max_agent_restarts:
            self.state = FAILED
            self.root_cause = (
                f"replica group {self.gid}: agent {how}{detail}; respawn budget "
                f"(--max-agent-restarts {max_agent_restarts}) exhausted"
            )
            return AgentExit(kill_orphans=True, report=report)
        message = (
            f"[ftlaunch] replica group {self.gid}: agent {how}{detail}; respawning it "
            f"({self.agent_respawns + 1}/{max_agent_restarts})"
        )
        return AgentExit(respawn=True, kill_orphans=True, report=report, message=message)

    def step_line(self, step: int, committed: bool, now: float) -> float | None:
        """Rank 0 printed a step. Returns the time to rejoin when this commit ends a failure."""
        if not committed:
            return None
        self.stepped = True
        self.committed += 1
        self.last_step = step
        if self.failure_at is None or self.recovering:
            return None
        elapsed = now - self.failure_at
        self.rejoin_times.append(elapsed)
        self.failure_at = None
        return elapsed

    def slot_taken_over(self, now: float) -> float | None:
        """A hot spare took this group's slot and committed a step: the failure is recovered (the
        group itself, restarted, waits as a spare). Returns the time to recover, if it was down."""
        if self.failure_at is None:
            return None
        elapsed = now - self.failure_at
        self.rejoin_times.append(elapsed)
        self.failure_at = None
        return elapsed

    def lighthouse_progress(self, p: GroupProgress, now: float, wall_offset: float) -> float | None:
        """What the lighthouse knows of the group's training (its leader's reports), read at ``now``.

        Returns the (monotonic) time of the commit that ends the current failure, if one does: the
        first commit of a new process (its time as the lighthouse saw it, ``wall_offset`` = wall
        clock - monotonic clock), or, after a hang, the first commit once resumed. A late report
        of the process that died is not a rejoin.
        """
        self.last_step = p.step if p.sessions else self.last_step
        self.checksum = p.checksum if p.finished and p.checksum else None
        if p.finished:
            # Its leader left at the end of a clean training loop: the training is ending. Known
            # from the leave, seconds before the worker process exits (the straggler stop needs it
            # then: a group restarting meanwhile would otherwise train alone from behind).
            self.finishing = True
        self.checksum_step = p.checksum_step if self.checksum else None
        self.unsynced_sessions = p.unsynced_sessions
        self.stopped_after_end = p.stopped_after_end
        if p.durable_step and p.durable_step > (self.durable_step or 0):
            self.durable_step, self.durable_time = p.durable_step, p.durable_time
            self.durable_seconds = p.durable_seconds
        self.durable_saves, self.durable_skipped = p.durable_saves, p.durable_skipped
        self.durable_failed = p.durable_failed
        if p.resumed_from:
            self.resumed_from = p.resumed_from
            self.resumed_steps.add(p.resumed_from)
        new = p.committed > self.committed
        self.committed = max(self.committed, p.committed)
        self.session = p.session
        if not new:
            return None
        self.stepped = True
        if self.failure_at is None or self.paused or self.state == STARTING:
            return None
        if self.down_session is not None and p.session == self.down_session:
            return None  # in-flight reports of the process that died
        at = now
        if self.down_session is not None and p.session_first_commit is not None:
            at = max(self.failure_at, min(now, p.session_first_commit - wall_offset))
        self.rejoin_times.append(at - self.failure_at)
        self.failure_at = None
        self.down_session = None
        return at

    def hung(self, now: float) -> None:
        """Its workers were SIGSTOPped: down from now until they commit again after `resumed`."""
        self.paused = True
        self.failure_at = now
        self.down_session = None

    def replaced_as_straggler(self, at: float) -> None:
        """The lighthouse replaced it as a straggler at ``at``: down from then (its process was fenced,
        or told to end) until a hot spare in its slot, or its own restart, commits."""
        if self.failure_at is None:
            self.failure_at = at
            self.down_session = self.session

    def resumed(self) -> None:
        self.paused = False

    def stopped_by_launcher(self) -> None:
        """The launcher is stopping the job (signal or another group's fate)."""
        if not self.terminal:
            self.state = STOPPED

    def _fail(self, attempt: Attempt, now: float, reason: str) -> str | None:
        if attempt in self.failed_attempts:
            return None  # another report of a failure already counted
        self.failed_attempts.add(attempt)
        if self.failure_at is None:
            self.failure_at = now
            self.down_session = self.session
        return reason


def configuration_stop(groups: list[Group]) -> str | None:
    """The root cause that ends the job now, whatever else runs: a worker ended on a configuration
    error. A setting is the same for every group and every restart, so neither the group's agent
    (``--max-restarts``), nor a hot spare, nor the groups left for ``--min-replicas`` could train
    past it; each would start, fail the same way and start again. None: no such failure."""
    return next((g.root_cause for g in groups if g.misconfigured and g.root_cause), None)


def describe_root_cause(cause: dict[str, Any]) -> str:
    """One line from the agent's root-cause record (torchelastic's first failure)."""
    if not cause:
        return "workers failed (no details)"
    if cause.get("signal"):
        how = f"killed by {cause['signal']}"
    else:
        how = f"exited with code {cause.get('exitcode')}"
    text = f"rank {cause.get('rank')} (pid {cause.get('pid')}) {how}"
    message = (cause.get("message") or "").strip()
    if message:
        text += f": {message.splitlines()[-1]}"
    elif cause.get("stderr_tail"):
        text += f": {cause['stderr_tail'][-1]}"
    if cause.get("error_file"):
        text += f" (error file {cause['error_file']})"
    return text


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

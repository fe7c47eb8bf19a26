"""A replica group's accounting in the supervisor (ftlaunch.launcher.group), fed the news an agent
sends, in one process: one failure is one count however many reports of it arrive."""

from __future__ import annotations

import json
import tempfile

from ftlaunch.errors import ConfigurationError, configuration_error_in, error_record
from ftlaunch.launcher.group import (
    FAILED,
    RUNNING,
    STARTING,
    SUCCEEDED,
    Group,
    configuration_stop,
    describe_root_cause,
)

KILLED = "killed by SIGKILL"


def running(gid: int = 0, pids: dict[int, int] | None = None) -> Group:
    g = Group(gid)
    g.agent_started()
    assert g.workers_started(0, pids or {0: 100}, now=0.0) is None
    return g


def test_first_workers_make_the_group_running_and_healthy() -> None:
    g = Group(1)
    g.agent_started()
    assert (g.state, g.incarnation, g.restarts, g.failures, g.healthy) == (STARTING, 1, 0, 0, False)
    g.workers_started(0, {0: 100, 1: 101}, now=0.0)
    assert g.state == RUNNING and g.healthy and g.worker_pids == {0: 100, 1: 101} and g.replica_id == "rg1"


def test_worker_death_then_restart_is_one_failure_and_one_restart() -> None:
    g = running()
    assert g.worker_exited(100, 0, 0, True, KILLED, now=10.0) == f"rank 0 (pid 100) {KILLED}"
    assert g.workers_started(1, {0: 200}, now=10.5) is None  # the restart reveals nothing new
    assert (g.failures, g.restarts, g.generation, g.worker_pids) == (1, 1, 1, {0: 200})


def test_exit_status_reaped_before_the_agent_read_it_counts_when_the_next_generation_appears() -> None:
    g = running()
    assert g.worker_exited(100, 0, 0, None, "status unknown", now=10.0) is None
    assert g.workers_started(1, {0: 200}, now=10.5) == "workers of restart 0 failed"
    assert g.failures == 1 and g.failure_at == 10.5


def test_siblings_stopped_by_torchelastic_and_late_reports_are_the_same_failure() -> None:
    g = running(pids={0: 100, 1: 101})
    assert g.worker_exited(101, 1, 0, True, KILLED, now=10.0) is not None
    assert g.worker_exited(100, 0, 0, True, "killed by SIGTERM", now=10.1) is None  # torchelastic stops it
    assert g.workers_started(1, {0: 200, 1: 201}, now=11.0) is None
    assert g.worker_exited(100, 0, 0, True, "killed by SIGTERM", now=11.1) is None  # arriving late
    assert g.failures == 1 and g.restarts == 1


def test_agent_dying_while_its_group_is_down_is_the_same_failure() -> None:
    """The double count behind a flaky e2e summary: a worker died (counted), then its agent died
    before starting new workers, and the agent's death was counted as a second failure."""
    g = running()
    assert g.worker_exited(100, 0, 0, True, KILLED, now=10.0) is not None
    outcome = g.agent_exited(-9, {}, max_agent_restarts=3, now=10.2)
    assert outcome.respawn and outcome.kill_orphans and outcome.report is None  # the lighthouse knows already
    assert g.failures == 1
    g.agent_started()
    assert (g.incarnation, g.generation, g.restarts, g.agent_respawns, g.state) == (2, 0, 1, 1, STARTING)


def test_agent_killed_while_healthy_is_one_failure_and_is_respawned() -> None:
    g = running()
    outcome = g.agent_exited(-9, {}, max_agent_restarts=3, now=5.0)
    assert outcome.respawn and outcome.kill_orphans and outcome.report == "agent killed by SIGKILL"
    assert outcome.message == "[ftlaunch] replica group 0: agent killed by SIGKILL; respawning it (1/3)"
    g.agent_started()
    g.workers_started(0, {0: 300}, now=6.0)
    assert (g.failures, g.restarts) == (1, 1)


def test_agent_respawn_budget() -> None:
    g = running()
    for n in range(2):
        assert g.agent_exited(-9, {}, max_agent_restarts=2, now=float(n)).respawn
        g.agent_started()
        g.workers_started(0, {0: 300 + n}, now=float(n))
    outcome = g.agent_exited(1, {}, max_agent_restarts=2, now=9.0)
    assert not outcome.respawn and g.state == FAILED and g.failures == 3
    assert (
        g.root_cause
        == "replica group 0: agent exited with code 1; respawn budget (--max-agent-restarts 2) exhausted"
    )


def test_agent_error_before_any_worker_fails_the_group() -> None:
    g = Group(0)
    g.agent_started()
    outcome = g.agent_exited(
        1, {"status": "error", "message": "ValueError: bad"}, max_agent_restarts=3, now=1.0
    )
    assert not outcome.respawn and g.state == FAILED
    assert g.root_cause == "replica group 0: agent exited with code 1: ValueError: bad"


def test_restarts_exhausted_is_reported_but_not_counted_again() -> None:
    g = running()
    g.worker_exited(100, 0, 0, True, "exited with code 1", now=1.0)
    cause = {"rank": 0, "pid": 100, "exitcode": 1, "message": "Traceback ...\nValueError: boom"}
    outcome = g.agent_exited(1, {"status": "failed", "root_cause": cause}, max_agent_restarts=3, now=2.0)
    assert outcome.report == "workers failed, no restarts left" and not outcome.respawn
    assert g.state == FAILED and g.failures == 1
    assert g.root_cause == "replica group 0 failed: rank 0 (pid 100) exited with code 1: ValueError: boom"


def test_a_worker_ending_on_a_configuration_error_fails_its_group_and_stops_the_job() -> None:
    """Whatever the restarts left, spares or --min-replicas: the next attempt would read the same
    setting. Every other failure leaves the decision to the restarts."""
    groups = [running(0, {0: 100, 1: 101}), running(1, {0: 200})]
    groups[1].worker_exited(200, 0, 0, True, "exited with code 1", now=0.5)
    assert configuration_stop(groups) is None
    bad = "FTLAUNCH_BACKEND='mpi' is not one of ..."
    cause = groups[0].worker_misconfigured(101, 1, 0, bad, now=1.0)
    assert cause == f"replica group 0 rank 1 (pid 101): configuration error: {bad}"
    assert groups[0].state == FAILED and groups[0].failures == 1 and groups[0].worker_pids == {0: 100}
    assert configuration_stop(groups) == cause
    # Its siblings' exits (torchelastic stops them) are the same failure.
    assert groups[0].worker_exited(100, 0, 0, True, KILLED, now=1.1) is None
    assert groups[0].failures == 1 and configuration_stop(groups) == cause


def _recorded(exc: BaseException) -> object:
    """``exc`` through the error file, as the agent reads it: JSON text and back."""
    return json.loads(json.dumps(error_record(exc, "Traceback ...", 1700000000)))


def test_the_error_file_says_configuration_error_only_for_one() -> None:
    record = _recorded(ConfigurationError("FTLAUNCH_TIMEOUT='-1' is out of range"))
    assert configuration_error_in(record) == "FTLAUNCH_TIMEOUT='-1' is out of range"
    # torchelastic's layout, which its ProcessFailure parses (message and timestamp).
    assert isinstance(record, dict)
    assert record["message"]["message"] == "ConfigurationError: FTLAUNCH_TIMEOUT='-1' is out of range"
    assert int(record["message"]["extraInfo"]["timestamp"]) == 1700000000
    assert configuration_error_in(_recorded(ValueError("boom"))) is None
    # What torchelastic's own @record writes, a plain message, garbage: not ours.
    plain = {"message": {"message": "ConfigurationError: x", "extraInfo": {"timestamp": "1"}}}
    for other in (plain, {"message": "ConfigurationError: x"}, [], None, "text"):
        assert configuration_error_in(other) is None


def test_a_torchelastic_failure_reads_the_record() -> None:
    """torchelastic's agent parses the record as one of its own error files (the root cause it
    reports, under torchrun too)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(_recorded(ConfigurationError("bad setting")), f)
        f.flush()
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=f.name)
    assert failure.message["message"] == "ConfigurationError: bad setting"
    assert failure.timestamp == 1700000000


def test_success() -> None:
    g = running()
    assert g.worker_exited(100, 0, 0, False, "exited with code 0", now=1.0) is None
    assert g.finishing
    assert g.agent_exited(0, {"status": "succeeded"}, max_agent_restarts=3, now=2.0).report is None
    assert g.state == SUCCEEDED and g.terminal and g.failures == 0


def test_rejoin_is_measured_from_the_failure_to_the_new_workers_first_commit() -> None:
    g = running()
    g.step_line(4, True, now=9.0)
    g.worker_exited(100, 0, 0, True, KILLED, now=10.0)
    assert not g.healthy
    assert g.step_line(5, True, now=10.1) is None  # in-flight output of the dead worker
    g.workers_started(1, {0: 200}, now=12.0)
    assert g.step_line(5, False, now=13.0) is None  # not committed
    assert g.step_line(6, True, now=13.5) == 3.5
    assert g.rejoin_times == [3.5] and g.healthy and g.committed == 3 and g.last_step == 6


def test_a_hang_is_down_until_the_workers_commit_after_resuming() -> None:
    g = running()
    g.step_line(1, True, now=1.0)
    g.hung(now=2.0)
    assert not g.healthy and g.failures == 0
    assert g.step_line(2, True, now=2.01) is None  # printed before the stop
    g.resumed()
    assert g.step_line(3, True, now=5.0) == 3.0 and g.healthy


def test_stopped_by_launcher_keeps_terminal_states() -> None:
    done, live = running(0), running(1)
    done.agent_exited(0, {"status": "succeeded"}, 3, now=1.0)
    for g in (done, live):
        g.stopped_by_launcher()
    assert (done.state, live.state) == (SUCCEEDED, "stopped")


def test_describe_root_cause() -> None:
    assert describe_root_cause({}) == "workers failed (no details)"
    cause = {
        "rank": 1,
        "pid": 7,
        "exitcode": -9,
        "signal": "SIGKILL",
        "stderr_tail": ["a", "OOM"],
        "error_file": "/e",
    }
    assert describe_root_cause(cause) == "rank 1 (pid 7) killed by SIGKILL: OOM (error file /e)"


# -- progress read from the lighthouse (Group.lighthouse_progress)


def _progress(session: str, committed: int, first: float | None = None, **kw: object):
    from ftlaunch.lighthouse.progress import GroupProgress

    return GroupProgress(
        "rg0",
        step=committed,
        committed=committed,
        sessions=1,
        session=session,
        session_first_commit=first,
        **kw,
    )  # type: ignore[arg-type]


def test_rejoin_from_the_lighthouse_is_the_new_process_first_commit() -> None:
    g = running()
    offset = 1000.0  # wall clock = monotonic + 1000
    assert g.lighthouse_progress(_progress("s1", 4, first=1001.0), now=5.0, wall_offset=offset) is None
    assert (g.committed, g.last_step, g.session) == (4, 4, "s1")
    g.worker_exited(100, 0, 0, True, KILLED, now=10.0)
    # A report of the dead process that arrives late is not a rejoin.
    assert g.lighthouse_progress(_progress("s1", 5, first=1001.0), now=10.2, wall_offset=offset) is None
    g.workers_started(1, {0: 200}, now=12.0)
    # The new process committed at wall 1013.5 (monotonic 13.5); the supervisor reads it at 14.0.
    assert g.lighthouse_progress(_progress("s2", 7, first=1013.5), now=14.0, wall_offset=offset) == 13.5
    assert g.rejoin_times == [3.5] and g.healthy and g.committed == 7


def test_a_hang_rejoins_when_the_same_process_commits_again() -> None:
    g = running()
    g.lighthouse_progress(_progress("s1", 2, first=1.0), now=1.0, wall_offset=0.0)
    g.hung(now=2.0)
    assert (
        g.lighthouse_progress(_progress("s1", 3, first=1.0), now=2.5, wall_offset=0.0) is None
    )  # still stopped
    g.resumed()
    assert g.lighthouse_progress(_progress("s1", 4, first=1.0), now=5.0, wall_offset=0.0) == 5.0
    assert g.rejoin_times == [3.0]


def test_checksum_and_unsynced_come_only_from_the_lighthouse() -> None:
    g = running()
    g.lighthouse_progress(_progress("s1", 9, checksum="abc", checksum_step=9, finished=False), 1.0, 0.0)
    assert g.checksum is None  # not a clean exit: nothing claimed
    g.lighthouse_progress(
        _progress("s1", 9, checksum="abc", checksum_step=9, finished=True, unsynced_sessions=1), 2.0, 0.0
    )
    assert (g.checksum, g.checksum_step, g.unsynced_sessions) == ("abc", 9, 1)


def test_a_finished_report_marks_the_training_ending_before_the_worker_exits() -> None:
    """The leader's leave carries "finished": the supervisor's straggler stop must not wait for the
    worker process to exit (the soak found a group restarting in those seconds train alone)."""
    g = running()
    g.lighthouse_progress(_progress("s1", 9, first=1.0), now=1.0, wall_offset=0.0)
    assert not g.finishing
    g.lighthouse_progress(
        _progress("s1", 10, first=1.0, finished=True, checksum="abc", checksum_step=10),
        now=2.0,
        wall_offset=0.0,
    )
    assert g.finishing and g.checksum == "abc"

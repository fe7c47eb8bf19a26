"""The status line and the summary (ftlaunch.launcher.report), formatted from groups' accounting in
one process. The e2e tests parse these exact lines."""

from __future__ import annotations

import io
from typing import Any

from ftlaunch.launcher.chaos import Injection
from ftlaunch.launcher.group import Group
from ftlaunch.launcher.lighthouse_host import JobLighthouse
from ftlaunch.launcher.output import Console
from ftlaunch.launcher.report import StatusLine, lost, status_text, summary_lines
from ftlaunch.lighthouse.progress import Rewind
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.lighthouse.status import LighthouseStatus


def groups_after_a_kill() -> list[Group]:
    a, b = Group(0), Group(1)
    for g in (a, b):
        g.agent_started()
        g.workers_started(0, {0: 10 + g.gid}, now=0.0)
        for step in range(3):
            g.step_line(step, True, now=1.0)
    b.worker_exited(11, 0, 0, True, "killed by SIGKILL", now=2.0)
    b.workers_started(1, {0: 21}, now=3.0)
    b.step_line(3, True, now=4.5)
    a.checksum = b.checksum = "c0ffee"
    return [a, b]


def row(lines: list[str], group: int) -> list[str]:
    return next(line.split()[2:] for line in lines if line.split()[:2] == ["[ftlaunch]", f"rg{group}"])


def test_status_text() -> None:
    groups = groups_after_a_kill()
    assert status_text(groups, 7, 12.4) == (
        "[ftlaunch] quorum 7 | step 3 | groups up 2/2 | failures 1 | restarts 1 | 12s"
    )
    assert status_text([Group(0)], None, 0.0).startswith("[ftlaunch] quorum - | step - | groups up 0/1")


def test_summary_table_identical_weights_and_chaos() -> None:
    groups = groups_after_a_kill()
    injections = [
        Injection(at=102.0, group=1, signal="SIGKILL", target="workers", step=2, rejoined_after=2.5)
    ]
    lines = summary_lines(0, 30.0, groups, 42, injections, started=100.0, log_dir="/logs")
    assert lines[1] == "[ftlaunch] summary: exit 0 after 30.0s, last quorum id 42"
    assert row(lines, 0) == ["running", "3", "2", "0", "0", "-", "c0ffee"]
    assert row(lines, 1) == ["running", "4", "3", "1", "1", "2.5s", "max", "(1x)", "c0ffee"]
    assert "[ftlaunch] 2/2 groups ended bit-identical (c0ffee)" in lines
    assert "[ftlaunch] chaos: 1 injection(s)" in lines
    assert "[ftlaunch]   t=2.0s SIGKILL rg1 workers at step 2: group committed again 2.5s later" in lines
    assert "[ftlaunch] training finished despite 1 failure(s); 7 committed group-steps" in lines
    assert not any("logs kept" in line for line in lines)


def test_summary_of_a_failed_job() -> None:
    groups = groups_after_a_kill()
    groups[1].checksum = "bad"
    groups[1].root_cause = "replica group 1 failed: rank 0 (pid 21) exited with code 1: ValueError: x"
    lines = summary_lines(1, 5.0, groups, None, None, started=0.0, log_dir="/logs")
    assert lines[1] == "[ftlaunch] summary: exit 1 after 5.0s"
    assert "[ftlaunch] WARNING: groups ended with different weights: ['bad', 'c0ffee']" in lines
    assert not any("chaos" in line for line in lines)
    assert lines[-2:] == [f"[ftlaunch] root cause: {groups[1].root_cause}", "[ftlaunch] logs kept in /logs"]


class FakeLighthouse(JobLighthouse):
    def __init__(self) -> None:
        self.doc: dict[str, Any] | None = {"quorum": {"quorum_id": 5}}

    @property
    def address(self) -> str:
        return "http://127.0.0.1:1"

    def snapshot(self) -> LighthouseStatus:
        if self.doc is None:
            raise OSError("gone")
        return LighthouseStatus(quorum=Quorum(self.doc["quorum"]["quorum_id"], (), 0.0))

    def report_failure(self, replica_id: str, reason: str) -> None:
        raise AssertionError("not used")

    def close(self) -> None:
        pass


def test_status_line_is_throttled_and_keeps_the_last_quorum_id() -> None:
    out, lh = io.StringIO(), FakeLighthouse()
    line = StatusLine(Console(out, io.StringIO(), status=True), lh, started=0.0)
    groups = groups_after_a_kill()
    line.tick(1.0, groups)
    assert out.getvalue().endswith(
        "[ftlaunch] quorum 5 | step 3 | groups up 2/2 | failures 1 | restarts 1 | 1s"
    )
    lh.doc = {"quorum": {"quorum_id": 6}}
    line.tick(1.2, groups)  # too soon: not redrawn
    assert "quorum 6" not in out.getvalue()
    lh.doc = None  # the lighthouse cannot be read
    line.tick(2.0, groups)
    assert out.getvalue().endswith("quorum 5 | step 3 | groups up 2/2 | failures 1 | restarts 1 | 2s")
    assert line.last_quorum_id() == 5


def test_equal_checksums_at_different_steps_are_not_bit_identical() -> None:
    groups = groups_after_a_kill()
    groups[0].checksum_step, groups[1].checksum_step = 3, 4
    lines = summary_lines(0, 5.0, groups, None, None, started=0.0, log_dir="/logs")
    assert not any("bit-identical" in line for line in lines)
    assert "[ftlaunch] WARNING: groups ended at different steps: rg0 at step 3, rg1 at step 4" in lines


def test_summary_prints_the_lighthouse_figures() -> None:
    from ftlaunch.lighthouse.progress import GroupProgress
    from ftlaunch.lighthouse.status import ReplacedStatus, StragglersStatus, StragglerStatus

    status = LighthouseStatus(
        quorum_changes=3,
        progress=(
            GroupProgress(
                "rg0",
                heals=0,
                step_seconds=0.05,
                quorum_seconds=0.01,
                commit_seconds=0.002,
                compute_seconds=0.02,
                step_rate=19.5,
            ),
            GroupProgress("rg1", heals=2, heal_seconds=1.25),
        ),
        stragglers=StragglersStatus(
            "replace",
            groups=(StragglerStatus("rg0", 1.0), StragglerStatus("rg1", 2.1, straggler=True)),
            replaced=(ReplacedStatus("rg2", 3.04, "spare", 100.0, 104.5),),
        ),
    )
    lines = summary_lines(
        0, 5.0, groups_after_a_kill(), None, None, started=0.0, log_dir="/logs", lighthouse=status
    )
    assert any(line.startswith("[ftlaunch] lighthouse: 3 quorum change(s)") for line in lines)
    assert (
        "[ftlaunch]   rg0    0      0.00s      50.0ms     10.0ms       2.0ms   20.0ms    1.0x            19.5"
        in lines
    )
    assert any(line.split()[1:4] == ["rg1", "2", "1.25s"] and "2.1x straggler" in line for line in lines)
    assert "[ftlaunch] stragglers at the end (--stragglers replace): rg1 2.1x slower" in lines
    assert (
        "[ftlaunch] straggler rg2 (3.0x slower) replaced: its slot went to a hot spare, whose first step "
        "committed 4.5s later" in lines
    )


def test_lost_progress_is_in_the_status_line_and_the_summary_and_keeps_the_logs() -> None:
    """No group holding the state survived: the job restarted from step 0 after step 50. It still
    finished (exit 0), but nothing says "succeeded" without saying what was lost."""
    groups = groups_after_a_kill()
    lost = Rewind(reached=50, restarted_at=0, wall=1012.5)
    assert status_text(groups, 7, 12.4, [lost]).endswith(
        "| 12s | PROGRESS LOST: restarted from step 0 after step 50"
    )
    injections = [Injection(at=102.0, group=1, signal="SIGKILL", target="workers", step=2)]
    lines = summary_lines(0, 30.0, groups, 42, injections, started=100.0, log_dir="/logs", rewinds=[lost],
                          started_wall=1000.0)  # fmt: skip
    assert (
        "[ftlaunch] WARNING: progress lost: at t=12.5s no replica group holding the trained state of step 50 "
        "was left (no durable checkpoint); the job restarted from step 0 and trained steps 0..50 again"
    ) in lines
    assert (
        "[ftlaunch] training finished despite 1 failure(s); 7 committed group-steps; progress was "
        "lost 1 time(s)" in lines
    )
    assert "[ftlaunch] logs kept in /logs" in lines
    # A rewind that a group holding the state undid (it had hung, and came back): a note, no warning.
    back = Rewind(reached=50, restarted_at=0, wall=1012.5, recovered=True)
    lines = summary_lines(0, 30.0, groups, 42, None, started=100.0, log_dir="/logs", rewinds=[back],
                          started_wall=1000.0)  # fmt: skip
    assert not any("WARNING" in line or "logs kept" in line for line in lines)
    assert any(line.startswith("[ftlaunch] note: at t=12.5s no group holding step 50") for line in lines)
    assert "PROGRESS LOST" not in status_text(groups, 7, 12.4, [back])


def test_a_rewind_to_a_durable_checkpoint_says_so_and_is_no_lost_progress() -> None:
    """Every group died and the restarted ones resumed from the durable checkpoint of step 40 (their
    leaders reported it): the summary says so and how many steps were trained again; no "progress
    lost", no kept logs. A rewind to a step no group resumed from is still lost progress."""
    groups = groups_after_a_kill()
    groups[0].resumed_steps.add(40)
    back = Rewind(reached=47, restarted_at=40, wall=1012.5)
    assert status_text(groups, 7, 12.4, [back]).endswith("| 12s | resumed from durable step 40 after step 47")
    lines = summary_lines(0, 30.0, groups, 42, [], started=100.0, log_dir="/logs", rewinds=[back],
                          started_wall=1000.0)  # fmt: skip
    assert (
        "[ftlaunch] note: at t=12.5s no replica group holding the trained state of step 47 was left; the job "
        "resumed from the durable checkpoint of step 40 and trained 7 step(s) again (40..47)"
    ) in lines
    assert not any("WARNING" in line or "logs kept" in line or "progress was lost" in line for line in lines)
    scratch = Rewind(reached=47, restarted_at=0, wall=1012.5)
    assert lost([back, scratch], groups) == [scratch]
    assert "PROGRESS LOST: restarted from step 0 after step 47" in status_text(
        groups, 7, 12.4, [back, scratch]
    )

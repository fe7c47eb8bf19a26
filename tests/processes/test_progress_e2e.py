"""Progress from the lighthouse, through ``ftlaunch`` with real processes: a script that prints
nothing (tests/workers/silent_train.py, README's two-line form) still gets a true summary -- steps,
heals, rejoins and checksums come from what the group leaders report to the lighthouse -- and the
summary never claims what did not happen."""

from __future__ import annotations

import os
import re

import pytest
from workers.helpers import FTLAUNCH, REPO, run

SILENT = os.path.join(REPO, "tests", "workers", "silent_train.py")

pytestmark = pytest.mark.timeout(240)


def summary_row(stdout: str, group: int) -> list[str]:
    for line in stdout.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[0] == "[ftlaunch]" and fields[1] == f"rg{group}":
            return fields[2:]
    raise AssertionError(f"no summary row for rg{group} in:\n{stdout}")


def lighthouse_row(stdout: str, group: int) -> list[str]:
    """The row of rg<group> in the summary's lighthouse table (heals, heal time, step time, ...)."""
    for line in stdout.splitlines():
        fields = line.split()
        if fields[:2] == ["[ftlaunch]", f"rg{group}"] and not fields[2].isalpha():
            return fields[2:]
    raise AssertionError(f"no lighthouse row for rg{group} in:\n{stdout}")


def test_summary_of_a_script_that_prints_nothing_comes_from_the_lighthouse() -> None:
    """Also the first quorum waits for both announced groups, so the job has one
    quorum id from start to end (the first group no longer trains alone until the second joins)."""
    res = run([*FTLAUNCH, "--replicas", "2", SILENT, "--steps", "12"], timeout=200)
    assert res.returncode == 0, res.stderr
    assert not re.search(r"^\[rg\d/r\d\]", res.stdout, re.M), "the script printed something"
    # With init_sync, rg1 copies rg0's state: it waits step 0 (rg0 commits it and snapshots its end),
    # heals before step 1 and commits from there on. One heal, and none for rg0.
    assert summary_row(res.stdout, 0)[:5] == ["succeeded", "12", "12", "0", "0"], res.stdout
    assert summary_row(res.stdout, 1)[:5] == ["succeeded", "11", "12", "0", "0"], res.stdout
    assert [lighthouse_row(res.stdout, g)[0] for g in (0, 1)] == ["0", "1"], res.stdout
    m = re.search(r"\[ftlaunch\] 2/2 groups ended bit-identical \((\w+)\)", res.stdout)
    assert m and len(m.group(1)) == 16, res.stdout
    assert "[ftlaunch] lighthouse: 1 quorum change(s)" in res.stdout, "the first quorum did not wait for both"


@pytest.mark.slow
def test_a_killed_group_rejoins_and_the_summary_says_so() -> None:
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--max-restarts",
            "3",
            "--chaos",
            "steps=6,group=1",
            SILENT,
            "--steps",
            "500",
            "--step-sleep",
            "0.05",
        ],
        timeout=220,
    )
    assert res.returncode == 0, res.stderr
    row1 = summary_row(res.stdout, 1)
    assert row1[0] == "succeeded" and row1[3:5] == ["1", "1"], res.stdout  # one failure, one restart
    # Enough steps that rg0 is still training when rg1 is back (a restart takes seconds here);
    # otherwise rg1 would train alone from step 0, which the summary reports as a failure (below).
    assert int(row1[1]) < 500 and row1[2] == "500", res.stdout
    assert re.search(r"SIGKILL rg1 workers at step \d+: group committed again \d+\.\ds later", res.stdout)
    assert int(lighthouse_row(res.stdout, 1)[0]) >= 1  # the restarted group healed from rg0
    assert "2/2 groups ended bit-identical" in res.stdout


@pytest.mark.slow
def test_a_group_that_restarts_after_its_peers_finished_is_stopped_not_trained_alone(tmp_path) -> None:
    """rg1 dies after its last step; its agent restarts it after rg0 finished, at step 0 with nobody
    to heal from. It must neither train alone (the job used to exit 1: "trained without the other
    groups' state") nor pass that off as a rejoin: the lighthouse refuses it a quorum (412) or the
    supervisor stops it first, and the job ends 0 with rg1 stopped after the end."""
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--max-restarts",
            "2",
            SILENT,
            "--steps",
            "8",
            "--die-after-group",
            "1",
            "--marker-dir",
            str(tmp_path),
        ],
        timeout=220,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "trained without the other groups' state" not in res.stdout + res.stderr
    assert "the training finished while it was recovering" in res.stderr, res.stderr
    assert summary_row(res.stdout, 0)[0] == "succeeded", res.stdout
    row1 = summary_row(res.stdout, 1)
    # Its steps with rg0 (the last one's report may die with it), none alone from step 0.
    assert row1[0] == "stopped" and int(row1[1]) <= 8, res.stdout

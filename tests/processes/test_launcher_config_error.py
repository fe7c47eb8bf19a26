"""A worker that ends on a configuration error stops the ``ftlaunch`` job: one line, no restart.

A bad setting (``ftlaunch.ConfigurationError``, raised by ``ftlaunch.init`` in every worker) is the
same in every group and at every restart, so the launcher stops the job at the first such exit
instead of letting each group's agent restart it (``--max-restarts``), a hot spare take its slot, or
the other groups train on for ``--min-replicas``. The worker's torchelastic error file says so
(`ftlaunch.errors.error_record`); its agent reads it on the exit and the supervisor decides
(`ftlaunch.launcher.group.configuration_stop`).
"""

from __future__ import annotations

import re

import pytest
from workers.helpers import FTLAUNCH, run

pytestmark = pytest.mark.timeout(120)

#: A training script whose ``ftlaunch.init`` refuses its setting, in every worker of every group.
_SCRIPT = """\
import ftlaunch

ftlaunch.init(backend="baby-mpi")
print("unreachable: init accepted the backend", flush=True)
"""


def test_configuration_error_stops_the_job_at_once_without_restarts(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--spares",
            "1",
            "--min-replicas",
            "1",
            "--max-restarts",
            "3",
            "--no-status",
            "--log-dir",
            str(tmp_path / "logs"),
            str(script),
        ],
        timeout=90,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"ftlaunch: error: replica group [012] rank 0 \(pid \d+\): configuration error: "
        r"backend='baby-mpi' is not one of .*",
        last,
    ), res.stderr[-3000:]
    # No group was restarted, and no group's worker ran twice.
    assert "restarts the group" not in res.stderr and "respawning" not in res.stderr, res.stderr[-3000:]
    for g in range(3):
        said = res.stderr.count(f"[rg{g}/r0] ftlaunch: configuration error: backend='baby-mpi'")
        assert said <= 1, res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines() if re.match(r"\[ftlaunch\] rg\d ", line)]
    assert len(rows) == 3, res.stdout
    assert all(row[6] == "0" for row in rows), res.stdout  # the restarts column
    assert sorted(row[2] for row in rows).count("failed") >= 1, res.stdout
    assert "unreachable" not in res.stdout

"""``ftlaunch --health-check``, the whole path with real processes: each group's agent runs the
check before its workers start; group 1's check fails twice and then passes (it joins late and
heals), group 2's never passes (it stays out, and is stopped once the others finished); the job
trains on and finishes, the summary names the check and its last line, and the timeline written at
exit marks the checks failing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "train_ddp.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_kept_out_by_its_check_while_the_others_train_and_finish(tmp_path) -> None:
    check = tmp_path / "check.sh"
    check.write_text(
        textwrap.dedent(f"""\
        f={tmp_path}/tries.$REPLICA_GROUP_ID; n=$(cat $f 2>/dev/null || echo 0); n=$((n+1)); echo $n > $f
        case $REPLICA_GROUP_ID in
          1) [ $n -gt 2 ] || {{ echo "rg1: /dev/shm full (try $n)"; exit 1; }} ;;
          2) echo "rg2: GPU 0 lost (try $n)"; exit 1 ;;
        esac
        echo healthy
        """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ftlaunch.launcher.cli", "--replicas", "3", "--no-status",
         "--log-dir", str(tmp_path / "logs"),
         "--health-check", f"sh {check}", "--health-check-timeout", "20",
         str(TRAIN), "--steps", "40", "--width", "16", "--step-sleep", "0.1"],
        capture_output=True, text=True, timeout=280, env={**os.environ, "FTLAUNCH_ZYGOTE": "0"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert int((tmp_path / "tries.0").read_text()) == 1
    assert int((tmp_path / "tries.1").read_text()) == 3  # failed twice, passed the third time
    assert int((tmp_path / "tries.2").read_text()) >= 2  # retried while the others trained
    assert "health check failed (exit 1): rg1: /dev/shm full (try 1)" in out
    assert "health check passed after 2 failure(s)" in out
    assert "replica group 2: the training finished while its health check kept it out" in out
    assert "[ftlaunch] health check of rg1 failed 2 time(s), then passed (the group joined)" in out
    warning = next(line for line in out.splitlines() if "WARNING: health check of rg2" in line)
    assert "the group stayed out" in warning and "rg2: GPU 0 lost (try" in warning
    committed = [
        line for line in out.splitlines() if line.startswith("[rg1/r0] step=") and "committed=True" in line
    ]
    assert committed, "group 1 never trained after its check passed"
    assert not any(line.startswith("[rg2/r0] step=") for line in out.splitlines())
    # The picture written at exit marks each group's check failing, as the dashboard does.
    svg = (tmp_path / "logs" / "timeline.svg").read_text()
    for failing in (r"rg1: /dev/shm full \(try 1\)", r"rg2: GPU 0 lost \(try 1\)"):
        assert re.search(r"health check failed, kept out: [^<]*" + failing, svg), svg[-3000:]

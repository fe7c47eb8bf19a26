"""Stopped workers: the agent reports them, ``--kill-stopped`` kills them (soak goodput).

The soak found survivors blocked for ``stop_for`` seconds by every SIGSTOPped group (18 of 30 lost
seconds). The agent's watcher sees a worker stopped (``waitid(WSTOPPED)``, consumed without reaping,
so torchelastic still reaps and restarts) and the supervisor, with ``--kill-stopped``, kills it at
once: the others go on without waiting and the group restarts and heals. Unit: the watcher on a real
child of this process. End to end (slow): ``ftlaunch --kill-stopped`` with a group SIGSTOPped for
100 s still finishes, every group bit-identical.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from workers.helpers import FTLAUNCH, WORKER, run

from ftlaunch import env
from ftlaunch.launcher.agent import EventWriter, WorkerWatcher

pytestmark = pytest.mark.timeout(120)


def read_events(fd: int, want: str, timeout: float) -> list[dict]:
    events: list[dict] = []
    buf = b""
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    while time.monotonic() < deadline and not any(e.get("event") == want for e in events):
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.02)
            continue
        buf += chunk
        *lines, buf = buf.split(b"\n")
        events += [json.loads(line) for line in lines if line]
    return events


def test_the_watcher_reports_a_stopped_worker_and_then_its_exit() -> None:
    read_fd, write_fd = os.pipe()
    watcher = WorkerWatcher(EventWriter(write_fd))
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, env.TORCHELASTIC_RUN_ID: "t", env.RANK: "0"},
    )
    watcher.start()
    try:
        events = read_events(read_fd, "workers", 30)
        assert any(e["event"] == "workers" and e["pids"] == {"0": child.pid} for e in events), events
        time.sleep(0.3)  # the wait thread is in waitid
        child.send_signal(signal.SIGSTOP)
        events = read_events(read_fd, "worker_stopped", 30)
        stopped = [e for e in events if e["event"] == "worker_stopped"]
        assert stopped and stopped[0]["pid"] == child.pid and stopped[0]["signal"] == "SIGSTOP", events
        child.kill()
        events = read_events(read_fd, "worker_exit", 30)
        exits = [e for e in events if e["event"] == "worker_exit"]
        assert exits and exits[0]["signal"] == "SIGKILL" and exits[0]["failed"] is True, events
        assert child.wait(5) == -signal.SIGKILL  # the watcher never reaped it
    finally:
        child.kill()
        child.wait()
        watcher.stop()
        os.close(read_fd)
        os.close(write_fd)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill_stopped_restarts_a_stopped_group_and_the_job_finishes(tmp_path) -> None:
    res = run(
        [
            *FTLAUNCH,
            "--replicas",
            "2",
            "--max-restarts",
            "3",
            "--kill-stopped",
            "--no-status",
            "--chaos",
            "every=2,count=1,group=1,signal=STOP,stop_for=100",
            WORKER,
            "--out",
            str(tmp_path),
            "--steps",
            "80",
            "--step-time",
            "0.1",
            "--checksum",
            "same",
        ],
        timeout=350,
    )
    assert res.returncode == 0, res.stderr
    assert re.search(
        r"replica group 1: rank 0 \(pid \d+\) stopped by SIGSTOP; killed \(--kill-stopped\)", res.stderr
    ), res.stderr
    assert "2/2 groups ended bit-identical (same)" in res.stdout, res.stdout

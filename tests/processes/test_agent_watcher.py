"""The agent's `WorkerWatcher` with real child processes: it reports each generation of workers and
each exit, and lists its children often only while it expects workers (the
agent's polling took ~8% of a core from training and from a restarting group's imports)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from ftlaunch.launcher.agent import EventWriter, WorkerWatcher


def _worker(rank: int) -> subprocess.Popen[bytes]:
    worker_env = {**os.environ, "TORCHELASTIC_RUN_ID": "watcher-test", "RANK": str(rank),
                  "LOCAL_RANK": str(rank),
                  "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=worker_env)


def _until(what: Callable[[], bool], timeout: float, why: str) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, why
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_the_watcher_reports_workers_and_exits_and_idles_while_all_run() -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    events: list[dict] = []
    buf = b""

    def drain() -> list[dict]:
        nonlocal buf
        try:
            buf += os.read(read_fd, 65536)
        except BlockingIOError:
            pass
        *lines, buf = buf.split(b"\n")
        events.extend(json.loads(line) for line in lines if line)
        return events

    watcher = WorkerWatcher(EventWriter(write_fd))
    procs = [_worker(0), _worker(1)]
    try:
        assert watcher._looking()  # nothing found yet: look every tick
        watcher.start()
        _until(lambda: {p.pid for e in drain() if e["event"] == "workers" for p in procs
                        if str(p.pid) in map(str, e["pids"].values())} == {p.pid for p in procs}, 60,
               "the watcher never reported both workers")  # fmt: skip
        _until(lambda: not watcher._looking(), 10, "all workers run, yet the watcher keeps looking")
        procs[1].send_signal(signal.SIGKILL)  # not reaped here: the watcher reads its status (WNOWAIT)
        _until(lambda: any(e["event"] == "worker_exit" and e["pid"] == procs[1].pid for e in drain()), 30,
               "the exit was not reported")  # fmt: skip
        exit_event = next(e for e in events if e["event"] == "worker_exit")
        assert exit_event["signal"] == "SIGKILL" and exit_event["failed"] is True
        procs[1].wait()
        assert watcher._looking()  # one of two is gone: the next generation is looked for at once
        procs.append(_worker(1))
        _until(lambda: any(e["event"] == "workers" and str(procs[2].pid) in map(str, e["pids"].values())
                           for e in drain()), 30, "the replacement was not reported")  # fmt: skip
        _until(lambda: not watcher._looking(), 10, "back to two workers, yet the watcher keeps looking")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        watcher.stop()
        os.close(read_fd)
        os.close(write_fd)
    assert not watcher.is_alive()

"""Helpers shared by the launcher / rendezvous / torchx tests: run commands with a hard bound and
kill their whole process tree if they overrun, read the test worker's environment records."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "workers", "worker.py")
FTLAUNCH = [sys.executable, "-m", "ftlaunch.launcher.cli"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def run(cmd: list[str], timeout: float, cwd: str = REPO, env: dict[str, str] | None = None) -> Result:
    """Run ``cmd`` to completion; on timeout kill its whole tree and raise."""
    return finish(start(cmd, cwd, env), timeout)


def start(cmd: list[str], cwd: str = REPO, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"{proc.args} did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}"
        ) from None
    return Result(proc.returncode, out, err)


def records(out_dir: str) -> list[dict]:
    """The worker's env records, each with ``group``, ``rank``, ``restart`` parsed from its name."""
    found = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as f:
            rec = json.load(f)
        e = rec["env"]
        rec["group"] = int(e.get("REPLICA_GROUP_ID", "-1"))
        rec["rank"] = int(e.get("RANK", "-1"))
        rec["restart"] = int(e.get("TORCHELASTIC_RESTART_COUNT", "0"))
        found.append(rec)
    return found


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def interrupt(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    os.kill(proc.pid, sig)

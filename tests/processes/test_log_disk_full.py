"""A full log disk: training goes on, the failure is reported once, nothing crashes.

Real ENOSPC each time: ``/dev/full`` for a stream (every write fails with ENOSPC), and a tiny
tmpfs under ``ftlaunch --log-dir`` that the test fills while the job trains (skipped where this
process may not mount one). Before: every worker's next ``print`` raised ``OSError: [Errno 28]``
(all groups crashed and crashed again after their restarts), an agent died writing its result
file, and the supervisor died with a traceback writing a respawned agent's config.
"""

from __future__ import annotations

import errno
import glob
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from workers.helpers import FTLAUNCH, REPO, finish, kill_tree, start, wait_for

from ftlaunch.launcher.logdisk import LogDiskWatch, write_or_none
from ftlaunch.launcher.output import Console
from ftlaunch.streams import FullDiskTolerantStream

WORKER = str(Path(REPO) / "tests" / "workers" / "worker.py")


class Flaky(io.StringIO):
    """A stream whose writes fail with ``errno`` while ``failing``."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: int | None = None

    def write(self, s: str) -> int:
        if self.failing is not None:
            raise OSError(self.failing, os.strerror(self.failing))
        return super().write(s)


def test_a_guarded_stream_drops_what_a_full_disk_refuses_and_says_so_once_it_can() -> None:
    inner = Flaky()
    s = FullDiskTolerantStream(inner)  # type: ignore[arg-type]
    s.write("before\n")
    inner.failing = errno.ENOSPC
    assert s.write("lost 1\n") == 7 and s.write("lost 2\n") == 7
    s.flush()
    inner.failing = None
    s.write("after\n")
    s.write("more\n")
    text = inner.getvalue()
    assert text.startswith(
        "before\n[ftlaunch] 14 characters of output were dropped here: No space left on device"
    )
    assert text.endswith("training went on\nafter\nmore\n") and text.count("[ftlaunch]") == 1
    assert s.episodes == 1
    inner.failing = errno.EBADF  # anything else still raises
    with pytest.raises(OSError, match="Bad file descriptor"):
        s.write("x")


def test_a_worker_whose_stdout_is_a_full_disk_trains_on(tmp_path: Path) -> None:
    """Through `ftlaunch.bootstrap.prestart` (how the launcher runs every Python worker), a script that
    prints to /dev/full (every write: ENOSPC) runs to its end and exits 0."""
    script = "import sys\nfor i in range(200): print('step', i, flush=True)\nsys.stderr.write('done\\n')\n"
    env = {**os.environ, "FTLAUNCH_BACKEND": "nccl"}  # no Baby child needed here
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", "-c-unused"],
            stdout=full,
            stderr=subprocess.PIPE,
            env=env,
            timeout=60,
            check=False,
            cwd=REPO,
        )
        assert done.returncode != 0  # (a missing script is still an error)
        path = tmp_path / "full_disk_script.py"
        path.write_text(script)
        ok = subprocess.run(
            [sys.executable, "-u", "-m", "ftlaunch.bootstrap.prestart", str(path)],
            stdout=full,
            stderr=full,
            env=env,
            timeout=60,
            check=False,
            cwd=REPO,
        )
    assert ok.returncode == 0


def test_the_supervisors_console_and_files_survive_a_full_disk(tmp_path: Path) -> None:
    # Unbuffered like the supervisor's stdout under `python -u`: every write reaches the disk.
    with io.TextIOWrapper(open("/dev/full", "wb", buffering=0), write_through=True) as full:
        console = Console(out=full, err=full, status=False)
        console.out("a line nobody can write")  # before: OSError out of the supervisor's loop
        console.err("another")
    assert write_or_none("/dev/full", "{}") is None  # the agent's config then travels via stdin
    assert write_or_none(str(tmp_path / "g" / "agent0.json"), "{}") == str(tmp_path / "g" / "agent0.json")
    said: list[str] = []
    watch = LogDiskWatch(str(tmp_path), said.append)
    watch.poll(0.0)
    assert said == [] and not watch.full


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root and mount(2) needed: skipped otherwise)."""
    mnt = tmp_path / "logs"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, check=False
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ftlaunch_trains_on_when_its_log_dir_fills_up(full_disk: Path) -> None:
    """Two groups train with ``--log-dir`` on a tmpfs; the test fills it once both print, then kills
    one group's agent (its respawn needs a config file the disk cannot take). The job still ends
    with exit 0, the full disk is reported once, and no ftlaunch process dies with a traceback."""
    logs = full_disk / "job"
    proc = start(
        [
            *FTLAUNCH,
            "--nproc-per-node",
            "1",
            "--replicas",
            "2",
            "--max-restarts",
            "3",
            "--log-dir",
            str(logs),
            WORKER,
            "--steps",
            "150",
            "--step-time",
            "0.1",
        ]
    )
    try:

        def printing() -> bool:
            files = glob.glob(str(logs / "rg*" / "workers" / "*" / "attempt_*" / "0" / "stdout.log"))
            return len(files) == 2 and all(os.path.getsize(f) > 200 for f in files)

        wait_for(printing, 120, "both groups printing to the log dir")
        fill(full_disk)
        agent = next(
            p
            for p in psutil.Process(proc.pid).children()
            if "ftlaunch.launcher.agent" in " ".join(p.cmdline()) and "/rg1/" in " ".join(p.cmdline())
        )
        time.sleep(1.0)  # a few steps print into the full disk first
        agent.send_signal(signal.SIGKILL)
        result = finish(proc, 240)
    finally:
        kill_tree(proc.pid)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count("is full") == 1, out[-4000:]
    assert "respawning it" in out and "Traceback" not in out and "OSError" not in out, out[-4000:]
    assert "[ftlaunch] summary: exit 0" in out

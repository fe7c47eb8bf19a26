"""Durable checkpoints through the real launcher: a whole job SIGKILLed (the ``ftlaunch`` supervisor
and every process under it), then the same command again, resumes from the newest complete
checkpoint and ends bit-identical to a run that was never interrupted (scripts/train_ddp.py:
deterministic data, the sampler's position saved with the state). The slow variants come back with
another number of replica groups and with a hot spare."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from workers.helpers import FTLAUNCH, finish, kill_tree, start, wait_for

from ftlaunch.checkpointing import durable_plan as dp

pytestmark = pytest.mark.timeout(400)

STEP_LINE = re.compile(r"^\[rg(\d)/r0\] step=(\d+) committed=True")
CHECKSUM = re.compile(r"final_checksum=(\w+) step=(\d+)")
STEPS = 16
EVERY = 5


def command(ckpt: Path | None, replicas: int = 2, spares: int = 0, steps: int = STEPS) -> list[str]:
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)] if ckpt else []
    return [
        *FTLAUNCH, "--replicas", str(replicas), "--spares", str(spares), "--no-status", *durable,
        "scripts/train_ddp.py", "--steps", str(steps), "--step-sleep", "0.05",
    ]  # fmt: skip


class Job:
    """``ftlaunch`` running, its stdout read as it comes."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = start(cmd)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def step(self) -> int:
        steps = [int(m[2]) for line in list(self.lines) if (m := STEP_LINE.match(line))]
        return max(steps, default=-1)


def checksums(out: str) -> set[str]:
    return {m[1] for m in CHECKSUM.finditer(out)}


def kill_whole_job_after_a_checkpoint(ckpt: Path, replicas: int = 2, spares: int = 0) -> int:
    """Run the job until a checkpoint past step 0 is published and a step after it committed, then
    SIGKILL the launcher and every process under it. Returns the newest checkpoint's step."""
    ckpt.mkdir()
    job = Job(command(ckpt, replicas, spares))
    try:
        wait_for(
            lambda: dp.list_dir(p.name for p in ckpt.iterdir()).complete and job.step() > EVERY,
            240, "a durable checkpoint and a step after it",
        )  # fmt: skip
    finally:
        kill_tree(job.proc.pid)
        job.proc.wait(timeout=30)
    saved = dp.list_dir(p.name for p in ckpt.iterdir()).complete
    assert saved and max(saved) < STEPS, f"the job was not killed before its end (saved {saved})"
    return max(saved)


def test_whole_job_killed_resumes_bit_identical(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved = kill_whole_job_after_a_checkpoint(ckpt)
    resumed = finish(start(command(ckpt)), 240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resumed from durable checkpoint {ckpt / dp.dir_name(saved)} (step {saved})"
        in resumed.stdout + resumed.stderr
    )
    first = min(int(m[2]) for line in resumed.stdout.splitlines() if (m := STEP_LINE.match(line)))
    assert first == saved + 1  # no step redone beyond what the checkpoint missed, none skipped
    # The job ended at a step off the interval: the finished model is on disk all the same.
    assert STEPS % EVERY and max(dp.list_dir(p.name for p in ckpt.iterdir()).complete) == STEPS
    assert f"durable checkpoints: last at step {STEPS} " in resumed.stdout, resumed.stdout[-2000:]

    fresh = finish(start(command(None)), 240)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert len(checksums(fresh.stdout)) == 1
    assert checksums(resumed.stdout) == checksums(fresh.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(("replicas", "spares"), [(1, 0), (3, 0), (2, 1)])
def test_resume_with_another_number_of_groups_or_a_spare(tmp_path: Path, replicas: int, spares: int) -> None:
    ckpt = tmp_path / "ckpt"
    saved = kill_whole_job_after_a_checkpoint(ckpt)
    resumed = finish(start(command(ckpt, replicas, spares)), 300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stdout.splitlines()
    logs = (resumed.stdout + resumed.stderr).splitlines()
    assert sum("resumed from durable checkpoint" in line for line in logs) == replicas  # not the spare
    first = min(int(m[2]) for line in lines if (m := STEP_LINE.match(line)))
    assert first == saved + 1
    assert len(checksums(resumed.stdout)) == 1  # every group ended bit-identical

"""Durable checkpoints keep a run deterministic across a whole-job loss, for the sharded and the
periodic-sync ways of training: real processes, real SIGKILLs, the real launcher.

The job runs with ``--checkpoint-dir`` until a checkpoint past step 0 is published and a step after
it committed; then the ``ftlaunch`` supervisor and every process under it are SIGKILLed. The same
command run again resumes from the newest complete checkpoint and ends, at the same final step,
bit-identical to a run of that command that was never interrupted (deterministic data):

* 2x2 HSDP (scripts/train_hsdp.py: FSDP2 inside each group of two workers, on CPU/Gloo): each rank
  writes and reads its own shards;
* DiLoCo (scripts/train_diloco.py, AdamW inner optimizer; its Manager's steps are syncs): the
  checkpoint is taken right after a sync's outer step; the writer saves the global state, and
  each group its own model and Adam moments beside it, which it loads back at resume;
* LocalSGD (the same script, SGD with momentum; slow): the same, right after an average.

The DDP variant is tests/processes/test_durable_e2e.py.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from workers.helpers import FTLAUNCH, finish, kill_tree, start, wait_for

from ftlaunch.checkpointing import durable_plan as dp

pytestmark = pytest.mark.timeout(600)

CHECKSUM = re.compile(r"^\[rg(\d+)/r0\] final_checksum=(\w+) step=(\d+)", re.M)
STEP_LINE = re.compile(r"^\[rg(\d+)/r0\] step=(\d+) committed=True")


def hsdp(ckpt: Path | None) -> list[str]:
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"] if ckpt else []
    return [
        *FTLAUNCH, "--replicas", "2", "--nproc-per-node", "2", "--no-status", *durable,
        "scripts/train_hsdp.py", "--steps", "12", "--layers", "2", "--d-model", "64", "--step-sleep", "0.1",
    ]  # fmt: skip


def diloco(ckpt: Path | None, algorithm: str = "diloco", replicas: int = 2) -> list[str]:
    # Steps of the job's Manager are syncs: 40 inner steps, a sync every 4, a checkpoint every 2 syncs.
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"] if ckpt else []
    return [
        *FTLAUNCH, "--replicas", str(replicas), "--no-status", *durable, "scripts/train_diloco.py",
        "--algorithm", algorithm, "--steps", "40", "--sync-every", "4", "--step-sleep", "0.03",
    ]  # fmt: skip


def local_sgd(ckpt: Path | None) -> list[str]:
    return diloco(ckpt, "local_sgd")  # SGD with momentum: each group's momentum is its own


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
        return max((int(m[2]) for line in list(self.lines) if (m := STEP_LINE.match(line))), default=-1)


def final_checksums(out: str) -> dict[int, tuple[str, int]]:
    """Group -> (final checksum, final step) of its rank 0."""
    return {int(m[1]): (m[2], int(m[3])) for m in CHECKSUM.finditer(out)}


def killed_and_resumed_matches_uninterrupted(
    tmp_path: Path,
    command: Callable[[Path | None], list[str]],
    per_step: int = 1,
    first_after: Callable[[int], int] = lambda saved: saved + 1,
    groups_save: bool = False,
) -> None:
    """``per_step``: the steps a step line counts per step of the Manager (DiLoCo's lines count
    inner steps, its Manager's steps are syncs). ``first_after``: the first step line due after
    resuming from the checkpoint of a step. ``groups_save``: each group also saves its own state
    beside the job's checkpoint (LocalSGD, DiLoCo): kill once both have."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    job = Job(command(ckpt))
    try:
        wait_for(
            lambda: (done := dp.list_dir(p.name for p in ckpt.iterdir()).complete)
            and job.step() > done[0] * per_step
            and (not groups_save or saved_by_both(ckpt)),
            300, "a durable checkpoint and a step after it",
        )  # fmt: skip
    finally:
        kill_tree(job.proc.pid)  # the supervisor and every process under it
        job.proc.wait(timeout=30)
    saved = max(dp.list_dir(p.name for p in ckpt.iterdir()).complete)
    assert not final_checksums("".join(job.lines)), "the job ended before the kill"

    resumed = finish(start(command(ckpt)), 400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    logs = resumed.stdout + resumed.stderr
    assert f"resumed from durable checkpoint {ckpt / dp.dir_name(saved)} (step {saved})" in logs
    first = min(int(m[2]) for line in resumed.stdout.splitlines() if (m := STEP_LINE.match(line)))
    assert first == first_after(saved)  # no step trained twice after the checkpoint, none skipped

    fresh = finish(start(command(None)), 400)
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    want, got = final_checksums(fresh.stdout), final_checksums(resumed.stdout)
    assert set(want) == set(got) == {0, 1} and len(set(want.values())) == 1, (want, got)
    assert got == want, (got, want)


@pytest.mark.slow  # DDP and DiLoCo stay in CI
def test_hsdp_2x2_killed_whole_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    killed_and_resumed_matches_uninterrupted(tmp_path, hsdp)


def test_diloco_killed_whole_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    # The checkpoint of step S is taken after the sync that committed it: the job's S - 1st sync
    # (its first step was the join), whose line counts (S - 1) x 4 inner steps; the next is S x 4.
    killed_and_resumed_matches_uninterrupted(
        tmp_path, diloco, per_step=4, first_after=lambda s: s * 4, groups_save=True
    )


@pytest.mark.slow
def test_local_sgd_killed_whole_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    killed_and_resumed_matches_uninterrupted(
        tmp_path, local_sgd, per_step=4, first_after=lambda s: s * 4, groups_save=True
    )


def saved_by_both(ckpt: Path) -> bool:
    """Whether the newest job checkpoint has both groups' own state (written beside it, in turn)."""
    done = dp.list_dir(p.name for p in ckpt.iterdir()).complete
    return bool(done) and all((ckpt / dp.group_dir_name(g) / dp.dir_name(done[-1])).is_dir() for g in (0, 1))


@pytest.mark.slow
def test_diloco_resumed_with_more_groups_the_new_one_keeps_the_writers_inner_state(tmp_path: Path) -> None:
    """Saved by 2 groups, resumed by 3: groups 0 and 1 load their own inner state, group 2 (none
    saved) says so in one line and keeps the writer group's; the job ends with every group's global
    state identical."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    job = Job(diloco(ckpt))
    try:
        wait_for(lambda: saved_by_both(ckpt), 300, "a durable checkpoint and both groups' own state of it")
    finally:
        kill_tree(job.proc.pid)
        job.proc.wait(timeout=30)
    resumed = finish(start(diloco(ckpt, replicas=3)), 400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    logs = resumed.stdout + resumed.stderr
    own = re.findall(r"\[rg(\d)/r0\].*durable checkpoint of step \d+: loaded this group's own default", logs)
    none = re.findall(r"\[rg(\d)/r0\].*no state of this group's own \(none was saved\)", logs)
    assert sorted(own) == ["0", "1"] and none == ["2"], (own, none)
    got = final_checksums(resumed.stdout)
    assert set(got) == {0, 1, 2} and len(set(got.values())) == 1, got

"""Every group lost while the job runs, with durable checkpoints: real processes, real SIGKILLs, the
real launcher (scripts/train_ddp.py under ``ftlaunch --replicas 2 --checkpoint-dir D``).

Both groups are SIGKILLed at once after a checkpoint was published; their agents restart them in
the same ``ftlaunch`` job. No live group holds the state, so the restarted groups resume from the
newest checkpoint -- not from step 0 -- (a group that comes back after the other asked its quorum
heals from it, live). The first group back waits for the other before it trains (the lighthouse
waits for the previous quorum's members while no live group holds the job's state), so the job
trains every step after the checkpoint with both groups, as the uninterrupted run did: it ends
bit-identical to that run (deterministic data, drawn by the exactly-once sampler over the groups
of each step's quorum). The summary says the job resumed from the durable checkpoint and how many
steps it trained again, not that progress was lost.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from processes.test_lost_progress import STEP_LINE, Job
from workers.helpers import FTLAUNCH, finish, start, wait_for

from ftlaunch.checkpointing import durable_plan as dp

pytestmark = pytest.mark.timeout(400)

STEPS = 40
EVERY = 10
CHECKSUM = re.compile(r"final_checksum=(\w+) step=(\d+)")


def uninterrupted() -> set[str]:
    """The final checksums of the same training run to its end without a failure."""
    cmd = [*FTLAUNCH, "--replicas", "2", "--no-status", "scripts/train_ddp.py", "--steps", str(STEPS)]
    fresh = finish(start(cmd), 240)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    return {m[1] for m in CHECKSUM.finditer(fresh.stdout)}


def test_both_groups_killed_resume_from_the_durable_checkpoint_bit_identical(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)]
    job = Job(tmp_path, steps=STEPS, extra=durable)
    try:
        wait_for(
            lambda: EVERY in dp.list_dir(p.name for p in ckpt.iterdir()).complete
            and min(job.step(0), job.step(1)) >= EVERY + 2,
            150, "the checkpoint of step 10 and step 12 in both groups", interval=0.1,
        )  # fmt: skip
        mark = len(job.lines)  # what was printed before the kills
        job.kill(0)
        job.kill(1)
        reached = max(job.step(0), job.step(1))
        saved = max(dp.list_dir(p.name for p in ckpt.iterdir()).complete)
        assert reached < STEPS, "the job ended before the kills"
        code, out, err = job.finish(240)
    except subprocess.TimeoutExpired:
        job.close()
        raise
    finally:
        job.close()
    assert code == 0, out[-4000:] + err[-4000:]
    # After the kills no group trains a step at or below the checkpoint again (never from step 0),
    # and the job's first step follows the checkpoint: the group back first loaded it; a group back
    # later healed live from a peer, possibly already past it (lines the killed processes flushed
    # late are of steps past the checkpoint too).
    after = [int(m[2]) for line in job.lines[mark:] if (m := STEP_LINE.match(line))]
    assert after and min(after) == saved + 1, (saved, after[:20])
    resumed = err.count(f"resumed from durable checkpoint {ckpt / dp.dir_name(saved)}") + out.count(
        f"resumed from durable checkpoint {ckpt / dp.dir_name(saved)}"
    )
    assert resumed >= 1
    note = re.search(
        r"\[ftlaunch\] note: at t=[\d.]+s no replica group holding the trained state of step (\d+) was left; "
        rf"the job resumed from the durable checkpoint of step {saved} and trained (\d+) step\(s\) again",
        out,
    )
    assert note, out[-4000:]
    assert int(note[2]) == int(note[1]) - saved
    assert "progress lost" not in out.lower() and "PROGRESS LOST" not in out
    assert "2/2 groups ended bit-identical" in out
    # Both groups trained every step after the checkpoint together: the run it repeats, bit for bit.
    ended = {m[1] for line in job.lines[mark:] if (m := CHECKSUM.search(line))}
    assert len(ended) == 1 and ended == uninterrupted(), ended

"""A replica group SIGKILLed while it writes the job's durable checkpoint: real processes, a real
kill, the real launcher (scripts/train_ddp.py, a width-2048 MLP so that a save takes a while, under
``ftlaunch --replicas 2 --checkpoint-dir D``).

The kill lands as soon as the writer's temporary directory appears. Either its save completed
first, or it never becomes visible and the next due save is written by a group alive then (the
survivor: the writer is chosen from the committed quorum, so a dead writer's turn passes on).
Either way the job ends with a complete checkpoint past the killed one, every group ends
bit-identical, and the survivor never stops committing: it never waits for the writer. Its longest
gap between two committed steps around the kill is printed beside its usual step time (measured,
not asserted: the machine may be loaded).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from processes.test_lost_progress import Job
from workers.helpers import wait_for

from ftlaunch.checkpointing import durable_plan as dp

pytestmark = pytest.mark.timeout(400)

STEPS = 60
EVERY = 10
COMMITTED = re.compile(r"^\[rg(\d)/r0\] step=(\d+) committed=True .* t=([\d.]+)")


def test_a_group_killed_while_it_saves_the_save_completes_or_passes_on_and_the_survivor_never_stalls(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    durable = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--checkpoint-keep", "0"]
    job = Job(tmp_path, steps=STEPS, extra=durable, script=["--width", "2048"])
    try:
        assert job.proc.poll() is None
        # Past the first save (both groups up, the writer rotating), a save in progress: kill its writer.
        wait_for(lambda: min(job.step(0), job.step(1)) > EVERY, 200, "both groups past step 10", interval=0.1)
        saving: list[int] = []

        def writing() -> bool:
            listing = dp.list_dir(p.name for p in ckpt.iterdir())
            saving[:] = [s for s in listing.tmp if s > EVERY]
            return bool(saving)

        wait_for(writing, 200, "a durable checkpoint being written", interval=0.002)
        step = saving[0]
        writer = dp.writer_index(step, EVERY, 2)  # rg0 and rg1 participate, in that order
        killed_at = time.time()
        job.kill(writer)
        survivor = 1 - writer
        code, out, err = job.finish(300)
    except subprocess.TimeoutExpired:
        job.close()
        raise
    finally:
        job.close()
    assert code == 0, out[-4000:] + err[-4000:]
    complete = dp.list_dir(p.name for p in ckpt.iterdir()).complete
    assert step in complete or any(s > step for s in complete), (step, complete)
    later = [s for s in complete if s > step]
    assert later, f"no checkpoint after the one of step {step} (complete: {complete})"
    assert "2/2 groups ended bit-identical" in out

    # The survivor kept committing through the kill: its steps after it, and the gaps around it.
    times = [
        (int(m[2]), float(m[3]))
        for line in out.splitlines()
        if (m := COMMITTED.match(line)) and int(m[1]) == survivor
    ]
    after = [s for s, t in times if t > killed_at]
    assert after and max(after) == STEPS, "the survivor did not train on to the end"
    gaps = [
        b[1] - a[1]
        for a, b in zip(times, times[1:], strict=False)
        if b[1] > killed_at - 1 and a[1] < killed_at + 10
    ]
    usual = sorted(b[1] - a[1] for a, b in zip(times, times[1:], strict=False) if b[1] < killed_at - 1)
    median = usual[len(usual) // 2] if usual else float("nan")
    print(
        f"\nkilled rg{writer} while it wrote the checkpoint of step {step} "
        f"({'completed' if step in complete else 'never published'}); next checkpoints {later}; "
        f"survivor rg{survivor}: longest gap between committed steps around the kill "
        f"{max(gaps) * 1e3:.0f} ms, median step before it {median * 1e3:.0f} ms"
    )

"""Stragglers with real processes: ``ftlaunch --stragglers replace --chaos ...slow=...`` running
scripts/train_ddp.py, one group's workers throttled by the SIGSTOP/SIGCONT duty cycle
(ftlaunch.launcher.throttle). The lighthouse finds the group slow from the compute times its
leader reports and replaces it -- its slot to the hot spare, or, without one, a restart -- and the
job ends with the training groups bit-identical. The throttle's stops are never taken for a hang.
The rule itself: tests/unit/test_stragglers.py; the membership applying it:
tests/unit/test_stragglers_membership.py.
"""

from __future__ import annotations

import re
import signal

import pytest
from test_spares_mp import TRAIN, assert_bit_identical, check_data, final_slots, jobs, takeovers

__all__ = ["jobs"]  # the fixture, for the tests below

#: The slowed group's own work per step is this many times the others' (a strong signal: the
#: machine running the tests is shared, and a loaded CPU makes every group's time noisy).
FACTOR = 3


def train(steps: int) -> list[str]:
    # 20 ms of CPU work per step: what the throttle slows (a sleep would pass while stopped). The
    # fixed shards: `check_data` follows each slot's shard (the exactly-once sampler with spares:
    # tests/processes/test_exactly_once_mp.py).
    return [TRAIN, "--steps", str(steps), "--width", "64", "--compute-ms", "20", "--sampler", "shard"]


def no_hang(text: str) -> None:
    """The duty cycle's stops (200 ms at most) are slowness: no hang reported, nobody declared hung."""
    assert "stopped by SIGSTOP" not in text, text[-6000:]
    assert "hung: " not in text, text[-6000:]


@pytest.mark.timeout(180)
def test_a_slowed_group_is_found_and_its_slot_goes_to_the_spare(jobs) -> None:
    """The short run: group 1 slowed 2x from step 3 (its worker is a fork of the agent's warm
    standby: the throttle must stop that fork, in its work); the lighthouse finds it a straggler
    and, once it stayed one for 10 steps and 15 s, gives its slot to the hot spare, whose first step
    commits; then the user stops the job (SIGINT) and the summary tells the replacement. The full
    run to the end, bit-identical: the slow-marked test below."""
    job = jobs(["--replicas", "2", "--spares", "1", "--stragglers", "replace",
                "--chaos", "steps=3,group=1,slow=2,slow_for=600", *train(100000)])  # fmt: skip
    job.wait_for(r"^\[ftlaunch\] chaos: replica group 1 workers slowed down 2x", 90)
    job.wait_for(
        r"^\[ftlaunch\] replica group rg1 replaced as a straggler .*: its slot went to a hot spare$", 90
    )
    job.wait_for(r"^\[rg2/r0\] step=\d+ committed=True", 30)  # the spare, in slot 1, committed
    job.proc.send_signal(signal.SIGINT)
    job.proc.wait(timeout=60)
    text = job.text()
    assert takeovers(text)[0] == (2, "g2.0", 1, "rg1.1", "rg1"), takeovers(text)
    no_hang(text)
    told = (
        r"^\[ftlaunch\] straggler rg1 \([\d.]+x slower\) replaced: its slot went to a hot spare, whose first"
    )
    assert re.search(told + r" step committed [\d.]+s later", text, re.M), text[-3000:]


@pytest.mark.slow  # a 2-core host under load blurs a 3x slowdown (the verdict then comes late or never)
@pytest.mark.timeout(300)
def test_a_slowed_group_is_replaced_by_the_spare_and_the_job_ends_bit_identical(jobs) -> None:
    """320 steps: a slowed group's steps are only its own work slower, and the replacement takes
    ~20 s (a straggler for 10 steps and 15 s): the job must last that long on a quiet host too."""
    job = jobs(["--replicas", "2", "--spares", "1", "--stragglers", "replace",
                "--chaos", f"steps=8,group=1,slow={FACTOR},slow_for=600", *train(320)])  # fmt: skip
    text = job.finish(280)
    assert re.search(r"^\[ftlaunch\] chaos: replica group 1 workers slowed down 3x for 600s", text, re.M), (
        text[-4000:]
    )
    found = re.findall(r"^\[ftlaunch\] replica group (\S+) is a straggler: ([\d.]+)x slower", text, re.M)
    assert found and found[0][0] == "rg1" and float(found[0][1]) >= 1.5, found
    replaced = re.findall(r"^\[ftlaunch\] replica group (\S+) replaced as a straggler .*: (.*)$", text, re.M)
    assert replaced and replaced[0] == ("rg1", "its slot went to a hot spare"), replaced
    # The spare (agent 2) took slot 1 under a new name; the straggler's name is fenced.
    assert takeovers(text)[0] == (2, "g2.0", 1, "rg1.1", "rg1"), takeovers(text)
    assert re.search(r"^\[rg1/r0\] .*replica rg1 was (replaced|evicted)", text, re.M), text[-4000:]
    no_hang(text)
    slots = final_slots(text, 2)
    assert_bit_identical(text, slots)
    check_data(text, 2)
    assert re.search(r"^\[ftlaunch\] straggler rg1 \([\d.]+x slower\) replaced: its slot went to a hot "
                     r"spare, "
                     r"whose first step committed [\d.]+s later", text, re.M), text[-3000:]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_without_a_spare_the_straggler_is_restarted_and_rejoins(jobs) -> None:
    """No spare waits: the straggler is told to end its process (as the dashboard's Kill does); its
    agent restarts it -- no longer slowed: the slowdown stays with the processes -- and it heals."""
    job = jobs(["--replicas", "3", "--stragglers", "replace",
                "--chaos", f"steps=8,group=1,slow={FACTOR},slow_for=600", *train(320)])  # fmt: skip
    text = job.finish(380)
    replaced = re.findall(r"^\[ftlaunch\] replica group (\S+) replaced as a straggler .*: (.*)$", text, re.M)
    assert replaced and replaced[0] == ("rg1", "told to restart (no hot spare waited)"), replaced
    assert re.search(r"lighthouse client: rg1 killed on the lighthouse's request: straggler: ", text), text[
        -4000:
    ]
    no_hang(text)
    assert re.search(r"^\[ftlaunch\] 3/3 groups ended bit-identical", text, re.M), text[-3000:]

"""The group leader's side of progress reporting (ftlaunch.worker.progress), in one process."""

from __future__ import annotations

import torch

from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.worker.progress import ProgressTracker, state_checksum


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_milestones_become_reports() -> None:
    sent: list[ProgressReport] = []
    clock = Clock()
    t = ProgressTracker(sent.append, clock=clock)
    t.step_started()
    clock.now = 0.3
    t.quorum_done(fetch_seconds=0.25)  # this step healed: 0.25 s of its quorum time was the fetch
    t.commit_started()
    clock.now = 0.5
    t.committed(step=8, healed=True)
    t.step_started()
    clock.now = 0.6
    t.quorum_done()
    t.commit_started()
    clock.now = 0.65
    t.committed(step=9, healed=False)
    first, second = sent
    assert (first.step, first.commits, first.heals, first.heal_seconds) == (8, 1, 1, 0.25)
    assert (first.step_seconds, first.quorum_seconds, first.commit_seconds) == (0.5, 0.3, 0.2)
    assert (second.step, second.commits, second.heals, second.heal_seconds) == (9, 2, 1, 0.25)
    assert second.session == first.session == t.session and not second.finished


def test_final_report_claims_a_checksum_only_for_a_clean_exit() -> None:
    sent: list[ProgressReport] = []
    t = ProgressTracker(sent.append)
    t.step_started()
    t.quorum_done()
    t.commit_started()
    t.committed(step=1, healed=False)
    state = {"default": {"model": {"w": torch.ones(3)}}, "sampler": {"position": 5}}
    clean = t.finish(1, lambda: state)
    assert clean.finished and len(clean.checksum) == 16 and clean.commits == 1
    dirty = ProgressTracker(sent.append).finish(1, None)
    assert not dirty.finished and dirty.checksum == ""


def test_state_checksum_sees_every_tensor_and_nothing_else() -> None:
    a = {"m": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2)}, "pos": 1}
    same = {"pos": 99, "m": {"b": torch.zeros(2), "w": torch.arange(6.0).reshape(2, 3)}}
    assert state_checksum(a) == state_checksum(same)  # key order and plain numbers do not count
    changed = {"m": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([0.0, 1e-30])}}
    assert state_checksum(changed) != state_checksum(a)
    reshaped = {"m": {"w": torch.arange(6.0).reshape(3, 2), "b": torch.zeros(2)}}
    assert state_checksum(reshaped) != state_checksum(a)
    big = {"w": torch.randn(100_000)}  # past one 64 KiB checksum block
    assert state_checksum(big) == state_checksum({"w": big["w"].clone()})


def test_compute_is_the_groups_own_work_before_it_needs_the_others() -> None:
    """``compute_seconds``: from the previous decision to the step's first collective, less the time
    it waited for the quorum -- what tells a slow group from the fast ones that wait for it in the
    collectives (lighthouse/stragglers.py)."""
    sent: list[ProgressReport] = []
    clock = Clock()
    t = ProgressTracker(sent.append, clock=clock)
    t.step_started()  # the first step: its own work counts from here
    clock.now = 0.2
    t.waited(0.05)  # a synchronous quorum: waiting, not working
    clock.now = 0.3
    t.peers_needed()  # the first allreduce
    clock.now = 0.8
    t.waited(0.4)  # waits after it change nothing ...
    t.peers_needed()  # ... nor do later collectives
    t.commit_started()
    clock.now = 1.0
    t.committed(step=1, healed=False)
    assert sent[-1].compute_seconds == 0.25 and sent[-1].step_seconds == 1.0
    clock.now = 1.1  # the optimizer step, the next batch: the group's own work too
    t.step_started()
    clock.now = 1.2
    t.peers_needed()
    clock.now = 2.0
    t.not_committed()  # a failed step: the next one's work starts at its decision
    clock.now = 2.1
    t.step_started()
    clock.now = 2.15
    t.peers_needed()
    t.commit_started()
    clock.now = 2.5
    t.committed(step=2, healed=False)
    assert sent[-1].compute_seconds == 0.15

"""`LostPeerAbort` (worker/hang_abort.py) on its own: what a lost-peer notice starts, it stops.

A notice starts a watcher thread that waits for the step's ops to get stuck; nothing else ends it
while the quorum in use stays the same -- which is the case once the Manager shuts down. `close`
must end and join it (and an abort under way), whatever the timing: a gang closed right after a
notice left ``ftlaunch-lost-peer`` running under load.
"""

from __future__ import annotations

import threading
import time

import pytest

from ftlaunch.worker.hang_abort import LostPeerAbort

pytestmark = pytest.mark.timeout(30)


def _ours() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("ftlaunch-lost-peer"))


def test_close_ends_the_watcher_a_notice_started() -> None:
    aborts: list[int] = []
    watch = LostPeerAbort(lambda: aborts.append(1), stuck=lambda: False)
    watch.use(7)
    assert watch.lost(7, ("rg1",))
    assert _ours() == ["ftlaunch-lost-peer"]  # waiting for an op of the step to get stuck
    start = time.monotonic()
    watch.close()
    assert time.monotonic() - start < 1.0
    assert _ours() == [] and aborts == []
    assert not watch.lost(8, ("rg1",)) and _ours() == []  # closed: a late notice starts nothing


def test_close_waits_for_an_abort_under_way() -> None:
    release = threading.Event()
    ended: list[float] = []

    def slow_abort() -> None:  # a plain Gloo abort can block for a while
        release.wait(5)
        ended.append(time.monotonic())

    watch = LostPeerAbort(slow_abort, stuck=lambda: True)
    watch.use(3)
    assert watch.lost(3, ("rg0",))
    deadline = time.monotonic() + 5
    while "ftlaunch-lost-peer-abort" not in _ours() and time.monotonic() < deadline:
        time.sleep(0.01)
    threading.Timer(0.3, release.set).start()
    watch.close()
    assert ended and _ours() == [] and watch.aborts == 1


def test_close_is_bounded_by_its_timeout() -> None:
    release = threading.Event()
    watch = LostPeerAbort(lambda: release.wait(10), stuck=lambda: True)
    watch.use(1)
    watch.lost(1, ("rg0",))
    deadline = time.monotonic() + 5
    while "ftlaunch-lost-peer-abort" not in _ours() and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    watch.close(timeout=0.3)
    assert 0.25 < time.monotonic() - start < 2.0  # an abort that never returns cannot hold shutdown
    release.set()


def test_a_rank_told_by_its_leader_aborts_an_op_stuck_outside_our_waits() -> None:
    """A Baby NCCL collective of DDP's backward or FSDP's gradient hook never fails by itself when a
    peer dies, and no wait of ours asks the leader: the rank's listener asks once an op is stuck."""
    aborted = threading.Event()
    stuck = threading.Event()
    asked: list[int] = []

    def told_by_leader(quorum_id: int) -> bool:
        asked.append(quorum_id)
        return True

    watch = LostPeerAbort(aborted.set, told_by_leader=told_by_leader, stuck=stuck.is_set)
    try:
        watch.use(5)
        time.sleep(0.35)
        assert asked == [] and not aborted.is_set()  # nothing stuck: the leader is not asked
        stuck.set()
        assert aborted.wait(3), "the stuck op was never aborted"
        assert asked[0] == 5 and watch.error is not None and "told by this group's leader" in str(watch.error)
    finally:
        watch.close()
    assert _ours() == []


def test_a_rank_whose_leader_said_nothing_keeps_waiting() -> None:
    aborts: list[int] = []
    watch = LostPeerAbort(lambda: aborts.append(1), told_by_leader=lambda q: False, stuck=lambda: True)
    try:
        watch.use(2)
        time.sleep(0.4)
        assert aborts == [] and watch.error is None
    finally:
        watch.close()
    assert _ours() == []

"""The O(1) fast-quorum pre-check (`may_form` with the membership's ``prev_missing``): it must decide
exactly as the scan it replaces, whatever requests come and go (the scan made a
round of N requests O(N^2) with the default ``min_replicas=1``)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ftlaunch.lighthouse.membership import Membership, ShuttingDown
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumMember, QuorumOptions, may_form


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seed", range(8))
def test_kept_missing_set_decides_as_the_scan(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    options = QuorumOptions(min_replicas=1, join_timeout=5.0, heartbeat_timeout=3.0)
    m = Membership(options, ids=QuorumIdAllocator(1_700_000_000_000), clock=clock, wall_clock=clock)
    rids = [f"g{i}" for i in range(12)]
    tickets = {}
    checked = 0
    for _ in range(400):
        rid = rng.choice(rids)
        action = rng.random()
        try:
            if action < 0.6:
                tickets[rid] = m.request_quorum(QuorumMember(rid, step=1))
            elif action < 0.7:
                m.heartbeat(rid)
            elif action < 0.8 and rid in tickets:
                m.abandon(tickets[rid])
            elif action < 0.85:
                m.leave(rid)
            elif action < 0.9:
                m.connection_lost(rid)
            else:
                clock.now += rng.choice([0.5, 2.0, 4.0])
                m.tick()
        except ShuttingDown:
            raise
        except Exception:  # refusals (e.g. an evicted or held id) are not what this test is about
            pass
        with m._lock:
            state = m._round.state(m._roster.groups, m._ids.peek())
            if state.prev_quorum is None:
                continue
            prev_ids = set(state.prev_quorum.replica_ids)
            assert state.prev_missing == {r for r in prev_ids if r not in state.requests}
            scanned = dataclasses.replace(state, prev_missing=None)
            assert may_form(state, clock(), options) == may_form(scanned, clock(), options)
            checked += 1
    assert checked > 100

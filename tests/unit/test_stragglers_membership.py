"""The membership applying the straggler rule (lighthouse/stragglers.py), in one process with a
hand-driven clock: groups step through quorum requests carrying their progress reports, and the
tick judges them. ``report`` shows stragglers; ``replace`` hands a persistent one's slot to a
waiting hot spare (fencing it, as for a hung group) or tells it to restart, one at a time, never
below ``min_replicas``, never when everybody is slow. The pure rule: tests/unit/test_stragglers.py."""

from __future__ import annotations

import math

import pytest

from ftlaunch.lighthouse.membership import Evicted, Membership
from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.spares import ClaimTicket
from ftlaunch.lighthouse.stragglers import JUDGE_EVERY, STRAGGLER_REASON, StragglerRule

RULE = StragglerRule()
#: Steps (each `JUDGE_EVERY` seconds here) until a group slow from the start is a persistent
#: straggler: a verdict needs `min_steps`, replacing it `persist` more and `persist_seconds`.
PERSISTENT = RULE.min_steps + max(RULE.persist, math.ceil(RULE.persist_seconds / JUDGE_EVERY)) + 2


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class Job:
    """Groups stepping together on one membership: each step, every group asks for the quorum with
    its progress report (the last committed step's compute time), then time passes and the tick runs."""

    def __init__(self, rids: list[str], *, policy: str = "replace", min_replicas: int = 1) -> None:
        self.clock = Clock()
        options = QuorumOptions(min_replicas=min_replicas, join_timeout=60.0, heartbeat_timeout=5.0)
        self.m = Membership(
            options,
            ids=QuorumIdAllocator(1_700_000_000_000),
            clock=self.clock,
            wall_clock=self.clock,
            stragglers=policy,
        )
        self.rids = list(rids)
        self.sessions = {rid: f"{rid}-p0" for rid in rids}
        self.commits = dict.fromkeys(rids, 0)
        self.step_no = 0
        self.fenced: list[str] = []
        for rid in rids:  # all live before the first request: the first quorum has them all
            self.m.heartbeat(rid)

    def step(self, compute: dict[str, float], default: float = 0.05) -> None:
        for rid in list(self.rids):
            report = ProgressReport(
                session=self.sessions[rid],
                step=self.step_no,
                commits=self.commits[rid],
                compute_seconds=compute.get(rid, default),
            )
            try:
                ticket = self.m.request_quorum(QuorumMember(rid, step=self.step_no), report)
            except Evicted:  # replaced by a hot spare: its process ends (and restarts as a spare)
                self.rids.remove(rid)
                self.fenced.append(rid)
                continue
            assert ticket.done or rid != self.rids[-1], ticket.error
        for rid in self.rids:
            self.commits[rid] += 1
        self.step_no += 1
        self.clock.now += JUDGE_EVERY
        self.m.tick()

    def run(self, steps: int, compute: dict[str, float]) -> None:
        for _ in range(steps):
            self.step(compute)

    def restart(self, rid: str) -> None:
        """``rid``'s process was replaced by a new one (its agent restarted it, or a spare took its name)."""
        self.sessions[rid] = f"{rid}-p{int(self.sessions[rid].rsplit('-p', 1)[1]) + 1}"
        self.commits[rid] = 0

    def events(self, event: str) -> list[tuple[str | None, str]]:
        return [(h.replica_id, h.detail) for h in reversed(self.m.snapshot().history) if h.event == event]


def test_report_shows_the_straggler_with_its_slowdown_and_replaces_nobody() -> None:
    job = Job(["rg0", "rg1", "rg2"], policy="report")
    job.run(PERSISTENT + 5, {"rg1": 0.1})
    st = job.m.snapshot().stragglers
    assert st is not None and st.policy == "report"
    assert [g.replica_id for g in st.stragglers] == ["rg1"]
    assert st.stragglers[0].slowdown == pytest.approx(2.0) and st.stragglers[0].since is not None
    assert st.replacements == 0 and st.replacing is None
    assert [rid for rid, _ in job.events("straggler")] == ["rg1"]
    assert "2.0x slower than the others" in job.events("straggler")[0][1]
    assert job.m.heartbeat("rg1") is None  # not told to restart
    # It speeds up again: a straggler no more (at or below `leave` for `calm_steps`), recorded once.
    job.run(RULE.window, {})
    assert job.m.stragglers().stragglers  # calm for fewer than `calm_steps` steps so far
    job.run(RULE.calm_steps, {})
    st = job.m.stragglers()
    assert not st.stragglers and [rid for rid, _ in job.events("straggler_cleared")] == ["rg1"]


def test_replace_restarts_a_persistent_straggler_when_no_spare_waits() -> None:
    job = Job(["rg0", "rg1", "rg2"])
    job.run(RULE.min_steps + RULE.persist + 1, {"rg1": 0.1})
    assert job.m.stragglers().stragglers and not job.events("straggler_replaced")  # not for long enough
    job.run(PERSISTENT - (RULE.min_steps + RULE.persist + 1), {"rg1": 0.1})
    replaced = job.events("straggler_replaced")
    assert [rid for rid, _ in replaced] == ["rg1"] and "restart" in replaced[0][1]
    kill = job.m.heartbeat("rg1")  # the answer to its next heartbeat: end the process (its agent restarts it)
    assert kill is not None and kill.startswith(STRAGGLER_REASON)
    st = job.m.stragglers()
    assert st.replacing == "rg1" and st.replaced[0].how == "restart" and st.replaced[0].arrived is None
    # The restarted process commits: the replacement arrived; its window starts afresh (no verdict).
    job.restart("rg1")
    job.run(2, {})
    st = job.m.stragglers()
    assert st.replacing == "rg1" and st.replaced[0].arrived is not None  # settles once judged
    assert "rg1" not in {g.replica_id for g in st.groups}
    job.run(RULE.min_steps - 1, {})
    st = job.m.stragglers()
    assert st.replacing is None and "rg1" in {g.replica_id for g in st.groups}


def test_replace_gives_the_slot_to_a_waiting_hot_spare_and_fences_the_straggler() -> None:
    job = Job(["rg0", "rg1", "rg2"])
    m = job.m
    for slot in range(3):
        grant = m.claim(f"g{slot}.0", slots=3, preferred=slot)
        assert grant.done and grant.grant is not None and grant.grant.replica_id == f"rg{slot}"
    spare: ClaimTicket = m.claim("g3.0", slots=3, preferred=None)
    assert not spare.done
    job.run(PERSISTENT, {"rg1": 0.12})
    assert job.fenced == ["rg1"]  # its next quorum request was refused
    assert spare.done and spare.grant is not None, spare.error
    assert (spare.grant.slot, spare.grant.replica_id, spare.grant.replaced) == (1, "rg1.1", "rg1")
    with pytest.raises(Evicted, match="replaced"):  # the straggler is fenced: it cannot train that shard
        m.heartbeat("rg1")
    replaced = job.events("straggler_replaced")
    assert [rid for rid, _ in replaced] == ["rg1"] and "hot spare" in replaced[0][1]
    assert any(rid == "rg1" and d.startswith(STRAGGLER_REASON) for rid, d in job.events("failed"))
    snap = m.snapshot()
    assert snap.spares is not None and "rg1" in snap.spares.fenced
    assert snap.stragglers is not None and snap.stragglers.replaced[0].how == "spare"
    assert snap.stragglers.replacing == "rg1"
    # The spare trains as rg1.1: its first commit ends the replacement.
    job.rids = ["rg1.1", "rg0", "rg2"]
    job.sessions["rg1.1"], job.commits["rg1.1"] = "spare-p0", 0
    m.heartbeat("rg1.1")
    job.run(RULE.min_steps + 1, {})  # (a report says what was committed before its request)
    assert m.stragglers().replacing is None and m.stragglers().replaced[0].arrived is not None


def test_replace_one_at_a_time() -> None:
    """Two stragglers: the slower is replaced first; the other waits until that replacement committed."""
    job = Job(["rg0", "rg1", "rg2", "rg3", "rg4"])
    slow = {"rg3": 0.12, "rg4": 0.15}
    job.run(PERSISTENT, slow)
    assert [rid for rid, _ in job.events("straggler_replaced")] == ["rg4"]
    job.run(5, slow)  # rg4's replacement has not committed yet (its process did not restart)
    assert [rid for rid, _ in job.events("straggler_replaced")] == ["rg4"]
    job.restart("rg4")
    job.run(RULE.min_steps - 1, {"rg3": 0.12})  # rg4's new process commits, not yet judged
    assert [rid for rid, _ in job.events("straggler_replaced")] == ["rg4"]
    job.run(2, {"rg3": 0.12})  # now it can be: the next one may go
    assert [rid for rid, _ in job.events("straggler_replaced")] == ["rg4", "rg3"]


def test_replace_never_below_min_replicas() -> None:
    job = Job(["rg0", "rg1"], min_replicas=2)
    job.run(PERSISTENT + 10, {"rg1": 0.2})
    st = job.m.stragglers()
    assert [g.replica_id for g in st.stragglers] == ["rg1"]  # found, shown ...
    assert st.replacements == 0 and job.m.heartbeat("rg1") is None  # ... and kept: 1 < --min-replicas 2


def test_replace_never_when_everybody_is_slow() -> None:
    job = Job(["rg0", "rg1", "rg2"])
    job.run(PERSISTENT, {"rg0": 0.05, "rg1": 0.05, "rg2": 0.05})
    job.run(PERSISTENT, {"rg0": 0.2, "rg1": 0.2, "rg2": 0.2})  # the whole job got 4x slower
    st = job.m.stragglers()
    assert not st.stragglers and st.replacements == 0 and len(st.groups) == 3
    assert all(g.slowdown == pytest.approx(1.0) for g in st.groups)


def test_the_status_document_carries_the_verdicts() -> None:
    """``/status``'s ``stragglers`` parses back; ``/metrics`` and the dashboard show the slowdown."""
    from ftlaunch.lighthouse import dashboard, metrics
    from ftlaunch.lighthouse.status import LighthouseStatus

    job = Job(["rg0", "rg1", "rg2"], policy="report")
    job.run(PERSISTENT, {"rg1": 0.105})
    snap = job.m.snapshot()
    back = LighthouseStatus.from_json(snap.to_json())
    assert back.stragglers == snap.stragglers and back.stragglers is not None
    assert back.group_progress("rg1").compute_seconds == pytest.approx(0.105)  # type: ignore[union-attr]
    text = metrics.MetricsExporter(lambda: snap).render()[0].decode()
    assert 'ftlaunch_group_slowdown{replica_id="rg1"} 2.1' in text
    assert 'ftlaunch_group_straggler{replica_id="rg1"} 1.0' in text
    assert 'ftlaunch_group_straggler{replica_id="rg0"} 0.0' in text
    assert "ftlaunch_stragglers 1.0" in text
    page = dashboard.render(snap)
    assert "Stragglers (1 straggler(s); policy <span class='mono'>report</span>)" in page
    assert ">2.10x<" in page
    assert "slowed / straggler found" in page  # the verdict on the picture

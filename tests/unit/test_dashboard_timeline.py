"""The dashboard's picture (ftlaunch.lighthouse.dashboard.timeline_of): the groups' progress series
and the marks the lighthouse's history gives, from a membership driven by hand in one process. The
page as a browser shows it: tests/processes/test_dashboard_browser.py."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from ftlaunch.lighthouse import dashboard
from ftlaunch.lighthouse.health import HealthReport
from ftlaunch.lighthouse.membership import Membership
from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.status import HistoryEvent, LighthouseStatus
from ftlaunch.lighthouse.timeline import FAILURE, HANG, HEALTH, REJOIN, SLOW, STRAGGLER, TAKEOVER


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def test_a_failure_and_the_quorum_that_takes_the_group_back() -> None:
    clock = Clock()
    m = Membership(QuorumOptions(min_replicas=2), ids=QuorumIdAllocator(1), clock=clock, wall_clock=clock)
    for rid in ("rg0", "rg1"):
        m.request_quorum(QuorumMember(rid), ProgressReport(f"{rid}-1", step=1, commits=1))
    for step in range(2, 6):
        clock.now += 1
        for rid in ("rg0", "rg1"):
            m.heartbeat(rid, ProgressReport(f"{rid}-1", step=step, commits=step))
    clock.now += 0.5
    m.report_failure("rg1", "rank 0 killed by SIGKILL")
    clock.now += 3
    m.request_quorum(QuorumMember("rg0"), ProgressReport("rg0-1", step=8, commits=8))
    m.request_quorum(QuorumMember("rg1"), ProgressReport("rg1-2", step=8, commits=1, heals=1))

    status = m.snapshot()
    pic = dashboard.timeline_of(status)
    assert [line.name for line in pic.lines] == ["rg0", "rg1"]
    assert pic.lines[0].points[0] == (0.0, 1)  # t = 0: the first step reported
    marks = [(m.at, m.kind, m.line) for m in pic.marks]
    assert marks == [(4.5, FAILURE, "rg1"), (7.5, REJOIN, "rg1")], marks
    assert "rank 0 killed by SIGKILL" in pic.marks[0].detail
    assert pic.end == 7.5

    page = dashboard.render(status)
    start = page.index("<div id='timeline'>")
    svg = page[start + len("<div id='timeline'>") : page.index("</svg>", start) + len("</svg>")]
    root = ET.fromstring(svg)
    ns = {"svg": "http://www.w3.org/2000/svg"}
    assert [p.get("data-line") for p in root.findall(".//svg:path[@class='series']", ns)] == ["rg0", "rg1"]
    assert [g.get("data-kind") for g in root.findall(".//svg:g[@data-kind]", ns)] == [FAILURE, REJOIN]
    assert page.index("id='timeline'") < page.index("<h2>Current quorum</h2>")  # the picture first


def test_hangs_spares_and_a_group_heard_again_without_leaving_the_quorum() -> None:
    """A hung group heard again while still a member is back; a failed one only in a new quorum."""

    def h(t: float, event: str, rid: str | None, detail: str = "", participants=None) -> HistoryEvent:
        return HistoryEvent(t, event, rid, detail, 1 if participants else None, participants)

    history = (
        h(100.0, "quorum", None, "", ("rg0", "rg1", "rg2")),
        h(101.0, "failed", "rg2", "hung: blocked on rg2 for 0.5s"),
        h(102.0, "silent", "rg0", "no heartbeat for 5s"),
        h(103.0, "revived", "rg0", "was silent"),  # no quorum left it out: back now
        h(104.0, "quorum", None, "", ("rg0", "rg1")),
        h(104.5, "failed", "rg0", "rank 1 (pid 7) killed by SIGKILL"),
        h(104.6, "revived", "rg0", "was failed"),  # its leader's last heartbeat: not back
        h(105.0, "disconnected", "rg1", "connection closed"),
        h(106.0, "claimed", "rg1", "slot 1 by rg3.0"),
        h(107.0, "revived", "rg2", "was failed"),  # out of the quorum: not back until one has it
        h(108.0, "quorum", None, "", ("rg0", "rg1", "rg2")),
    )
    status = LighthouseStatus(time=110.0, history=tuple(reversed(history)))
    marks = [(m.at, m.kind, m.line) for m in dashboard.timeline_of(status).marks]
    assert marks == [
        (0.0, HANG, "rg2"),
        (1.0, HANG, "rg0"),
        (2.0, REJOIN, "rg0"),
        (3.5, FAILURE, "rg0"),
        (4.0, FAILURE, "rg1"),
        (5.0, TAKEOVER, "rg1"),
        (7.0, REJOIN, "rg0"),
        (7.0, REJOIN, "rg2"),
    ]


def test_stragglers_found_and_replaced() -> None:
    """A straggler found is a moment on its line; replaced -- with a spare (``failed``, then
    ``straggler_replaced``) or by a restart (``straggler_replaced``, then its disconnect) -- it is
    down from then on, one mark per incident, until the spare or its restart is in a quorum."""

    def h(t: float, event: str, rid: str | None, detail: str = "", participants=None) -> HistoryEvent:
        return HistoryEvent(t, event, rid, detail, 1 if participants else None, participants)

    slow = (
        "straggler: 2.1x slower than the others: 62.0 ms of its own work per committed step against 30.0 ms"
    )
    history = (
        h(100.0, "quorum", None, "", ("rg0", "rg1", "rg2")),
        h(110.0, "straggler", "rg1", "2.1x slower than the others"),
        h(125.0, "failed", "rg1", slow),
        h(125.0, "replaced", "rg1", "slot 1 given to g3.0 as rg1.1"),
        h(125.0, "claimed", "rg1.1", "slot 1 by g3.0"),
        h(125.0, "straggler_replaced", "rg1", f"{slow}; its slot went to a hot spare"),
        h(130.0, "straggler", "rg2", "1.8x slower than the others"),
        h(150.0, "straggler_replaced", "rg2", f"{slow}; told to restart (no hot spare waits)"),
        h(150.2, "disconnected", "rg2", "connection closed without leave"),
        h(160.0, "quorum", None, "", ("rg0", "rg1.1", "rg2")),
    )
    status = LighthouseStatus(time=170.0, history=tuple(reversed(history)))
    marks = [(m.at, m.kind, m.line) for m in dashboard.timeline_of(status).marks]
    assert marks == [
        (0.0, SLOW, "rg1"),  # t = 0: the first mark (no progress series here)
        (15.0, STRAGGLER, "rg1"),
        (15.0, TAKEOVER, "rg1.1"),
        (20.0, SLOW, "rg2"),
        (40.0, STRAGGLER, "rg2"),
        (50.0, REJOIN, "rg2"),
    ], marks
    svg = dashboard.render(status)
    assert "straggler replaced (2)" in svg and "slowed / straggler found (2)" in svg


def test_a_failing_health_check_is_a_mark_on_its_group() -> None:
    """The lighthouse learns from rg1's agent that its health check fails (twice), then passes:
    one mark where it began failing, with the check's last line; nothing for the pass (the quorum
    that takes the group in is its rejoin)."""
    clock = Clock()
    m = Membership(QuorumOptions(min_replicas=1), ids=QuorumIdAllocator(1), clock=clock, wall_clock=clock)
    m.request_quorum(QuorumMember("rg0"), ProgressReport("rg0-1", step=1, commits=1))
    clock.now += 2
    m.report_health("rg1", HealthReport("ftlaunch.health", False, "checkpoint dir not writable", 4.0))
    clock.now += 4
    m.report_health("rg1", HealthReport("ftlaunch.health", False, "checkpoint dir not writable", 8.0))
    clock.now += 8
    m.report_health("rg1", HealthReport("ftlaunch.health", True, "ok"))
    pic = dashboard.timeline_of(m.snapshot())
    assert [(mk.at, mk.kind, mk.line) for mk in pic.marks] == [(2.0, HEALTH, "rg1")], pic.marks
    assert "checkpoint dir not writable" in pic.marks[0].detail
    assert "health check failed (1)" in dashboard.render(m.snapshot())

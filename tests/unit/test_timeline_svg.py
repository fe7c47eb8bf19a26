"""The timeline picture (ftlaunch.lighthouse.timeline_svg) and its data (ftlaunch.lighthouse.timeline):
the SVG parsed back as XML and measured -- one line per group, each mark where its time and its
group's step put it, every name escaped -- and the bounded series that feeds it."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from ftlaunch.lighthouse.timeline import (
    AGENT,
    FAILURE,
    GAVE_UP,
    HANG,
    LIGHTHOUSE,
    REJOIN,
    TAKEOVER,
    Line,
    Mark,
    Series,
    Timeline,
    thin,
)
from ftlaunch.lighthouse.timeline_svg import (
    down_intervals,
    mark_value,
    nice_step,
    render,
    time_unit,
    value_at,
)

NS = {"svg": "http://www.w3.org/2000/svg"}


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # raises on anything that is not well-formed XML


def plot_area(root: ET.Element) -> tuple[float, float, float, float]:
    rect = root.find(".//svg:rect[@class='plot-area']", NS)
    assert rect is not None
    x, y, w, h = (float(rect.get(k, "nan")) for k in ("x", "y", "width", "height"))
    return x, y, w, h


def translate(el: ET.Element) -> tuple[float, float]:
    m = re.fullmatch(r"translate\(([-\d.]+),([-\d.]+)\)", el.get("transform", ""))
    assert m, el.attrib
    return float(m.group(1)), float(m.group(2))


def two_groups() -> Timeline:
    """rg0 steps 0..100 over 100 s; rg1 the same, but down from 40 s to 60 s, then healed."""
    rg0 = Line("rg0", ((0.0, 0.0), (100.0, 100.0)))
    rg1 = Line("rg1", ((0.0, 0.0), (40.0, 40.0), (60.0, 40.0), (60.0, 60.0), (100.0, 100.0)))
    marks = (
        Mark(40.0, FAILURE, "rg1", "SIGKILL to its workers"),
        Mark(60.0, REJOIN, "rg1", "committed a step again"),
        Mark(70.0, LIGHTHOUSE, None, "crashed", until=80.0),
    )
    return Timeline("steps per group", (rg0, rg1), marks, end=100.0, subtitle="run r1")


def test_one_series_per_group_in_order_with_its_own_colour() -> None:
    root = parse(render(two_groups()))
    series = root.findall(".//svg:path[@class='series']", NS)
    assert [s.get("data-line") for s in series] == ["rg0", "rg1"]
    assert len({s.get("stroke") for s in series}) == 2
    # Drawn widest first: groups in lockstep show as nested stripes, not one hiding the other.
    assert float(series[0].get("stroke-width", 0)) > float(series[1].get("stroke-width", 0))
    legend = "".join(root.find(".//svg:g[@class='legend']", NS).itertext())  # type: ignore[union-attr]
    assert "rg0" in legend and "rg1" in legend and "failure (1)" in legend and "rejoined (1)" in legend


def test_marks_sit_at_their_time_on_their_groups_line() -> None:
    root = parse(render(two_groups()))
    x0, y0, w, h = plot_area(root)
    marks = {m.get("data-kind"): m for m in root.findall(".//svg:g[@data-kind]", NS)}
    assert set(marks) == {FAILURE, REJOIN, LIGHTHOUSE}
    # The y axis ends at the first tick at or above the highest step (100).
    for kind, t, step in ((FAILURE, 40.0, 40.0), (REJOIN, 60.0, 60.0)):
        x, y = translate(marks[kind])
        assert x == pytest.approx(x0 + w * t / 100.0, abs=0.11)
        assert y == pytest.approx(y0 + h - h * step / 100.0, abs=0.11)
        assert marks[kind].get("data-line") == "rg1"
    span = marks[LIGHTHOUSE].find("svg:rect", NS)
    assert span is not None
    assert float(span.get("x", 0)) == pytest.approx(x0 + w * 0.7, abs=0.11)
    assert float(span.get("width", 0)) == pytest.approx(w * 0.1, abs=0.2)
    tips = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert "rg1: failure at 40 s: SIGKILL to its workers" in tips
    assert any(t.startswith("lighthouse down: back after 10.0 s") for t in tips)


def test_down_time_is_a_band_over_the_group_from_failure_to_rejoin() -> None:
    tl = two_groups()
    assert down_intervals(tl.marks, "rg1") == [(40.0, 60.0)] and down_intervals(tl.marks, "rg0") == []
    root = parse(render(tl))
    bands = root.findall(".//svg:path[@class='down']", NS)
    assert [b.get("data-line") for b in bands] == ["rg1"]
    x0, _, w, _ = plot_area(root)
    xs = [float(v) for v in re.findall(r"[ML]([-\d.]+),", bands[0].get("d", ""))]
    assert min(xs) == pytest.approx(x0 + w * 0.4, abs=0.11) and max(xs) == pytest.approx(
        x0 + w * 0.6, abs=0.11
    )
    # A group that never came back is down to the end of its line; a second failure while down
    # does not start another band.
    marks = (Mark(10, FAILURE, "a"), Mark(12, AGENT, "a"), Mark(20, REJOIN, "a"), Mark(30, GAVE_UP, "a"))
    assert down_intervals(marks, "a") == [(10, 20), (30, None)]


def test_every_name_and_detail_is_escaped() -> None:
    evil = "<script>alert('x')</script>&\"rg\x07"
    tl = Timeline(
        f"title {evil}",
        (Line(evil, ((0.0, 1.0), (5.0, 3.0))),),
        (Mark(2.0, HANG, evil, f"detail {evil}"),),
        end=5.0,
        subtitle=f"sub {evil}",
    )
    svg = render(tl)
    assert "<script" not in svg and "\x07" not in svg
    root = parse(svg)
    clean = evil.replace("\x07", "")
    assert root.find(".//svg:path[@class='series']", NS).get("data-line") == clean  # type: ignore[union-attr]
    assert root.find(".//svg:g[@data-kind='hang']", NS).get("data-line") == clean  # type: ignore[union-attr]
    assert f"detail {clean}" in "".join(root.itertext())


def test_nothing_committed_yet_is_said_and_marks_still_drawn() -> None:
    root = parse(render(Timeline("t", (Line("rg0"),), (Mark(3.0, FAILURE, "rg0"),), end=10.0)))
    assert "no step committed yet" in "".join(root.itertext())
    assert root.findall(".//svg:path[@class='series']", NS) == []
    x, y = translate(root.find(".//svg:g[@data-kind='failure']", NS))  # type: ignore[arg-type]
    x0, y0, w, h = plot_area(root)
    assert x == pytest.approx(x0 + w * 0.3, abs=0.11) and y == pytest.approx(y0 + h, abs=0.11)  # at step 0


def test_axes_have_units_and_long_runs_count_in_minutes_or_hours() -> None:
    text = "".join(parse(render(two_groups())).itertext())
    assert "time since start (s)" in text and "step (last committed)" in text
    long = Timeline("t", (Line("rg0", ((0.0, 0.0), (3600.0, 5000.0))),), end=3600.0)
    text = "".join(parse(render(long)).itertext())
    assert "time since start (min)" in text and ">60<" in render(long)
    assert (
        time_unit(5.0) == ("s", 1.0) and time_unit(3600.0) == ("min", 60.0) and time_unit(86400.0)[0] == "h"
    )
    assert [nice_step(s) for s in (1.0, 7.0, 100.0, 3600.0)] == [0.2, 2.0, 20.0, 1000.0]


def test_many_groups_are_drawn_and_the_legend_stays_short() -> None:
    lines = tuple(Line(f"rg{i}", ((0.0, 0.0), (10.0, 10.0))) for i in range(40))
    root = parse(render(Timeline("t", lines, (Mark(5.0, TAKEOVER, "rg3"),), end=10.0)))
    assert len(root.findall(".//svg:path[@class='series']", NS)) == 40
    legend = "".join(root.find(".//svg:g[@class='legend']", NS).itertext())  # type: ignore[union-attr]
    assert "rg23" in legend and "rg24" not in legend and "16 more group(s)" in legend
    assert "spare took over (1)" in legend


def test_value_at_interpolates_and_starts_at_zero() -> None:
    pts = ((10.0, 0.0), (20.0, 100.0), (30.0, 100.0))
    assert value_at(pts, 5.0) == 0.0 and value_at(pts, 15.0) == 50.0 and value_at(pts, 25.0) == 100.0
    assert value_at(pts, 99.0) == 100.0 and value_at((), 1.0) == 0.0


def test_a_failure_sits_where_the_group_stopped_and_a_rejoin_where_it_caught_up() -> None:
    # Sampled every 0.1 s: stuck at 84 until the healed restart's first commit at step 280, which
    # the lighthouse dates between two samples.
    pts = ((57.0, 84.0), (90.8, 84.0), (90.9, 280.0), (91.0, 281.0))
    assert mark_value(pts, Mark(90.85, REJOIN, "rg0")) == 280.0  # not halfway up the jump
    assert mark_value(pts, Mark(90.85, FAILURE, "rg0")) == 84.0
    assert mark_value(pts, Mark(90.85, TAKEOVER, "rg0")) == 280.0
    assert (
        mark_value(pts, Mark(95.0, REJOIN, "rg0")) == 281.0 and mark_value((), Mark(1.0, REJOIN, "x")) == 0.0
    )


# ---- the series behind it: bounded, faithful where it matters ------------------------------------


def test_thin_keeps_the_ends_and_the_corners() -> None:
    climb = [(float(t), float(t)) for t in range(101)]
    assert thin(climb, 2) == [(0.0, 0.0), (100.0, 100.0)]  # a straight climb needs its ends only
    stall = [(float(t), float(min(t, 40) if t < 60 else t)) for t in range(101)]
    # where it stopped, the end of the stall, where it caught up
    assert thin(stall, 5) == [(0.0, 0.0), (40.0, 40.0), (59.0, 40.0), (60.0, 60.0), (100.0, 100.0)]


def test_a_long_run_stays_bounded_and_keeps_its_outage() -> None:
    s = Series(capacity=64)
    step = 0
    for i in range(100_000):  # close to 3 hours sampled every 0.1 s
        t = i * 0.1
        if not 5_000 <= t < 5_030:  # down for 30 s
            step += 1
        s.add(t, step)
        assert len(s) <= 65
    pts = s.points()
    flat = [(a, b) for a, b in zip(pts, pts[1:], strict=False) if a[1] == b[1] and b[0] - a[0] >= 25]
    assert flat, pts  # the 30 s without progress is still there, hours later


def test_hold_after_a_silence_and_throttled_reports() -> None:
    s = Series(capacity=16, min_gap=0.25, hold_after=1.0)
    s.add(0.0, 0)
    s.add(0.1, 1)  # within min_gap: only the latest sample
    assert s.points() == ((0.0, 0), (0.1, 1))
    s.add(0.3, 3)  # past min_gap: the one waiting is kept, this one waits
    assert s.points() == ((0.0, 0), (0.1, 1), (0.3, 3))
    s.add(0.32, 4)  # within min_gap of the last point kept: replaces the one waiting
    assert s.points() == ((0.0, 0), (0.1, 1), (0.32, 4))
    s.add(5.0, 50)  # 4.7 s of silence: the corner before it, flat, then the jump
    assert s.points() == ((0.0, 0), (0.1, 1), (0.32, 4), (5.0, 4), (5.0, 50))
    s.add(4.0, 7)  # out of order: ignored
    assert s.points()[-1] == (5.0, 50)
    s.add(5.1, 51)  # only the latest ...
    s.add(9.0, 90)  # ... but kept as the corner before a silence
    assert s.points()[-4:] == ((5.0, 50), (5.1, 51), (9.0, 51), (9.0, 90))
    with pytest.raises(ValueError):
        Series(capacity=3)
    with pytest.raises(ValueError):
        Series(min_gap=2.0, hold_after=1.0)

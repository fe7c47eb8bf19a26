"""Draw a `Timeline` as a self-contained SVG: each replica group's step against time, failures and
rejoins marked on the group's line, a legend and labelled axes.

One pure function, `render` (data in, SVG text out), used for the file ``ftlaunch`` writes at exit
and inline by the lighthouse's dashboard, so both pictures read the same. No script, no external
font or stylesheet: the file opens in any browser, offline. Every text that came from a user or a
client (group names, details) is escaped, and characters XML cannot carry are dropped.

How it reads at a glance: the lines are drawn widest first, so groups stepping in lockstep show as
nested stripes instead of hiding each other; a group's down time (failure to rejoin) is a red band
over its line; each mark's tooltip (``<title>``) says what happened, when and at which step.
"""

from __future__ import annotations

import bisect
import html
import math
import re
from collections.abc import Sequence

from ftlaunch.lighthouse.timeline import (
    AGENT,
    FAILURE,
    FAILURE_KINDS,
    GAVE_UP,
    HANG,
    HEALTH,
    LIGHTHOUSE,
    MARK_KINDS,
    RECOVERY_KINDS,
    REJOIN,
    SLOW,
    STRAGGLER,
    TAKEOVER,
    Line,
    Mark,
    Point,
    Timeline,
)

WIDTH = 960
#: Height of everything above the legend (title, plot, axes).
HEIGHT = 400

#: Space around the plot area.
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 24, 58, 46
_LEGEND_ROW = 20
#: Lines named in the legend; more are drawn, and counted.
MAX_LEGEND_LINES = 24

#: Series colours: distinct from the marks' red, amber and green, and from each other.
PALETTE = (
    "#1f77b4",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
    "#393b79",
    "#637939",
    "#6b6ecf",
)
_RED = "#d62728"
_INK = "#1f2328"
_MUTED = "#656d76"
_GRID = "#e6e8eb"

LABELS = {
    FAILURE: "failure",
    HANG: "hang (stopped)",
    AGENT: "agent died",
    GAVE_UP: "failed for good",
    HEALTH: "health check failed",
    LIGHTHOUSE: "lighthouse down",
    REJOIN: "rejoined",
    TAKEOVER: "spare took over",
    SLOW: "slowed / straggler found",
    STRAGGLER: "straggler replaced",
}
_AMBER = "#e6a100"

_GLYPHS = {
    FAILURE: (
        "<path d='M-5,-5L5,5M-5,5L5,-5' stroke='#fff' stroke-width='6' stroke-linecap='round'/>"
        f"<path d='M-5,-5L5,5M-5,5L5,-5' stroke='{_RED}' stroke-width='3' stroke-linecap='round'/>"
    ),
    HANG: (
        "<rect x='-6' y='-7' width='4.5' height='14' fill='#e6a100' stroke='#fff' stroke-width='1'/>"
        "<rect x='1.5' y='-7' width='4.5' height='14' fill='#e6a100' stroke='#fff' stroke-width='1'/>"
    ),
    AGENT: (
        f"<rect x='-6' y='-6' width='12' height='12' fill='#fff' stroke='{_RED}' stroke-width='2'/>"
        f"<path d='M-3,-3L3,3M-3,3L3,-3' stroke='{_RED}' stroke-width='2'/>"
    ),
    GAVE_UP: "<rect x='-6' y='-6' width='12' height='12' fill='#111' stroke='#fff' stroke-width='1.5'/>",
    HEALTH: (
        f"<circle r='7' fill='#fff' stroke='{_RED}' stroke-width='2'/>"
        f"<path d='M0,-4V4M-4,0H4' stroke='{_RED}' stroke-width='2.5'/>"
    ),
    REJOIN: "<circle r='6' fill='#2ca02c' stroke='#fff' stroke-width='1.5'/>",
    TAKEOVER: "<path d='M0,-7L7,0L0,7L-7,0Z' fill='#008080' stroke='#fff' stroke-width='1.5'/>",
    LIGHTHOUSE: "<rect x='-6' y='-7' width='12' height='14' fill='#888' fill-opacity='0.3'/>",
    SLOW: (
        "<path d='M-6,-7L6,-7L-6,7L6,7Z' fill='#fff' stroke='#b07800' stroke-width='2' "
        "stroke-linejoin='round'/>"
    ),
    STRAGGLER: (
        f"<path d='M-7,-6L7,-6L0,7Z' fill='{_RED}' stroke='#fff' stroke-width='1.5' stroke-linejoin='round'/>"
    ),
}

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def escape(text: object) -> str:
    """Text safe in an SVG (XML) element or quoted attribute."""
    return html.escape(_NOT_XML.sub("", str(text)), quote=True)


def nice_step(span: float, count: int = 6) -> float:
    """A tick step of 1, 2, 2.5 or 5 times a power of ten giving about ``count`` ticks over ``span``."""
    raw = max(span, 1e-9) / count
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit the time axis counts in (its label) and seconds per unit."""
    if seconds > 10 * 3600:
        return "h", 3600.0
    if seconds > 600:
        return "min", 60.0
    return "s", 1.0


def _num(v: float) -> str:
    return str(int(round(v))) if abs(v - round(v)) < 1e-6 else f"{v:.6g}"


def _f(v: float) -> str:
    return f"{v:.1f}"


class _Frame:
    """The plot area and the two scales (seconds -> x, step -> y)."""

    def __init__(self, width: int, height: int, end: float, top_value: float) -> None:
        self.x0, self.x1 = float(_LEFT), float(width - _RIGHT)
        self.y0, self.y1 = float(_TOP), float(height - _BOTTOM)
        self.end = end
        self.top = top_value

    def x(self, t: float) -> float:
        t = min(max(t, 0.0), self.end)
        return self.x0 + (self.x1 - self.x0) * t / self.end

    def y(self, v: float) -> float:
        return self.y1 - (self.y1 - self.y0) * min(max(v, 0.0), self.top) / self.top


def value_at(points: Sequence[Point], t: float) -> float:
    """The line's value at ``t``: straight between points, the later value where it jumps (a
    rejoin sits on the step it caught up to), 0 before the line starts, its last value after."""
    if not points or t < points[0][0] - 1e-9:
        return 0.0
    i = bisect.bisect_right([p[0] for p in points], t) - 1
    if i < 0 or t >= points[-1][0]:
        return points[max(i, 0)][1] if i < len(points) - 1 else points[-1][1]
    (ta, va), (tb, vb) = points[i], points[i + 1]
    return va + (vb - va) * (t - ta) / (tb - ta)


def mark_value(points: Sequence[Point], mark: Mark) -> float:
    """The step a mark sits at: a failure at the group's last step known at the time (where it
    stopped), a recovery at the first step known from then on (where it caught up: the samples
    around a catch-up may be a jump apart), anything else on the line."""
    if points and mark.kind in FAILURE_KINDS:
        i = bisect.bisect_right([p[0] for p in points], mark.at + 1e-9) - 1
        return points[i][1] if i >= 0 else 0.0
    if points and mark.kind in RECOVERY_KINDS:
        times = [p[0] for p in points]
        i = bisect.bisect_left(times, mark.at - 1e-9)
        if i >= len(points):
            return points[-1][1]
        return points[bisect.bisect_right(times, times[i]) - 1][1]  # the last point at that time
    return value_at(points, mark.at)


def _segment(points: Sequence[Point], t0: float, t1: float) -> list[Point]:
    """The part of the line between ``t0`` and ``t1`` (the ends interpolated)."""
    if not points or t1 < points[0][0]:
        return []
    t0 = max(t0, points[0][0])
    t1 = min(t1, points[-1][0])
    if t1 < t0:
        return []
    inner = [p for p in points if t0 < p[0] < t1]
    return [(t0, value_at(points, t0)), *inner, (t1, value_at(points, t1))]


def _path(frame: _Frame, points: Sequence[Point]) -> str:
    return "M" + "L".join(f"{_f(frame.x(t))},{_f(frame.y(v))}" for t, v in points)


def render(timeline: Timeline, width: int = WIDTH, height: int = HEIGHT) -> str:
    """The picture of ``timeline`` as one ``<svg>`` element (a file's whole content, or inline HTML)."""
    lines = timeline.lines
    marks = [m for m in timeline.marks if m.kind in LABELS]
    end = max(
        [timeline.end]
        + [p[0] for line in lines for p in line.points[-1:]]
        + [m.until if m.until is not None else m.at for m in marks]
    )
    end = end if end > 0 else 1.0
    unit, per = time_unit(end)
    vmax = max((v for line in lines for _, v in line.points), default=0.0)
    ystep = max(1.0, nice_step(vmax if vmax > 0 else 1.0, 5))
    top = max(ystep, math.ceil(vmax / ystep - 1e-9) * ystep)
    frame = _Frame(width, height, end, top)
    colours = {line.name: PALETTE[i % len(PALETTE)] for i, line in enumerate(lines)}
    legend, legend_height = _legend(timeline, marks, colours, width, height)

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' class='ftlaunch-timeline' width='{width}' "
        f"height='{height + legend_height}' viewBox='0 0 {width} {height + legend_height}' role='img' "
        f"aria-label='{escape(timeline.title)}' font-family='system-ui, -apple-system, Segoe UI, sans-serif' "
        f"font-size='12' fill='{_INK}'>",
        f"<title>{escape(timeline.title)}</title>",
        f"<rect class='background' width='{width}' height='{height + legend_height}' fill='#fff'/>",
        f"<text x='{_LEFT}' y='24' font-size='16' font-weight='600'>{escape(timeline.title)}</text>",
    ]
    subtitle = timeline.subtitle
    if timeline.marks_dropped:
        subtitle += f" ({timeline.marks_dropped} earlier event(s) not shown)"
    if subtitle:
        out.append(f"<text x='{_LEFT}' y='42' fill='{_MUTED}'>{escape(subtitle)}</text>")
    out += _axes(frame, unit, per, ystep)
    out += _spans(frame, marks)
    if not any(line.points for line in lines):
        out.append(
            f"<text class='empty' x='{_f((frame.x0 + frame.x1) / 2)}' y='{_f((frame.y0 + frame.y1) / 2)}' "
            f"text-anchor='middle' fill='{_MUTED}' font-size='14'>no step committed yet</text>"
        )
    out += _slow_bands(frame, lines, marks)
    out += _down_bands(frame, lines, marks)
    n = len(lines)
    for i, line in enumerate(lines):
        if not line.points:
            continue
        widthpx = 1.75 + 2.0 * (n - 1 - i) if n <= 4 else 2.0
        last_t, last_v = line.points[-1]
        out.append(
            f"<path class='series' data-line='{escape(line.name)}' d='{_path(frame, line.points)}' "
            "fill='none' "
            f"stroke='{colours[line.name]}' stroke-width='{widthpx:g}' stroke-linejoin='round' "
            f"stroke-linecap='round'><title>{escape(line.name)}: step {_num(last_v)} at "
            f"{_num(round(last_t / per, 2))} {unit}</title></path>"
        )
    by_name = {line.name: line.points for line in lines}
    for m in marks:
        if m.kind == LIGHTHOUSE:
            continue  # drawn as a span
        x = frame.x(m.at)
        y = frame.y(mark_value(by_name.get(m.line, ()), m)) if m.line is not None else frame.y0 + 8
        tip = f"{m.line + ': ' if m.line else ''}{LABELS[m.kind]} at {_num(round(m.at / per, 2))} {unit}"
        out.append(
            f"<g class='mark {m.kind}' data-kind='{m.kind}' data-line='{escape(m.line or '')}' "
            f"data-t='{m.at:.3f}' transform='translate({_f(x)},{_f(y)})'>"
            f"<title>{escape(tip + (': ' + m.detail if m.detail else ''))}</title>{_GLYPHS[m.kind]}</g>"
        )
    out += legend
    out.append("</svg>")
    return "\n".join(out)


def _axes(frame: _Frame, unit: str, per: float, ystep: float) -> list[str]:
    out = [
        f"<rect class='plot-area' x='{_f(frame.x0)}' y='{_f(frame.y0)}' width='{_f(frame.x1 - frame.x0)}' "
        f"height='{_f(frame.y1 - frame.y0)}' fill='none' stroke='{_GRID}'/>"
    ]
    ticks = []
    v = 0.0
    while v <= frame.top + 1e-9:
        y = frame.y(v)
        ticks.append(
            f"<line x1='{_f(frame.x0)}' x2='{_f(frame.x1)}' y1='{_f(y)}' y2='{_f(y)}' stroke='{_GRID}'/>"
            f"<text x='{_f(frame.x0 - 6)}' y='{_f(y + 4)}' text-anchor='end' fill='{_MUTED}'>{_num(v)}</text>"
        )
        v += ystep
    xstep = nice_step(frame.end / per, 8)
    k = 0
    while k * xstep * per <= frame.end * (1 + 1e-9):
        x = frame.x(k * xstep * per)
        ticks.append(
            f"<line x1='{_f(x)}' x2='{_f(x)}' y1='{_f(frame.y0)}' y2='{_f(frame.y1)}' stroke='{_GRID}'/>"
            f"<text x='{_f(x)}' y='{_f(frame.y1 + 16)}' text-anchor='middle' fill='{_MUTED}'>"
            f"{_num(k * xstep)}</text>"
        )
        k += 1
    out.append("<g class='ticks'>" + "".join(ticks) + "</g>")
    out.append(
        f"<line x1='{_f(frame.x0)}' x2='{_f(frame.x1)}' y1='{_f(frame.y1)}' y2='{_f(frame.y1)}' "
        f"stroke='{_MUTED}'/>"
        f"<line x1='{_f(frame.x0)}' x2='{_f(frame.x0)}' y1='{_f(frame.y0)}' y2='{_f(frame.y1)}' "
        f"stroke='{_MUTED}'/>"
    )
    out.append(
        f"<text class='x-label' x='{_f((frame.x0 + frame.x1) / 2)}' y='{_f(frame.y1 + 36)}' "
        f"text-anchor='middle'>time since start ({unit})</text>"
    )
    mid = (frame.y0 + frame.y1) / 2
    out.append(
        f"<text class='y-label' x='16' y='{_f(mid)}' text-anchor='middle' "
        f"transform='rotate(-90 16 {_f(mid)})'>step (last committed)</text>"
    )
    return out


def _spans(frame: _Frame, marks: Sequence[Mark]) -> list[str]:
    out = []
    for m in marks:
        if m.kind != LIGHTHOUSE:
            continue
        x0 = frame.x(m.at)
        x1 = frame.x(m.until if m.until is not None else frame.end)
        until = f"back after {m.until - m.at:.1f} s" if m.until is not None else "not back"
        out.append(
            f"<g class='mark span {LIGHTHOUSE}' data-kind='{LIGHTHOUSE}' data-line='' data-t='{m.at:.3f}'>"
            f"<title>{escape(f'lighthouse down: {until}' + (': ' + m.detail if m.detail else ''))}</title>"
            f"<rect x='{_f(x0)}' y='{_f(frame.y0)}' width='{_f(max(x1 - x0, 2.0))}' "
            f"height='{_f(frame.y1 - frame.y0)}' fill='#888' fill-opacity='0.18'/>"
            f"<text x='{_f(x0 + 4)}' y='{_f(frame.y0 + 14)}' fill='{_MUTED}'>lighthouse down</text></g>"
        )
    return out


def down_intervals(marks: Sequence[Mark], line: str) -> list[tuple[float, float | None]]:
    """When ``line``'s group was down: from a failure to the next recovery (None: never back)."""
    out: list[tuple[float, float | None]] = []
    since: float | None = None
    for m in sorted((m for m in marks if m.line == line), key=lambda m: m.at):
        if m.kind in FAILURE_KINDS and since is None:
            since = m.at
        elif m.kind in RECOVERY_KINDS and since is not None:
            out.append((since, m.at))
            since = None
    if since is not None:
        out.append((since, None))
    return out


def _down_bands(frame: _Frame, lines: Sequence[Line], marks: Sequence[Mark]) -> list[str]:
    out = []
    for line in lines:
        for t0, t1 in down_intervals(marks, line.name):
            seg = _segment(line.points, t0, t1 if t1 is not None else frame.end)
            if len(seg) < 2:
                continue
            out.append(
                f"<path class='down' data-line='{escape(line.name)}' d='{_path(frame, seg)}' fill='none' "
                f"stroke='{_RED}' stroke-opacity='0.28' stroke-width='10' stroke-linecap='round'/>"
            )
    return out


def _slow_bands(frame: _Frame, lines: Sequence[Line], marks: Sequence[Mark]) -> list[str]:
    """An amber band over a group's line while it was slowed (`SLOW` spans: those with an end)."""
    out = []
    by_name = {line.name: line.points for line in lines}
    for m in marks:
        if m.kind != SLOW or m.until is None or m.line is None or m.line not in by_name:
            continue
        seg = _segment(by_name[m.line], m.at, m.until)
        if len(seg) < 2:
            continue
        out.append(
            f"<path class='slowed' data-line='{escape(m.line)}' d='{_path(frame, seg)}' fill='none' "
            f"stroke='{_AMBER}' stroke-opacity='0.35' stroke-width='10' stroke-linecap='round'/>"
        )
    return out


def _legend(
    timeline: Timeline, marks: Sequence[Mark], colours: dict[str, str], width: int, height: int
) -> tuple[list[str], int]:
    """The legend under the plot, wrapped to the width: the lines, then each kind of mark drawn."""
    items: list[tuple[str, str]] = []  # (symbol SVG at the origin, label)
    shown = timeline.lines[:MAX_LEGEND_LINES]
    for line in shown:
        items.append(
            (
                f"<line x1='-9' x2='9' y1='0' y2='0' stroke='{colours[line.name]}' stroke-width='4' "
                "stroke-linecap='round'/>",
                line.name,
            )
        )
    if len(timeline.lines) > len(shown):
        items.append(("", f"... and {len(timeline.lines) - len(shown)} more group(s)"))
    if any(down_intervals(marks, line.name) for line in timeline.lines):
        items.append(
            (
                f"<line x1='-9' x2='9' y1='0' y2='0' stroke='{_RED}' stroke-opacity='0.28' "
                "stroke-width='10'/>",
                "down (failure to rejoin)",
            )
        )
    if any(m.kind == SLOW and m.until is not None for m in marks):
        items.append(
            (
                f"<line x1='-9' x2='9' y1='0' y2='0' stroke='{_AMBER}' stroke-opacity='0.35' "
                "stroke-width='10'/>",
                "slowed (while it lasted)",
            )
        )
    for kind in MARK_KINDS:
        count = sum(1 for m in marks if m.kind == kind)
        if count:
            items.append((_GLYPHS[kind], f"{LABELS[kind]} ({count})"))
    out = ["<g class='legend'>"]
    x, row = float(_LEFT), 0
    for symbol, label in items:
        w = 28 + 6.8 * len(label) + 18
        if x + w > width - _RIGHT and x > _LEFT:
            x, row = float(_LEFT), row + 1
        y = height + 8 + row * _LEGEND_ROW
        out.append(
            f"<g transform='translate({_f(x + 9)},{_f(y)})'>{symbol}"
            f"<text x='16' y='4'>{escape(label)}</text></g>"
        )
        x += w
    out.append("</g>")
    return out, (row + 1) * _LEGEND_ROW + 6 if items else 0

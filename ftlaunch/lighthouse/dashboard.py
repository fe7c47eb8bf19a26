"""HTML dashboard of the lighthouse, rendered from its status.

Rendering from the same `LighthouseStatus` that ``GET /status`` serves keeps the two views
consistent and makes the page a pure function we can test. Every value that came from a client
(replica ids, addresses, reasons, free-form data) goes through `html.escape`.
"""

from __future__ import annotations

import html
import time
from typing import Any

from ftlaunch.lighthouse.status import LighthouseStatus, SparesStatus

REFRESH_SECONDS = 2

_HEALTH_COLOURS = {"live": "#1a7f37", "silent": "#9a6700", "disconnected": "#cf222e", "failed": "#cf222e"}

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#1f2328}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:left;font-size:.9em}
th{background:#f6f8fa} .mono{font-family:ui-monospace,monospace}
.muted{color:#656d76}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _when(ts: float | None) -> str:
    if not ts:
        return ""
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int((ts % 1) * 1000):03d}"


def render(status: LighthouseStatus) -> str:
    """The dashboard page for one status snapshot (`LighthouseServer.snapshot`)."""
    opts = status.options
    quorum = status.quorum
    out: list[str] = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>",
        "<title>ftlaunch lighthouse</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>ftlaunch lighthouse <span class='muted mono'>{_e(status.address)}</span></h1>",
        "<p class='muted'>",
        f"min_replicas={_e(opts.min_replicas)} &middot; join_timeout={_e(opts.join_timeout)}s &middot; ",
        f"heartbeat_timeout={_e(opts.heartbeat_timeout)}s &middot; quorum_tick={_e(opts.quorum_tick)}s &middot; ",
        f"admin endpoints {'enabled' if opts.admin else 'disabled'} &middot; ",
        "JSON: <a href='/status'>/status</a></p>",
        "<h2>Current quorum</h2>",
    ]
    if quorum is not None:
        out.append(
            f"<p>id <span class='mono'>{_e(quorum.quorum_id)}</span>, formed {_e(_when(quorum.created))}, "
            f"{len(quorum.participants)} participant(s)</p>"
        )
        out.append(
            "<table><tr><th>replica</th><th>step</th><th>world size</th><th>address</th><th>store</th>"
            "<th>commit failures</th><th>shrink only</th></tr>"
        )
        for p in quorum.participants:
            out.append(
                f"<tr><td class='mono'>{_e(p.replica_id)}</td><td>{_e(p.step)}</td><td>{_e(p.world_size)}</td>"
                f"<td class='mono'>{_e(p.address)}</td><td class='mono'>{_e(p.store_address)}</td>"
                f"<td>{_e(p.commit_failures)}</td><td>{_e(p.shrink_only)}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>none yet</p>")
    out.append(f"<p>Decision: {_e(status.decision)}</p>")
    pending = status.pending
    out.append(f"<p>Waiting for a quorum: {_e(', '.join(pending)) if pending else '<span class=muted>nobody</span>'}</p>")

    out.append("<h2>Replica groups</h2>")
    if status.groups:
        out.append(
            "<table><tr><th>replica</th><th>health</th><th>step</th><th>last heard</th><th>connections</th>"
            "<th>in quorum</th><th>requesting</th><th>heartbeats</th><th>address</th><th>note</th></tr>"
        )
        for g in status.groups:
            colour = _HEALTH_COLOURS.get(g.health.value, "#1f2328")
            out.append(
                f"<tr><td class='mono'>{_e(g.replica_id)}</td>"
                f"<td style='color:{colour};font-weight:600'>{_e(g.health.value)}</td>"
                f"<td>{_e(g.step)}</td><td>{_e(f'{g.last_seen_age:.2f}')}s ago</td>"
                f"<td>{_e(g.connections)}</td><td>{'yes' if g.in_quorum else ''}</td>"
                f"<td>{'yes' if g.requesting else ''}</td><td>{_e(g.heartbeats)}</td>"
                f"<td class='mono'>{_e(g.address)}</td><td>{_e(g.reason)}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>no replica group has contacted the lighthouse yet</p>")
    if status.evicted:
        out.append(f"<p>Evicted, not yet told: <span class='mono'>{_e(', '.join(status.evicted))}</span></p>")

    if status.spares is not None:
        out += _spares_html(status.spares)

    out.append("<h2>History (quorum changes and failures, newest first)</h2>")
    if status.history:
        out.append("<table><tr><th>time</th><th>event</th><th>replica</th><th>detail</th></tr>")
        for h in status.history:
            detail = h.detail
            if h.event == "quorum":
                detail = f"id {h.quorum_id}: {', '.join(h.participants or ())} — {detail}"
            out.append(
                f"<tr><td>{_e(_when(h.time))}</td><td>{_e(h.event)}</td>"
                f"<td class='mono'>{_e(h.replica_id or '')}</td><td>{_e(detail)}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>nothing happened yet</p>")
    out.append("</body></html>")
    return "\n".join(out)


def _spares_html(spares: SparesStatus) -> list[str]:
    """The slot table of a job with hot spares: who holds each replica-group slot, who waits."""
    out = [f"<h2>Slots and hot spares ({len(spares.waiting)} waiting, {spares.promotions} promoted)</h2>",
           "<table><tr><th>slot</th><th>held as</th><th>holder</th><th>state</th><th>held for</th></tr>"]
    for s in spares.slots:
        held = f"{s.held_for:.1f}s" if s.held_for is not None else ""
        out.append(
            f"<tr><td>{_e(s.slot)}</td><td class='mono'>{_e(s.replica_id or '')}</td>"
            f"<td class='mono'>{_e(s.holder or '')}</td><td>{_e(s.state)}</td><td>{_e(held)}</td></tr>"
        )
    out.append("</table>")
    if spares.waiting:
        waiting = ", ".join(f"{w.claimant} ({w.waiting_for:.1f}s)" for w in spares.waiting)
        out.append(f"<p>Spares waiting: <span class='mono'>{_e(waiting)}</span></p>")
    else:
        out.append("<p class='muted'>no spare waiting: the next failure restarts and rejoins</p>")
    if spares.fenced:
        out.append(f"<p>Replaced (refused if heard again): <span class='mono'>{_e(', '.join(spares.fenced))}</span></p>")
    return out

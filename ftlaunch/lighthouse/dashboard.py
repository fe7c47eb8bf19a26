"""HTML dashboard of the lighthouse, rendered from its JSON status.

Rendering from the same dict that ``GET /status`` returns keeps the two views consistent and makes
the page a pure function we can test. Every value that came from a client (replica ids, addresses,
reasons, free-form data) goes through `html.escape`.
"""

from __future__ import annotations

import html
import time
from typing import Any

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


def render(status: dict) -> str:
    """The dashboard page for one `LighthouseServer.status()` snapshot."""
    opts = status.get("options", {})
    quorum = status.get("quorum")
    out: list[str] = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{REFRESH_SECONDS}'>",
        "<title>ftlaunch lighthouse</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>ftlaunch lighthouse <span class='muted mono'>{_e(status.get('address', ''))}</span></h1>",
        "<p class='muted'>",
        f"min_replicas={_e(opts.get('min_replicas'))} &middot; join_timeout={_e(opts.get('join_timeout'))}s &middot; ",
        f"heartbeat_timeout={_e(opts.get('heartbeat_timeout'))}s &middot; quorum_tick={_e(opts.get('quorum_tick'))}s &middot; ",
        f"admin endpoints {'enabled' if opts.get('admin') else 'disabled'} &middot; ",
        "JSON: <a href='/status'>/status</a></p>",
        "<h2>Current quorum</h2>",
    ]
    if quorum:
        out.append(
            f"<p>id <span class='mono'>{_e(quorum['quorum_id'])}</span>, formed {_e(_when(quorum.get('created')))}, "
            f"{len(quorum['participants'])} participant(s)</p>"
        )
        out.append(
            "<table><tr><th>replica</th><th>step</th><th>world size</th><th>address</th><th>store</th>"
            "<th>commit failures</th><th>shrink only</th></tr>"
        )
        for p in quorum["participants"]:
            out.append(
                f"<tr><td class='mono'>{_e(p['replica_id'])}</td><td>{_e(p['step'])}</td><td>{_e(p['world_size'])}</td>"
                f"<td class='mono'>{_e(p['address'])}</td><td class='mono'>{_e(p['store_address'])}</td>"
                f"<td>{_e(p['commit_failures'])}</td><td>{_e(p['shrink_only'])}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>none yet</p>")
    out.append(f"<p>Decision: {_e(status.get('decision', ''))}</p>")
    pending = status.get("pending") or []
    out.append(f"<p>Waiting for a quorum: {_e(', '.join(pending)) if pending else '<span class=muted>nobody</span>'}</p>")

    out.append("<h2>Replica groups</h2>")
    groups = status.get("groups") or []
    if groups:
        out.append(
            "<table><tr><th>replica</th><th>health</th><th>step</th><th>last heard</th><th>connections</th>"
            "<th>in quorum</th><th>requesting</th><th>heartbeats</th><th>address</th><th>note</th></tr>"
        )
        for g in groups:
            colour = _HEALTH_COLOURS.get(g["health"], "#1f2328")
            age = f"{float(g['last_seen_age']):.2f}"
            out.append(
                f"<tr><td class='mono'>{_e(g['replica_id'])}</td>"
                f"<td style='color:{colour};font-weight:600'>{_e(g['health'])}</td>"
                f"<td>{_e(g['step'])}</td><td>{_e(age)}s ago</td>"
                f"<td>{_e(g['connections'])}</td><td>{'yes' if g['in_quorum'] else ''}</td>"
                f"<td>{'yes' if g['requesting'] else ''}</td><td>{_e(g['heartbeats'])}</td>"
                f"<td class='mono'>{_e(g['address'])}</td><td>{_e(g['reason'])}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>no replica group has contacted the lighthouse yet</p>")
    evicted = status.get("evicted") or []
    if evicted:
        out.append(f"<p>Evicted, not yet told: <span class='mono'>{_e(', '.join(evicted))}</span></p>")

    out.append("<h2>History (quorum changes and failures, newest first)</h2>")
    history = status.get("history") or []
    if history:
        out.append("<table><tr><th>time</th><th>event</th><th>replica</th><th>detail</th></tr>")
        for h in history:
            detail = h.get("detail", "")
            if h.get("event") == "quorum":
                detail = f"id {h.get('quorum_id')}: {', '.join(h.get('participants', []))} — {detail}"
            out.append(
                f"<tr><td>{_e(_when(h.get('time')))}</td><td>{_e(h.get('event', ''))}</td>"
                f"<td class='mono'>{_e(h.get('replica_id') or '')}</td><td>{_e(detail)}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>nothing happened yet</p>")
    out.append("</body></html>")
    return "\n".join(out)

"""HTML dashboard of the lighthouse, rendered from its status.

Rendering from the same `LighthouseStatus` that ``GET /status`` serves keeps the two views
consistent and makes the page a pure function we can test. Every value that came from a client
(replica ids, addresses, reasons, free-form data) goes through `html.escape`.

Times carry their date and zone; quorum ids read as ``#N`` (the quorum change's number within the
lighthouse's run, `decode_quorum_id`) with the raw id on hover. The Evict/Kill buttons call the admin
endpoints with a token the user types into the page: the page never contains the token, the request
carries it (``Authorization: Bearer``), and the lighthouse checks it as for any admin call. The page
refreshes its content in place (a whole-page reload would clear the typed token); without
JavaScript it falls back to a meta refresh.

The page opens on the training's picture: each group's step against time with its failures and
rejoins marked, drawn by the same renderer as the timeline ``ftlaunch`` writes at exit
(`timeline_svg`), inline, so it is redrawn with every refresh. The lines are the groups' progress
series (``/status``'s ``progress[].timeline``), the marks come from the history (`timeline_of`).
"""

from __future__ import annotations

import html
from datetime import datetime
from typing import Any

from ftlaunch.lighthouse import timeline_svg
from ftlaunch.lighthouse.health import FAILING as HEALTH_FAILED
from ftlaunch.lighthouse.progress import GroupProgress
from ftlaunch.lighthouse.quorum import decode_quorum_id
from ftlaunch.lighthouse.status import HUNG_REASON, LighthouseStatus, SparesStatus, StragglersStatus
from ftlaunch.lighthouse.stragglers import STRAGGLER_REASON
from ftlaunch.lighthouse.timeline import (
    FAILURE,
    HANG,
    HEALTH,
    REJOIN,
    SLOW,
    STRAGGLER,
    TAKEOVER,
    Line,
    Mark,
    Timeline,
)

REFRESH_SECONDS = 2

_HEALTH_COLOURS = {"live": "#1a7f37", "silent": "#9a6700", "disconnected": "#cf222e", "failed": "#cf222e"}

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#1f2328}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:left;font-size:.9em}
th{background:#f6f8fa} .mono{font-family:ui-monospace,monospace}
.muted{color:#656d76} .num{text-align:right;white-space:nowrap}
#admin{border:1px solid #d0d7de;padding:.5em .8em;margin:.5em 0 1em;display:inline-block}
button{font-size:.85em;margin-right:.3em} #admin-result{margin-left:.5em}
#timeline svg{max-width:100%;height:auto;border:1px solid #d0d7de}
"""

# Posts to the admin endpoints with the token typed into #token (never part of the page), and
# refreshes #live in place so the typed token survives. Replica ids come from data attributes
# (escaped by the server) and go out as JSON.
_SCRIPT = """
(function(){
  function act(button){
    var token=document.getElementById('token').value;
    var out=document.getElementById('admin-result');
    if(!token){out.textContent='type the job token first';return;}
    var rid=button.dataset.replica, action=button.dataset.action;
    if(!window.confirm(action+' '+rid+'?'))return;
    fetch('/admin/'+action,{method:'POST',headers:{'Authorization':'Bearer '+token,
      'Content-Type':'application/json'},body:JSON.stringify(\
{replica_id:rid,reason:action+' from the dashboard'})})
      .then(function(r){return r.json().then(function(j){
        out.textContent=r.ok?(action+' '+rid+': done'):\
(action+' '+rid+': HTTP '+r.status+' '+(j.error||''));});})
      .catch(function(e){out.textContent=action+' failed: '+e;});
  }
  document.addEventListener('click',function(ev){
    var b=ev.target.closest('button[data-action]'); if(b){ev.preventDefault();act(b);}
  });
  setInterval(function(){
    fetch(window.location.pathname,{cache:'no-store'}).then(function(r){return r.text();}).then(function(t){
      var doc=new DOMParser().parseFromString(t,'text/html'), live=doc.getElementById('live');
      if(live){document.getElementById('live').replaceWith(live);}
    }).catch(function(){});
  }, REFRESH_MS);
})();
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def when(ts: float | None) -> str:
    """``2026-11-26 23:26:12.345 UTC``: the lighthouse's local time, with date and zone."""
    if not ts:
        return ""
    dt = datetime.fromtimestamp(ts).astimezone()
    return (
        dt.strftime("%Y-%m-%d %H:%M:%S")
        + f".{dt.microsecond // 1000:03d} "
        + (dt.strftime("%Z") or dt.strftime("%z"))
    )


def quorum_label(quorum_id: int | None) -> str:
    """A quorum id as people read it: ``#N``, the quorum change's number in the lighthouse's run
    (the raw id, in a ``title``, stays one hover away)."""
    if quorum_id is None:
        return ""
    _, counter = decode_quorum_id(quorum_id)
    return (
        f"<span class='qid mono' title='quorum id {_e(quorum_id)}' "
        f"data-quorum-id='{_e(quorum_id)}'>#{_e(counter)}</span>"
    )


def _secs(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render(status: LighthouseStatus) -> str:
    """The dashboard page for one status snapshot (`LighthouseServer.snapshot`)."""
    opts = status.options
    out: list[str] = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<noscript><meta http-equiv='refresh' content='{REFRESH_SECONDS}'></noscript>",
        "<title>ftlaunch lighthouse</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>ftlaunch lighthouse <span class='muted mono'>{_e(status.address)}</span></h1>",
        "<p class='muted'>",
        f"min_replicas={_e(opts.min_replicas)} &middot; "
        + (f"expected_replicas={_e(opts.expected_replicas)} &middot; " if opts.expected_replicas else "")
        + f"join_timeout={_e(opts.join_timeout)}s &middot; ",
        f"heartbeat_timeout={_e(opts.heartbeat_timeout)}s &middot; "
        f"quorum_tick={_e(opts.quorum_tick)}s &middot; ",
        f"admin endpoints {'enabled' if opts.admin else 'disabled'} &middot; ",
        "JSON: <a href='/status'>/status</a> &middot; Prometheus: <a href='/metrics'>/metrics</a></p>",
        _admin_form(opts.admin),
        "<div id='live'>",
    ]
    out += _timeline_section(status)
    out += _quorum_section(status)
    out += _groups_section(status)
    if status.spares is not None:
        out += _spares_html(status.spares)
    if status.stragglers is not None:
        out += _stragglers_html(status.stragglers)
    out += _history_section(status)
    out.append(f"<p class='muted'>as of {_e(when(status.time))}</p>")
    out.append("</div>")
    out.append(f"<script>{_SCRIPT.replace('REFRESH_MS', str(REFRESH_SECONDS * 1000))}</script>")
    out.append("</body></html>")
    return "\n".join(out)


#: History events in which the lighthouse saw a group go down, and the mark each one makes.
_DOWN_EVENTS = {"failed": FAILURE, "disconnected": FAILURE, "evicted": FAILURE, "silent": HANG}
#: History events a mark of a group's own starts from (the picture's t = 0 is no later than them).
_MARKED = {*_DOWN_EVENTS, "straggler", "straggler_replaced", HEALTH_FAILED}


def timeline_of(status: LighthouseStatus) -> Timeline:
    """The dashboard's picture of ``status``: each group's step over time (its progress series) and
    what the history says happened to it. A group goes down when the lighthouse records it
    ``failed`` (a hang when it was declared hung), ``disconnected``, ``evicted`` or ``silent``, or the
    lighthouse replaced it as a straggler (``straggler_replaced``, or ``failed`` for it); it is
    back at the first quorum with it in again. ``straggler``: it was found slow (a moment);
    ``health_failed``: its health check began failing, its agent keeps it out (a moment). A hang also ends
    when the group is heard from again while no quorum has left it out (the same process carried on); a failed
    group's process is gone, whatever a last heartbeat of it says. A hot spare ``claimed`` a slot: it took
    over. t = 0 is the first thing the picture shows."""
    history = sorted(status.history, key=lambda h: h.time)  # the status lists it newest first
    firsts = [p.timeline[0][0] for p in status.progress if p.timeline]
    origin = min(firsts + [h.time for h in history if h.replica_id and h.event in _MARKED], default=0.0)
    lines = tuple(Line(p.replica_id, tuple((t - origin, v) for t, v in p.timeline)) for p in status.progress)
    marks: list[Mark] = []
    down: dict[str, str] = {}  # replica id -> the kind of mark that took it down
    in_quorum: set[str] = set()
    for h in history:
        rid, at = h.replica_id, h.time - origin
        if h.event == "quorum":
            in_quorum = set(h.participants or ())
            for back in sorted(set(down) & in_quorum):
                marks.append(Mark(at, REJOIN, back, "in the quorum again"))
                del down[back]
        elif rid is None:
            continue
        elif h.event == "straggler":
            marks.append(Mark(at, SLOW, rid, f"straggler: {h.detail}"))
        elif h.event == HEALTH_FAILED:
            marks.append(Mark(at, HEALTH, rid, f"health check failed, kept out: {h.detail}"))
        elif h.event == "straggler_replaced" and rid not in down:
            marks.append(Mark(at, STRAGGLER, rid, h.detail))
            down[rid] = STRAGGLER
        elif h.event in _DOWN_EVENTS and rid not in down:
            kind = (
                HANG
                if h.detail.startswith(HUNG_REASON)
                else STRAGGLER
                if h.detail.startswith(STRAGGLER_REASON)
                else _DOWN_EVENTS[h.event]
            )
            marks.append(Mark(at, kind, rid, f"{h.event}: {h.detail}" if h.detail else h.event))
            down[rid] = kind
        elif h.event == "revived" and down.get(rid) == HANG and rid in in_quorum:
            marks.append(Mark(at, REJOIN, rid, "heard from again"))
            del down[rid]
        elif h.event == "claimed":
            marks.append(Mark(at, TAKEOVER, rid, h.detail))
            down.pop(rid, None)
    end = max(status.time - origin, 0.0) if status.time else max((m.at for m in marks), default=0.0)
    when_zero = f"t = 0 at {when(origin)}; " if origin else ""
    return Timeline(
        "Steps per replica group",
        lines,
        tuple(marks),
        end,
        f"{when_zero}failures and rejoins as the lighthouse's history (below) records them",
    )


def _timeline_section(status: LighthouseStatus) -> list[str]:
    return [f"<div id='timeline'>{timeline_svg.render(timeline_of(status), height=300)}</div>"]


def _admin_form(enabled: bool) -> str:
    if not enabled:
        return (
            "<p id='admin' class='muted'>Evict/Kill are disabled: the lighthouse was started without a "
            "job token.</p>"
        )
    return (
        "<form id='admin' autocomplete='off' onsubmit='return false'>"
        "<label>Job token (for Evict/Kill; sent with the request, never stored in the page) "
        "<input id='token' type='password' size='24'></label><span id='admin-result' class='muted'></span>"
        "</form>"
    )


def _quorum_section(status: LighthouseStatus) -> list[str]:
    quorum = status.quorum
    out = ["<h2>Current quorum</h2>"]
    if quorum is not None:
        out.append(
            f"<p id='quorum'>quorum {quorum_label(quorum.quorum_id)}, formed {_e(when(quorum.created))}, "
            f"{len(quorum.participants)} participant(s) &middot; {_e(status.quorum_changes)} quorum "
            "change(s) "
            f"&middot; job step rate <span id='step-rate'>{_e(f'{status.step_rate:.2f}')}</span> steps/s</p>"
        )
        out.append(
            "<table><tr><th>replica</th><th>step</th><th>world size</th><th>address</th><th>store</th>"
            "<th>commit failures</th><th>shrink only</th></tr>"
        )
        for p in quorum.participants:
            out.append(
                "<tr><td "
                f"class='mono'>{_e(p.replica_id)}</td><td>{_e(p.step)}</td><td>{_e(p.world_size)}</td>"
                f"<td class='mono'>{_e(p.address)}</td><td class='mono'>{_e(p.store_address)}</td>"
                f"<td>{_e(p.commit_failures)}</td><td>{_e(p.shrink_only)}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>none yet</p>")
    out.append(f"<p>Decision: {_e(status.decision)}</p>")
    pending = status.pending
    out.append(
        "<p>Waiting for a quorum: "
        f"{_e(', '.join(pending)) if pending else '<span class=muted>nobody</span>'}</p>"
    )
    return out


def _progress_cells(p: GroupProgress | None) -> str:
    if p is None:
        return "<td></td>" * 7
    return (
        f"<td class='num'>{_e(p.committed)}</td><td class='num step-rate'>{_e(f'{p.step_rate:.2f}')}</td>"
        f"<td class='num'>{_e(_secs(p.step_seconds))}</td><td class='num'>{_e(p.heals)}</td>"
        f"<td class='num heal-time'>{_e(f'{p.heal_seconds:.2f}')} s</td><td class='num'>{_e(p.restarts)}</td>"
        f"<td class='num durable' title='{_e(_durable_title(p))}'>{_e(p.durable_step or '-')}</td>"
    )


def _durable_title(p: GroupProgress) -> str:
    """The durable-checkpoint figures behind the group's "durable step" cell."""
    resumed = f", resumed from step {p.resumed_from}" if p.resumed_from else ""
    return (
        f"{p.durable_saves} saved ({p.durable_seconds:.2f} s the last), {p.durable_skipped} skipped, "
        f"{p.durable_failed} failed{resumed}"
    )


_PROGRESS_HEADERS = (
    "<th>committed</th><th>steps/s</th><th>step time</th><th>heals</th><th>heal time</th><th>restarts</th>"
    "<th>durable step</th>"
)


def _groups_section(status: LighthouseStatus) -> list[str]:
    out = ["<h2>Replica groups</h2>"]
    if status.groups:
        out.append(
            "<table id='groups'><tr><th>replica</th><th>health</th><th>step</th>"
            + _PROGRESS_HEADERS
            + "<th>last heard</th><th>first seen</th><th>connections</th><th>in "
            "quorum</th><th>requesting</th>"
            "<th>heartbeats</th><th>address</th><th>note</th><th>actions</th></tr>"
        )
        disabled = "" if status.options.admin else " disabled"
        for g in status.groups:
            colour = _HEALTH_COLOURS.get(g.health.value, "#1f2328")
            rid = _e(g.replica_id)
            progress = status.group_progress(g.replica_id)
            step = max(g.step, progress.step) if progress is not None else g.step  # reports may be newer
            out.append(
                f"<tr data-replica='{rid}'><td class='mono'>{rid}</td>"
                f"<td style='color:{colour};font-weight:600'>{_e(g.health.value)}</td>"
                f"<td>{_e(step)}</td>{_progress_cells(progress)}"
                f"<td>{_e(f'{g.last_seen_age:.2f}')} s ago</td><td>{_e(when(g.first_seen))}</td>"
                f"<td>{_e(g.connections)}</td><td>{'yes' if g.in_quorum else ''}</td>"
                f"<td>{'yes' if g.requesting else ''}</td><td>{_e(g.heartbeats)}</td>"
                f"<td class='mono'>{_e(g.address)}</td><td>{_e(g.reason)}</td>"
                f"<td><button type='button' data-action='evict' data-replica='{rid}'{disabled}>Evict</button>"
                "<button type='button' data-action='kill' "
                f"data-replica='{rid}'{disabled}>Kill</button></td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>no replica group has contacted the lighthouse yet</p>")
    known = {g.replica_id for g in status.groups}
    gone = [p for p in status.progress if p.replica_id not in known]
    if gone:
        out.append(
            "<h3>Groups that left</h3><table id='left'><tr><th>replica</th><th>step</th>"
            + _PROGRESS_HEADERS
            + "<th>finished</th><th>checksum</th></tr>"
        )
        for p in gone:
            out.append(
                f"<tr><td class='mono'>{_e(p.replica_id)}</td><td>{_e(p.step)}</td>{_progress_cells(p)}"
                f"<td>{'yes' if p.finished else ''}</td><td class='mono'>{_e(p.checksum)}</td></tr>"
            )
        out.append("</table>")
    if status.evicted:
        out.append(f"<p>Evicted, not yet told: <span class='mono'>{_e(', '.join(status.evicted))}</span></p>")
    return out


def _history_section(status: LighthouseStatus) -> list[str]:
    out = ["<h2>History (quorum changes and failures, newest first)</h2>"]
    if not status.history:
        return [*out, "<p class='muted'>nothing happened yet</p>"]
    out.append("<table id='history'><tr><th>time</th><th>event</th><th>replica</th><th>detail</th></tr>")
    for h in status.history:
        detail = _e(h.detail)
        if h.event == "quorum":
            detail = f"{quorum_label(h.quorum_id)}: {_e(', '.join(h.participants or ()))} — {detail}"
        out.append(
            f"<tr><td>{_e(when(h.time))}</td><td>{_e(h.event)}</td>"
            f"<td class='mono'>{_e(h.replica_id or '')}</td><td>{detail}</td></tr>"
        )
    out.append("</table>")
    return out


def _spares_html(spares: SparesStatus) -> list[str]:
    """The slot table of a job with hot spares: who holds each replica-group slot, who waits."""
    out = [
        f"<h2>Slots and hot spares ({len(spares.waiting)} waiting, {spares.promotions} promoted)</h2>",
        "<table id='spares'><tr><th>slot</th><th>held as</th><th>holder</th><th>state</th><th>held "
        "for</th></tr>",
    ]
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
        out.append(
            "<p>Replaced (refused if heard again): <span "
            f"class='mono'>{_e(', '.join(spares.fenced))}</span></p>"
        )
    return out


def _stragglers_html(st: StragglersStatus) -> list[str]:
    """Slow groups: each judged member's own work per step against the others' (medians of its last
    committed steps), which are stragglers, and the ones replaced."""
    found = st.stragglers
    title = f"{len(found)} straggler(s)" if found else "none now"
    out = [
        f"<h2>Stragglers ({_e(title)}; policy <span class='mono'>{_e(st.policy)}</span>)</h2>",
        f"<p class='muted'>A member whose own work per step (before it needs the others) is "
        f"{_e(f'{st.enter:g}')}x the other members' (medians of its last {_e(st.window)} committed "
        f"steps) is a straggler until it is back under {_e(f'{st.leave:g}')}x"
        + (
            "; replace gives a persistent one's slot to a hot spare, else restarts it"
            if st.policy == "replace"
            else ""
        )
        + ".</p>",
    ]
    if st.groups:
        out.append(
            "<table id='stragglers'><tr><th>replica</th><th>slowdown</th><th>own work per step</th>"
            "<th>others'</th><th>steps</th><th>straggler</th></tr>"
        )
        for g in st.groups:
            flag = f"since {_e(when(g.since))}" if g.straggler and g.since else ("yes" if g.straggler else "")
            style = " style='color:#cf222e;font-weight:600'" if g.straggler else ""
            out.append(
                f"<tr data-replica='{_e(g.replica_id)}'><td class='mono'>{_e(g.replica_id)}</td>"
                f"<td class='num slowdown'{style}>{_e(f'{g.slowdown:.2f}')}x</td>"
                f"<td class='num'>{_e(_secs(g.compute_seconds))}</td><td "
                f"class='num'>{_e(_secs(g.reference_seconds))}</td>"
                f"<td class='num'>{_e(g.steps)}</td><td>{flag}</td></tr>"
            )
        out.append("</table>")
    else:
        out.append("<p class='muted'>no verdict yet (every member needs a few committed steps)</p>")
    if st.replacing:
        out.append(f"<p>Replacement in flight: <span class='mono'>{_e(st.replacing)}</span></p>")
    if st.replaced:
        items = ", ".join(
            f"{r.replica_id} ({r.slowdown:.1f}x, {'hot spare' if r.how == 'spare' else 'restarted'}, "
            f"{when(r.time)})"
            for r in st.replaced
        )
        out.append(f"<p>Replaced: <span class='mono'>{_e(items)}</span></p>")
    return out

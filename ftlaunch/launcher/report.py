"""What ``ftlaunch`` tells the user about the job: the live status line and the summary at exit.

Pure formatting over the groups' accounting (`ftlaunch.launcher.group`: failures and restarts from
the agents, steps, heals and checksums from what the group leaders reported to the lighthouse), the
chaos record and the lighthouse's status (quorum id, quorum changes, step rates, per-step timings: the
figures ``/metrics`` serves). `StatusLine` throttles the redraws; `summary_lines` is the table printed
at exit. Nothing here comes from the workers' stdout, so it is right for a script that prints nothing
and never quotes a checksum it did not get from a clean exit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ftlaunch import env
from ftlaunch.launcher.chaos import Injection
from ftlaunch.launcher.group import RUNNING, Group
from ftlaunch.launcher.lighthouse_host import JobLighthouse
from ftlaunch.launcher.output import Console, format_table
from ftlaunch.lighthouse.progress import Rewind
from ftlaunch.lighthouse.status import HealthStatus, LighthouseStatus, StragglersStatus

#: Seconds between two redraws of the status line (each reads the lighthouse status).
STATUS_INTERVAL_S = 0.5

SUMMARY_HEADERS = [
    "group",
    "state",
    "steps committed",
    "last step",
    "failures",
    "restarts",
    "time to rejoin",
    "final checksum",
]


def max_step(groups: Sequence[Group]) -> int | None:
    """The furthest step any group reported."""
    return max((g.last_step for g in groups if g.last_step is not None), default=None)


def from_checkpoint(rewind: Rewind, groups: Sequence[Group]) -> bool:
    """Whether the job went back to a durable checkpoint: a group resumed from one at the step the
    job restarted from, or that step is the newest checkpoint a group published (a restarted group
    may report its resume point a moment after the lighthouse saw the rewind; without a checkpoint
    a restarted group starts from scratch, at step 0)."""
    return rewind.restarted_at > 0 and any(
        rewind.restarted_at in g.resumed_steps or rewind.restarted_at == g.durable_step for g in groups
    )


def lost(rewinds: Sequence[Rewind], groups: Sequence[Group] = ()) -> list[Rewind]:
    """The rewinds that lost progress: not those undone by a group that came back with the state,
    nor those that resumed from a durable checkpoint (of ``groups``' resume points): those cost the
    steps since the checkpoint, trained again, not the run."""
    return [r for r in rewinds if not r.recovered and not from_checkpoint(r, groups)]


def last_durable(groups: Sequence[Group]) -> Group | None:
    """The group that published the newest durable checkpoint (None: no group did)."""
    return max((g for g in groups if g.durable_step), key=lambda g: g.durable_step or 0, default=None)


def durable_text(groups: Sequence[Group], wall_now: float) -> str:
    """`` | durable step 300 (12s ago)`` for the status line, or ``""`` when nothing was saved."""
    g = last_durable(groups)
    if g is None or g.durable_step is None:
        return ""
    age = f" ({max(0.0, wall_now - g.durable_time):.0f}s ago)" if g.durable_time and wall_now else ""
    return f" | durable step {g.durable_step}{age}"


def durable_lines(groups: Sequence[Group], wall_now: float) -> list[str]:
    """The summary's account of durable checkpoints: the newest, the saves, the resume point."""
    g = last_durable(groups)
    resumed = max((x.resumed_from for x in groups if x.resumed_from), default=None)
    if g is None and resumed is None:
        return []
    parts = []
    if g is not None and g.durable_step is not None:
        age = (
            f", {max(0.0, wall_now - g.durable_time):.0f}s before the end"
            if g.durable_time and wall_now
            else ""
        )
        parts.append(
            f"last at step {g.durable_step} (written by {g.replica_id} in {g.durable_seconds:.2f}s{age}); "
            f"{sum(x.durable_saves for x in groups)} saved, {sum(x.durable_skipped for x in groups)} skipped "
            f"(the previous still being written), {sum(x.durable_failed for x in groups)} failed"
        )
    else:
        parts.append("none written by this run")
    if resumed is not None:
        parts.append(f"resumed from step {resumed}")
    return ["[ftlaunch] durable checkpoints: " + "; ".join(parts)]


def status_text(
    groups: Sequence[Group],
    quorum_id: int | None,
    elapsed: float,
    rewinds: Sequence[Rewind] = (),
    wall_now: float = 0.0,
) -> str:
    """The one-line status: quorum, step, groups up, failures, restarts, time; the newest durable
    checkpoint and its age (``wall_now``: the wall clock); and whether the job lost progress (the
    last time it did)."""
    up = sum(1 for g in groups if g.state == RUNNING)
    step = max_step(groups)
    losses = lost(rewinds, groups)
    resumes = [r for r in rewinds if not r.recovered and from_checkpoint(r, groups)]
    return (
        f"[ftlaunch] quorum {quorum_id if quorum_id is not None else '-'} | "
        f"step {step if step is not None else '-'} | groups up {up}/{len(groups)} | "
        f"failures {sum(g.failures for g in groups)} | restarts {sum(g.restarts for g in groups)} | "
        f"{elapsed:.0f}s"
        + durable_text(groups, wall_now)
        + (
            f" | PROGRESS LOST: restarted from step {losses[-1].restarted_at} after step {losses[-1].reached}"
            if losses
            else f" | resumed from durable step {resumes[-1].restarted_at} after step {resumes[-1].reached}"
            if resumes
            else ""
        )
    )


def rewind_lines(rewinds: Sequence[Rewind], started_wall: float, groups: Sequence[Group] = ()) -> list[str]:
    """The summary's account of the times the job went back to an earlier step (``started_wall``:
    the launch, on the lighthouse's wall clock, for the times; ``groups``: whose resume points
    tell a return to a durable checkpoint from lost progress)."""
    lines = []
    for r in rewinds:
        at = f"t={r.wall - started_wall:.1f}s"
        if not r.recovered and from_checkpoint(r, groups):
            lines.append(
                f"[ftlaunch] note: at {at} no replica group holding "
                f"the trained state of step {r.reached} was "
                f"left; the job resumed from the durable checkpoint of step {r.restarted_at} and trained "
                f"{r.reached - r.restarted_at} step(s) again ({r.restarted_at}..{r.reached})"
            )
        elif r.recovered:
            lines.append(
                f"[ftlaunch] note: at {at} no group holding step {r.reached} was reachable and the job went "
                f"back to step {r.restarted_at}; a group holding "
                "that state came back and training went on from it"
            )
        else:
            lines.append(
                f"[ftlaunch] WARNING: progress lost: at {at} no "
                "replica group holding the trained state of step "
                f"{r.reached} was left (no durable checkpoint); "
                f"the job restarted from step {r.restarted_at} and "
                f"trained steps {r.restarted_at}..{r.reached} again"
            )
    return lines


class StatusLine:
    """The status line kept at the bottom of a terminal, redrawn at most every `STATUS_INTERVAL_S`."""

    def __init__(self, console: Console, lighthouse: JobLighthouse, started: float) -> None:
        self._console = console
        self._lighthouse = lighthouse
        self._started = started
        self._last_draw = 0.0
        #: The last quorum id the lighthouse reported (kept when a read fails).
        self.quorum_id: int | None = None

    def tick(self, now: float, groups: Sequence[Group], rewinds: Sequence[Rewind] = ()) -> None:
        if not self._console.status_enabled or now - self._last_draw < STATUS_INTERVAL_S:
            return
        self._last_draw = now
        self.quorum_id = self._lighthouse.quorum_id() or self.quorum_id
        self._console.status(status_text(groups, self.quorum_id, now - self._started, rewinds, time.time()))

    def last_quorum_id(self) -> int | None:
        """The quorum id now, or the last one seen (for the summary)."""
        return self._lighthouse.quorum_id() or self.quorum_id


def summary_lines(
    code: int,
    elapsed: float,
    groups: Sequence[Group],
    quorum_id: int | None,
    injections: Sequence[Injection] | None,
    started: float,
    log_dir: str,
    lighthouse: LighthouseStatus | None = None,
    rewinds: Sequence[Rewind] = (),
    started_wall: float = 0.0,
    timeline: str | None = None,
) -> list[str]:
    """The summary printed at exit with the job's exit ``code`` (0: it finished; ``injections`` None:
    it ran without ``--chaos``; ``lighthouse``: its last status, for the figures ``/metrics`` serves;
    ``rewinds``: the times the job went back to an earlier step, ``started_wall`` the launch on the
    lighthouse's clock; ``timeline``: where the picture of the run was written, if it was)."""
    lines = [
        "",
        f"[ftlaunch] summary: exit {code} after {elapsed:.1f}s"
        + (f", last quorum id {quorum_id}" if quorum_id is not None else ""),
    ]
    rows = []
    for g in groups:
        rejoin = f"{max(g.rejoin_times):.1f}s max ({len(g.rejoin_times)}x)" if g.rejoin_times else "-"
        rows.append(
            [
                g.replica_id,
                g.state,
                str(g.committed),
                str(g.last_step) if g.last_step is not None else "-",
                str(g.failures),
                str(g.restarts),
                rejoin,
                g.checksum or "-",
            ]
        )
    lines += ["[ftlaunch] " + line for line in format_table(SUMMARY_HEADERS, rows)]
    lines += _checksum_lines(groups)
    lines += durable_lines(groups, time.time())
    lines += rewind_lines(rewinds, started_wall, groups)
    if lighthouse is not None and lighthouse.progress:
        lines += lighthouse_lines(lighthouse)
    if lighthouse is not None and lighthouse.stragglers is not None:
        lines += straggler_lines(lighthouse.stragglers)
    if lighthouse is not None:
        lines += health_lines(lighthouse.health)
    if injections is not None:
        lines.append(f"[ftlaunch] chaos: {len(injections)} injection(s)")
        for inj in injections:
            at = f" at step {inj.step}" if inj.step is not None else ""
            if inj.signal == "SLOW":
                what = f"slowed down {inj.factor:g}x"
                fate = f"for {inj.lasted:.1f}s" if inj.lasted is not None else "until the end"
            else:
                what = inj.signal
                fate = (
                    f"group committed again {inj.rejoined_after:.1f}s later"
                    if inj.rejoined_after is not None
                    else "group did not commit again"
                )
            lines.append(
                f"[ftlaunch]   t={inj.at - started:.1f}s {what} "
                f"{env.replica_id(inj.group)} {inj.target}{at}: {fate}"
            )
        total = sum(g.committed for g in groups)
        losses = lost(rewinds, groups)
        lines.append(
            f"[ftlaunch] training {'finished' if code == 0 else 'did not finish'} despite "
            f"{sum(g.failures for g in groups)} failure(s); {total} committed group-steps"
            + (f"; progress was lost {len(losses)} time(s)" if losses else "")
        )
    for g in groups:
        if g.root_cause:
            lines.append(f"[ftlaunch] root cause: {g.root_cause}")
    if timeline is not None:
        lines.append(f"[ftlaunch] timeline (steps per group, failures and rejoins): {timeline}")
    if code != 0 or lost(rewinds, groups):
        lines.append(f"[ftlaunch] logs kept in {log_dir}")
    return lines


def _checksum_lines(groups: Sequence[Group]) -> list[str]:
    """Only checksums the group leaders reported at a clean exit count; equal checksums taken at
    different steps are not "bit-identical"."""
    with_sum = [g for g in groups if g.checksum]
    if not with_sum:
        return []
    sums = {g.checksum for g in with_sum}
    steps = {g.checksum_step for g in with_sum}
    if len(sums) == 1 and len(steps) == 1:
        return [f"[ftlaunch] {len(with_sum)}/{len(groups)} groups ended bit-identical ({sums.pop()})"]
    if len(steps) > 1:
        at = ", ".join(f"{g.replica_id} at step {g.checksum_step}" for g in with_sum)
        return [f"[ftlaunch] WARNING: groups ended at different steps: {at}"]
    return [f"[ftlaunch] WARNING: groups ended with different weights: {sorted(s for s in sums if s)}"]


LIGHTHOUSE_HEADERS = [
    "group",
    "heals",
    "heal time",
    "step time",
    "quorum wait",
    "commit",
    "own work",
    "slowdown",
    "steps/s",
]


def lighthouse_lines(status: LighthouseStatus) -> list[str]:
    """The lighthouse's figures at exit (the same as ``/metrics``): per job and per group."""
    lines = [
        f"[ftlaunch] lighthouse: {status.quorum_changes} quorum change(s); per group, as the group "
        "leaders reported (times of the last committed step):"
    ]
    judged = {v.replica_id: v for v in status.stragglers.groups} if status.stragglers is not None else {}

    def slowdown(rid: str) -> str:
        v = judged.get(rid)
        return "-" if v is None else f"{v.slowdown:.1f}x" + (" straggler" if v.straggler else "")

    rows = [
        [
            p.replica_id,
            str(p.heals),
            f"{p.heal_seconds:.2f}s",
            f"{p.step_seconds * 1e3:.1f}ms",
            f"{p.quorum_seconds * 1e3:.1f}ms",
            f"{p.commit_seconds * 1e3:.1f}ms",
            f"{p.compute_seconds * 1e3:.1f}ms",
            slowdown(p.replica_id),
            f"{p.step_rate:.1f}",
        ]
        for p in status.progress
    ]
    return lines + ["[ftlaunch]   " + line for line in format_table(LIGHTHOUSE_HEADERS, rows)]


def straggler_lines(st: StragglersStatus) -> list[str]:
    """The stragglers the lighthouse judged at the end (slowdown: a group's own work per step over
    the other groups'), and those it replaced (``--stragglers replace``)."""
    lines = []
    if st.stragglers:
        found = ", ".join(f"{v.replica_id} {v.slowdown:.1f}x slower" for v in st.stragglers)
        lines.append(f"[ftlaunch] stragglers at the end (--stragglers {st.policy}): {found}")
    for r in st.replaced:
        how = "its slot went to a hot spare" if r.how == "spare" else "it was restarted (no hot spare waited)"
        came = (
            f", whose first step committed {r.arrived - r.time:.1f}s later"
            if r.arrived is not None
            else "; its replacement committed no step"
        )
        lines.append(f"[ftlaunch] straggler {r.replica_id} ({r.slowdown:.1f}x slower) replaced: {how}{came}")
    return lines


def health_lines(health: Sequence[HealthStatus]) -> list[str]:
    """The groups whose health check failed before they (re)joined (``--health-check``): which
    check, how often, and -- for one still failing at the end, kept out -- its last line."""
    lines = []
    for h in health:
        if not h.failures:
            continue
        if h.ok:
            lines.append(
                f"[ftlaunch] health check of {h.replica_id} failed {h.failures} time(s), then passed "
                f"(the group joined): {h.check}"
            )
        else:
            lines.append(
                f"[ftlaunch] WARNING: health check of {h.replica_id} still failing at the end "
                f"({h.failures} failure(s); the group stayed out): {h.check}: {h.last_line}"
            )
    return lines

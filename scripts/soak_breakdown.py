"""Where a chaos soak's lost time went: per cause and per injection (used by scripts/soak.py).

*Lost time* is the chaos run's training time minus the fault-free run's, for the same steps. It is
split exactly (the buckets add up to it) along the job's *frontier*: the time at which each step was
first committed by any group. Every interval between two frontier steps is compared with the
fault-free run's mean interval:

* an interval longer than the stall threshold is a **stall** of the whole job (no group committed),
  attributed to the fault that explains it: the lighthouse outage (crash -> restart -> the first
  quorum after it), a SIGSTOPped group (the survivors are blocked in a collective with it until it
  resumes, or until their collective timeout when it outlasts ``stop_for``), a SIGKILL (the
  survivors' next quorum and reconfigure), a restarted group joining, or ``other``;
* a shorter pause (over 3 fault-free step intervals) while a group is SIGSTOPped counts for that
  SIGSTOP: the lighthouse declares a stopped group hung on evidence within ~0.6 s, below a stall;
* what the other shorter intervals lose together is **slower steps**: the survivors share the 2
  cores with restarting processes that import torch;
* **end of run**: from the last step to the last group's final line, beyond the fault-free run's;
* **start**: whatever is left (the first committed step later or earlier than the first step line).

Per injection it also gives the victim's way back (injection -> its next committed step) and, from
the job's phase log (``FTLAUNCH_PHASE_LOG``, `ftlaunch.phases`), when each start-up phase of the
replacement happened, counted from the injection.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

#: Restart phases reported per injection, in the order they happen (names of `ftlaunch.phases`).
PHASES = (
    "worker_exit_seen",
    "agent_exit_seen",
    "orphans_killed",
    "agent_spawned",
    "agent_start",
    "zygote_warm",
    "rendezvous_start",
    "rendezvous_done",
    "worker_seen",
    "init",
    "manager_up",
    "ready",
    "quorum",
    "configured",
    "healed",
    "first_commit",
)


@dataclass
class Timeline:
    """What the breakdown needs from one run, in one clock (seconds)."""

    commits: list[tuple[float, int, int]]  # (time, launcher group, step), committed steps of rank 0
    first_step_at: float | None
    last_final_at: float | None
    injections: list[tuple[float, str, str, int]] = field(default_factory=list)  # (time, SIGx, target, group)
    lighthouse_down: tuple[float, float | None] | None = None  # (crash, restart)
    phases: list[dict[str, Any]] = field(default_factory=list)  # records with "t" in this clock


def frontier(commits: list[tuple[float, int, int]]) -> list[tuple[int, float]]:
    """(step, first time any group committed it), by step."""
    first: dict[int, float] = {}
    for t, _, step in commits:
        if step not in first or t < first[step]:
            first[step] = t
    return sorted(first.items())


def _group_rejoins(commits: list[tuple[float, int, int]], gap: float) -> list[float]:
    """Times a group committed again after not committing for more than ``gap`` seconds."""
    by_group: dict[int, list[float]] = {}
    for t, g, _ in sorted(commits):
        by_group.setdefault(g, []).append(t)
    return [b for ts in by_group.values() for a, b in zip(ts, ts[1:], strict=False) if b - a > gap]


#: A stall at least this long waited for a timeout (the collective timeout is 60 s by default).
TIMEOUT_STALL_S = 30.0


def stall_cause(a: float, b: float, tl: Timeline, stop_for: float, rejoins: list[float]) -> str:
    """Why no group committed from ``a`` to ``b``."""
    cause = _stall_cause(a, b, tl, stop_for, rejoins)
    if b - a >= TIMEOUT_STALL_S and not cause.startswith(("lighthouse", "SIGSTOP: survivors blocked past")):
        cause += " -- blocked until a timeout (a configure or collective with a group that died)"
    return cause


#: A pause shorter than a stall counts for a SIGSTOP (not as slower steps) when it is this many fault-free
#: step intervals long and begins while a group is stopped: the lighthouse declares a stopped group
#: hung on evidence within ~0.6 s, below the stall threshold (1 s).
SHORT_STALL_STEPS = 3.0
STOP_CAUSE = "SIGSTOP: survivors blocked until the group is declared hung or resumes"


def _after_a_stop(a: float, b: float, tl: Timeline, stop_for: float) -> bool:
    return any(sig == "SIGSTOP" and t <= b and a <= t + stop_for for t, sig, _, _ in tl.injections)


def _stall_cause(a: float, b: float, tl: Timeline, stop_for: float, rejoins: list[float]) -> str:
    if tl.lighthouse_down is not None:
        crash, back = tl.lighthouse_down
        if crash <= b and (back is None or a <= back):  # began during the outage
            return "lighthouse restart (outage, reconnect, resume quorum)"
    for t, sig, _, _ in tl.injections:
        if sig == "SIGSTOP" and t <= b and t + stop_for + 1.0 >= a:
            if b - a > stop_for + 5.0:
                return "SIGSTOP: survivors blocked past the stop (collective timeout)"
            return STOP_CAUSE
    for t, sig, target, _ in tl.injections:
        if sig == "SIGKILL" and a - 2.0 <= t <= b:
            return f"SIGKILL {target}: survivors' next quorum and reconfigure"
    if any(b - 0.5 <= r <= b + 0.5 for r in rejoins):
        return "a restarted group joins (survivors' reconfigure)"
    return "other"


def breakdown(
    chaos: Timeline, base: Timeline, stop_for: float, lighthouse_down: float | None = None
) -> dict[str, Any] | None:
    """Lost time per cause (seconds, summing to the total) and per injection; None without data.

    Also the *waiting bound* (``design_bound_goodput``): the goodput a run would reach if the
    survivors waited out exactly what the faults impose -- ``stop_for`` per SIGSTOP, the dead
    lighthouse's ``lighthouse_down`` -- and lost nothing else. It was the design's limit before a
    hung group was declared on evidence and an outage stepped through; a run above it shows those."""
    cf, bf = frontier(chaos.commits), frontier(base.commits)
    if (
        len(cf) < 2
        or len(bf) < 2
        or None in (chaos.first_step_at, chaos.last_final_at, base.first_step_at, base.last_final_at)
    ):
        return None
    assert chaos.first_step_at is not None and chaos.last_final_at is not None  # noqa: S101 - checked
    assert base.first_step_at is not None and base.last_final_at is not None  # noqa: S101 - checked
    mean = (bf[-1][1] - bf[0][1]) / (len(bf) - 1)
    threshold = max(1.0, 5 * mean)
    rejoins = _group_rejoins(chaos.commits, gap=2.0)
    causes: dict[str, float] = {}
    stalls: list[dict[str, Any]] = []
    slower = 0.0
    for (_, a), (step, b) in zip(cf, cf[1:], strict=False):
        excess = (b - a) - mean
        if b - a > threshold:
            cause = stall_cause(a, b, chaos, stop_for, rejoins)
            causes[cause] = causes.get(cause, 0.0) + excess
            stalls.append(
                {
                    "at": round(a - chaos.first_step_at, 2),
                    "seconds": round(b - a, 2),
                    "step": step,
                    "cause": cause,
                }
            )
        elif b - a > SHORT_STALL_STEPS * mean and _after_a_stop(a, b, chaos, stop_for):
            causes[STOP_CAUSE] = causes.get(STOP_CAUSE, 0.0) + excess  # declared hung within ~0.6 s
        else:
            slower += excess
    causes["slower steps (CPU shared with restarting groups)"] = slower
    # Steps missing from one frontier (none normally) are counted as slower steps of the mean.
    causes["slower steps (CPU shared with restarting groups)"] += (len(bf) - len(cf)) * mean
    end = (chaos.last_final_at - cf[-1][1]) - (base.last_final_at - bf[-1][1])
    causes["end of run (last step -> last group's final line)"] = end
    lost = (chaos.last_final_at - chaos.first_step_at) - (base.last_final_at - base.first_step_at)
    causes["start (first step line -> first committed step)"] = lost - sum(causes.values())
    imposed = sum(stop_for for _, sig, _, _ in chaos.injections if sig == "SIGSTOP")
    if chaos.lighthouse_down is not None and lighthouse_down is not None:
        imposed += lighthouse_down
    base_time = base.last_final_at - base.first_step_at
    return {
        "lost_s": round(lost, 2),
        "imposed_by_the_faults_s": round(imposed, 2),
        "design_bound_goodput": round(base_time / (base_time + imposed), 3) if base_time > 0 else None,
        "baseline_step_interval_s": round(mean, 4),
        "stall_threshold_s": round(threshold, 2),
        "lost_by_cause_s": {k: round(v, 2) for k, v in sorted(causes.items(), key=lambda kv: -kv[1])},
        "stalls": stalls,
        "injections": per_injection(chaos),
        "restart_phases_median_s": phase_medians(chaos),
    }


def per_injection(tl: Timeline) -> list[dict[str, Any]]:
    """Each injection: whom, and seconds from it to the victim's next committed step."""
    out = []
    origin = tl.first_step_at or 0.0
    for t, sig, target, g in tl.injections:
        # Back = the victim's first commit after a pause of its own (> 1 s) that ends after the
        # injection: lines already in flight, or the workers of a killed agent that live on until
        # the supervisor ends them, are not a return. None: it never committed again (with hot
        # spares, a spare took its slot and it stayed a spare).
        own = sorted(c for c, grp, _ in tl.commits if grp == g)
        back = next(
            (b for a, b in zip(own, own[1:], strict=False) if b > t and b - a > 1.0 and b - t > 0.0), None
        )
        out.append(
            {
                "at": round(t - origin, 1),
                "signal": sig,
                "target": target,
                "group": g,
                "victim_back_after_s": None if back is None else round(back - t, 2),
            }
        )
    return out


def phase_medians(tl: Timeline) -> dict[str, dict[str, float]]:
    """Per kind of injection, the median time from it to each restart phase of the victim group
    (the first record of the phase for that group after the injection, before its next injection)."""
    by_kind: dict[str, dict[str, list[float]]] = {}
    kills = sorted(tl.injections)
    for i, (t, sig, target, g) in enumerate(kills):
        if sig != "SIGKILL":
            continue
        until = min((u for u, _, _, h in kills[i + 1 :] if h == g), default=float("inf"))
        seen: dict[str, float] = {}
        for rec in sorted(tl.phases, key=lambda r: r["t"]):
            if str(rec.get("replica")) != str(g) or not t <= rec["t"] < until:
                continue
            name = rec.get("phase")
            if name == "worker_exit_seen" and target == "agent":
                continue  # the killed agent's watcher is gone; a later one is the new workers' end
            if name in PHASES and name not in seen:
                seen[name] = rec["t"] - t
                if name == "init" and isinstance(rec.get("process_start"), float):
                    seen.setdefault("worker_process_start", rec["process_start"] - t)
            if name == "first_commit":
                break  # the victim is back
        kind = by_kind.setdefault(f"{sig} {target}", {})
        for name, dt in seen.items():
            kind.setdefault(name, []).append(dt)
    order = {name: i for i, name in enumerate(("worker_process_start", *PHASES))}
    order["worker_process_start"] = order["init"] - 0.5
    return {
        kind: {
            name: round(statistics.median(v), 2)
            for name, v in sorted(phases.items(), key=lambda kv: order[kv[0]])
        }
        for kind, phases in by_kind.items()
    }


def print_breakdown(b: dict[str, Any]) -> None:
    if b.get("design_bound_goodput") is not None:
        print(
            f"  waiting bound: {b['imposed_by_the_faults_s']:.1f} s are the faults' own (stop_for per "
            "SIGSTOP, "
            f"the lighthouse's downtime); survivors that waited them out would reach at most "
            f"{b['design_bound_goodput']:.1%} (they no longer do: a hung group is declared on evidence, "
            f"an outage is stepped through on the last quorum)"
        )
    print(
        f"  where the {b['lost_s']:.1f} s lost went (fault-free step interval "
        f"{b['baseline_step_interval_s']:.3f} s; "
        f"a stall: no group committed for > {b['stall_threshold_s']:.1f} s):"
    )
    for cause, seconds in b["lost_by_cause_s"].items():
        print(f"    {seconds:8.1f} s  {cause}")
    longest = sorted(b["stalls"], key=lambda s: -s["seconds"])[:8]
    if longest:
        print(
            "  longest stalls: "
            + "; ".join(f"{s['seconds']:.1f}s at t={s['at']:.0f}s ({s['cause']})" for s in longest)
        )
    for kind, phases in b["restart_phases_median_s"].items():
        if not phases:
            continue
        print(f"  {kind}: median seconds from the injection to each phase of the victim's restart:")
        print("    " + ", ".join(f"{name} {dt:.1f}" for name, dt in phases.items()))

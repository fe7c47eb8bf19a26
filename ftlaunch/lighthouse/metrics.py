"""``GET /metrics``: the lighthouse's status in Prometheus' text format (docs/lighthouse.md, *Metrics*).

A custom collector over the same `LighthouseStatus` that ``/status`` and the dashboard show, so the
three views agree and nothing is counted twice: each scrape takes one snapshot and turns it into
metric families. No global registry and no metric objects updated on the hot path: the quorum
requests never pay for metrics, a scrape does. `prometheus_client` does the text format (escaping,
``_total`` suffixes, HELP/TYPE lines).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ftlaunch.lighthouse.quorum import Health
from ftlaunch.lighthouse.status import LighthouseStatus

#: The state label of a group the lighthouse no longer tracks (it left, or was evicted) but whose
#: progress it keeps.
LEFT = "left"
STATES = (*(h.value for h in Health), LEFT)


class StatusCollector:
    """A `prometheus_client` collector: one status snapshot per scrape, as metric families."""

    def __init__(self, snapshot: Callable[[], LighthouseStatus]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from families(self._snapshot())


def families(status: LighthouseStatus) -> Iterator[Metric]:
    """The metric families of one status (pure: tested without a server)."""
    yield from _job(status)
    yield from _groups(status)


def _job(status: LighthouseStatus) -> Iterator[Metric]:
    quorum = status.quorum
    g = GaugeMetricFamily("ftlaunch_quorum_id", "Id of the current quorum (absent before the first one).")
    if quorum is not None:
        g.add_metric([], quorum.quorum_id)
    yield g
    yield GaugeMetricFamily(
        "ftlaunch_quorum_participants",
        "Replica groups in the current quorum.",
        value=len(quorum.participants) if quorum is not None else 0,
    )
    yield CounterMetricFamily(
        "ftlaunch_quorum_changes",
        "Quorums formed with a new id (membership changed or a step failed).",
        value=status.quorum_changes,
    )
    yield CounterMetricFamily(
        "ftlaunch_progress_lost",
        "Times the job restarted from an earlier step: no group holding the trained state was left.",
        value=sum(1 for r in status.rewinds if not r.recovered),
    )
    yield GaugeMetricFamily(
        "ftlaunch_step_rate", "The job's committed steps per second (last 10 s).", value=status.step_rate
    )
    yield GaugeMetricFamily(
        "ftlaunch_pending_quorum_requests", "Groups waiting for a quorum.", value=len(status.pending)
    )
    yield GaugeMetricFamily(
        "ftlaunch_min_replicas", "The lighthouse's --min-replicas.", value=status.options.min_replicas
    )
    yield GaugeMetricFamily(
        "ftlaunch_expected_replicas",
        "Groups the launcher announced (0: none).",
        value=status.options.expected_replicas,
    )
    counts = GaugeMetricFamily("ftlaunch_groups", "Replica groups by state.", labels=["state"])
    known = {g.replica_id for g in status.groups}
    by_state = {s: 0 for s in STATES}
    for grp in status.groups:
        by_state[grp.health.value] += 1
    by_state[LEFT] = sum(1 for p in status.progress if p.replica_id not in known)
    for state, n in by_state.items():
        counts.add_metric([state], n)
    yield counts
    spares = _spares(status)
    if spares is not None:
        yield GaugeMetricFamily("ftlaunch_spares", "Hot spare groups waiting to be promoted.", value=spares)
    stragglers = status.stragglers
    if stragglers is not None:
        yield GaugeMetricFamily(
            "ftlaunch_stragglers",
            "Members of the current quorum judged stragglers.",
            value=len(stragglers.stragglers),
        )
        yield CounterMetricFamily(
            "ftlaunch_stragglers_replaced",
            "Stragglers replaced (--stragglers replace): by a hot spare or a restart.",
            value=stragglers.replacements,
        )


def _spares(status: LighthouseStatus) -> int | None:
    """How many spares the lighthouse holds, when it knows spares at all (a field of the status
    that the spares feature adds)."""
    spares: Any = getattr(status, "spares", None)
    if spares is None:
        return None
    return spares if isinstance(spares, int) else len(spares)


def _groups(status: LighthouseStatus) -> Iterator[Metric]:
    label = ["replica_id"]
    state = GaugeMetricFamily(
        "ftlaunch_group_state",
        "1 for the group's state (live, silent, disconnected, failed, left), 0 for the others.",
        labels=["replica_id", "state"],
    )
    in_quorum = GaugeMetricFamily(
        "ftlaunch_group_in_quorum", "1 while the group is in the current quorum.", labels=label
    )
    current = {g.replica_id: g for g in status.groups}
    rids = sorted(set(current) | {p.replica_id for p in status.progress})
    for rid in rids:
        grp = current.get(rid)
        now = grp.health.value if grp is not None else LEFT
        for s in STATES:
            state.add_metric([rid, s], 1 if s == now else 0)
        in_quorum.add_metric([rid], 1 if grp is not None and grp.in_quorum else 0)
    yield state
    yield in_quorum

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=label)

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=label)

    step = gauge("ftlaunch_group_step", "The step the group reported last.")
    committed = counter(
        "ftlaunch_group_committed_steps", "Steps the group committed, all its processes together."
    )
    failures = counter("ftlaunch_group_failures", "Times the lighthouse saw the group go down.")
    restarts = counter("ftlaunch_group_restarts", "Processes of the group after its first (restarts).")
    heals = counter("ftlaunch_group_heals", "Times the group healed from a peer's live state.")
    heal_s = counter("ftlaunch_group_heal_seconds", "Seconds the group spent fetching state from peers.")
    rate = gauge("ftlaunch_group_step_rate", "The group's committed steps per second (last 10 s).")
    step_s = gauge("ftlaunch_group_step_seconds", "Wall time of the group's last committed step.")
    quorum_s = gauge(
        "ftlaunch_group_quorum_seconds",
        "Of the last step: waiting for the quorum (reconfigure and heal included).",
    )
    commit_s = gauge(
        "ftlaunch_group_commit_seconds", "Of the last step: the commit (pending allreduces and the votes)."
    )
    compute_s = gauge(
        "ftlaunch_group_compute_seconds",
        "Of the last step: the group's own work before it needed the other groups (the straggler signal).",
    )
    d_step = gauge(
        "ftlaunch_group_durable_step", "Step of the newest durable checkpoint the group wrote (0: none)."
    )
    d_time = gauge(
        "ftlaunch_group_durable_timestamp_seconds", "When the group published it (its writer's clock)."
    )
    d_secs = gauge(
        "ftlaunch_group_durable_seconds", "Seconds the group's last durable checkpoint took to write."
    )
    d_saves = counter(
        "ftlaunch_group_durable_saves", "Durable checkpoints the group's current process wrote."
    )
    d_skip = counter(
        "ftlaunch_group_durable_skipped",
        "Durable checkpoints skipped: the previous one was still being written.",
    )
    d_fail = counter("ftlaunch_group_durable_failed", "Durable checkpoints that failed (a full disk, say).")
    d_resumed = gauge(
        "ftlaunch_group_resumed_from", "Step the group resumed from a durable checkpoint (0: none)."
    )
    for p in status.progress:
        key = [p.replica_id]
        d_step.add_metric(key, p.durable_step)
        d_time.add_metric(key, p.durable_time)
        d_secs.add_metric(key, p.durable_seconds)
        d_saves.add_metric(key, p.durable_saves)
        d_skip.add_metric(key, p.durable_skipped)
        d_fail.add_metric(key, p.durable_failed)
        d_resumed.add_metric(key, p.resumed_from)
        step.add_metric(key, p.step)
        committed.add_metric(key, p.committed)
        failures.add_metric(key, p.failures)
        restarts.add_metric(key, p.restarts)
        heals.add_metric(key, p.heals)
        heal_s.add_metric(key, p.heal_seconds)
        rate.add_metric(key, p.step_rate)
        step_s.add_metric(key, p.step_seconds)
        quorum_s.add_metric(key, p.quorum_seconds)
        commit_s.add_metric(key, p.commit_seconds)
        compute_s.add_metric(key, p.compute_seconds)
    yield from (
        step,
        committed,
        failures,
        restarts,
        heals,
        heal_s,
        rate,
        step_s,
        quorum_s,
        commit_s,
        compute_s,
    )
    slowdown = gauge(
        "ftlaunch_group_slowdown",
        "The group's own work per step over the other groups' (medians of the last committed steps).",
    )
    straggler = gauge("ftlaunch_group_straggler", "1 while the lighthouse judges the group a straggler.")
    for v in status.stragglers.groups if status.stragglers is not None else ():
        slowdown.add_metric([v.replica_id], v.slowdown)
        straggler.add_metric([v.replica_id], 1 if v.straggler else 0)
    yield from (slowdown, straggler)
    failing = gauge(
        "ftlaunch_group_health_failing",
        "1 while the group's health check fails (its agent keeps it out and runs the check again).",
    )
    checks_failed = counter(
        "ftlaunch_group_health_check_failures", "Runs of the group's health check that failed."
    )
    for h in status.health:
        failing.add_metric([h.replica_id], 0 if h.ok else 1)
        checks_failed.add_metric([h.replica_id], h.failures)
    yield from (failing, checks_failed)
    yield from (d_step, d_time, d_secs, d_saves, d_skip, d_fail, d_resumed)


class MetricsExporter:
    """Renders ``/metrics`` from a status source (``render`` returns the body and its content type)."""

    def __init__(self, snapshot: Callable[[], LighthouseStatus]) -> None:
        self._collector = StatusCollector(snapshot)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self._collector), CONTENT_TYPE_LATEST  # type: ignore[arg-type]

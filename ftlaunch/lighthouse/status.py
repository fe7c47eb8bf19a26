"""The lighthouse's status as typed, frozen values: what ``GET /status`` serves, the dashboard renders,
and the launcher reads.

One document, three readers: `LighthouseServer.snapshot` builds a `LighthouseStatus` from its
membership, ``GET /status`` sends `LighthouseStatus.to_json`, `LighthouseClient.snapshot` parses it
back with `LighthouseStatus.from_json`, and the dashboard and the launcher (``launcher/
lighthouse_host.py``) read attributes instead of dict keys. A new field is added here once (with a
default, so an older lighthouse's document still parses; unknown keys are ignored, so an older
reader still reads a newer lighthouse).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftlaunch.lighthouse.health import HealthStatus
from ftlaunch.lighthouse.progress import GroupProgress, Rewind
from ftlaunch.lighthouse.protocol import API_VERSION
from ftlaunch.lighthouse.quorum import Health, Quorum


def _get(d: Mapping[str, Any], name: str, types: type | tuple[type, ...], default: Any = ...) -> Any:
    """``d[name]`` checked against ``types`` (a bool is not a number); ``default`` when absent."""
    if name not in d:
        if default is ...:
            raise ValueError(f"status field {name!r} is missing")
        return default
    value = d[name]
    wanted = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
        raise ValueError(f"status field {name!r} must be {wanted[0].__name__}, got {type(value).__name__}")
    return value


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


#: How the lighthouse starts the reason of a member it declared lost on evidence (lighthouse/hung.py):
#: such a member keeps its hot-spare slot until the heartbeat timeout (a short stop must not cost a
#: takeover).
HUNG_REASON = "hung: "


@dataclass(frozen=True)
class StatusOptions:
    """How the lighthouse was started (``admin``: whether the admin endpoints take a token)."""

    min_replicas: int = 1
    join_timeout: float = 60.0
    heartbeat_timeout: float = 5.0
    quorum_tick: float = 0.1
    admin: bool = False
    #: Groups the first quorum waits for (up to the join timeout); 0: not announced.
    expected_replicas: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "join_timeout": self.join_timeout,
            "heartbeat_timeout": self.heartbeat_timeout,
            "quorum_tick": self.quorum_tick,
            "admin": self.admin,
        }
        if self.expected_replicas:  # only when announced: the document stays as it was otherwise
            out["expected_replicas"] = self.expected_replicas
        return out

    @classmethod
    def from_json(cls, d: Any) -> StatusOptions:
        d = _object(d, "options")
        return cls(
            min_replicas=_get(d, "min_replicas", int),
            join_timeout=float(_get(d, "join_timeout", (float, int))),
            heartbeat_timeout=float(_get(d, "heartbeat_timeout", (float, int))),
            quorum_tick=float(_get(d, "quorum_tick", (float, int))),
            admin=_get(d, "admin", bool),
            expected_replicas=_get(d, "expected_replicas", int, 0),
        )


@dataclass(frozen=True)
class GroupStatus:
    """One replica group as the lighthouse sees it (see docs/lighthouse.md, *Liveness*)."""

    replica_id: str
    health: Health = Health.LIVE
    #: The step of its last quorum request.
    step: int = 0
    address: str = ""
    #: Seconds since its last heartbeat or quorum request.
    last_seen_age: float = 0.0
    heartbeat_timeout: float = 5.0
    #: Open connections bound to it (``X-Ftlaunch-Replica``).
    connections: int = 0
    #: It has a quorum request waiting.
    requesting: bool = False
    in_quorum: bool = False
    heartbeats: int = 0
    #: Why it is not live (empty while it is).
    reason: str = ""
    #: Unix time it was first heard of.
    first_seen: float = 0.0

    @property
    def live(self) -> bool:
        return self.health is Health.LIVE

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "health": self.health.value,
            "step": self.step,
            "address": self.address,
            "last_seen_age": self.last_seen_age,
            "heartbeat_timeout": self.heartbeat_timeout,
            "connections": self.connections,
            "requesting": self.requesting,
            "in_quorum": self.in_quorum,
            "heartbeats": self.heartbeats,
            "reason": self.reason,
            "first_seen": self.first_seen,
        }

    @classmethod
    def from_json(cls, d: Any) -> GroupStatus:
        d = _object(d, "group")
        try:
            health = Health(_get(d, "health", str))
        except ValueError:
            raise ValueError(f"unknown group health {d['health']!r}") from None
        return cls(
            replica_id=_get(d, "replica_id", str),
            health=health,
            step=_get(d, "step", int),
            address=_get(d, "address", str),
            last_seen_age=float(_get(d, "last_seen_age", (float, int))),
            heartbeat_timeout=float(_get(d, "heartbeat_timeout", (float, int))),
            connections=_get(d, "connections", int),
            requesting=_get(d, "requesting", bool),
            in_quorum=_get(d, "in_quorum", bool),
            heartbeats=_get(d, "heartbeats", int),
            reason=_get(d, "reason", str),
            first_seen=float(_get(d, "first_seen", (float, int))),
        )


@dataclass(frozen=True)
class HistoryEvent:
    """One entry of the history: ``joined``, ``quorum``, ``silent``, ``disconnected``, ``failed``,
    ``revived``, ``left``, ``evicted``, ``failure_report`` or ``refused_finished``; with hot spares also
    ``claimed`` and
    ``replaced``; ``straggler``, ``straggler_cleared`` and ``straggler_replaced`` (docs/lighthouse.md)."""

    time: float
    event: str
    replica_id: str | None = None
    detail: str = ""
    #: Only on ``quorum`` events: the new quorum's id and members.
    quorum_id: int | None = None
    participants: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "time": self.time,
            "event": self.event,
            "replica_id": self.replica_id,
            "detail": self.detail,
        }
        if self.quorum_id is not None:
            out["quorum_id"] = self.quorum_id
        if self.participants is not None:
            out["participants"] = list(self.participants)
        return out

    @classmethod
    def from_json(cls, d: Any) -> HistoryEvent:
        d = _object(d, "history event")
        participants = _get(d, "participants", list, None)
        if participants is not None and not all(isinstance(p, str) for p in participants):
            raise ValueError("status field 'participants' must list replica ids")
        return cls(
            time=float(_get(d, "time", (float, int))),
            event=_get(d, "event", str),
            replica_id=_get(d, "replica_id", (str, type(None)), None),
            detail=_get(d, "detail", str, ""),
            quorum_id=_get(d, "quorum_id", int, None),
            participants=tuple(participants) if participants is not None else None,
        )


# ---- hot spares (``--spares K``): the slot table (lighthouse/spares.py) ----------------------------


@dataclass(frozen=True)
class SlotStatus:
    """One replica-group slot: who holds it under which lighthouse name, and in what state
    (``none``: never held, ``arriving``: given, not heard from yet, ``live``, ``down``, ``left``)."""

    slot: int
    replica_id: str | None = None
    #: The claimant (a group's claim name, e.g. ``rg2.0``: group 2's first incarnation).
    holder: str | None = None
    state: str = "none"
    #: Seconds since it was given to its holder.
    held_for: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "replica_id": self.replica_id, "holder": self.holder, "state": self.state,
                "held_for": self.held_for}  # fmt: skip

    @classmethod
    def from_json(cls, d: Any) -> SlotStatus:
        d = _object(d, "slot")
        held_for = _get(d, "held_for", (float, int, type(None)), None)
        return cls(
            slot=_get(d, "slot", int),
            replica_id=_get(d, "replica_id", (str, type(None)), None),
            holder=_get(d, "holder", (str, type(None)), None),
            state=_get(d, "state", str, "none"),
            held_for=float(held_for) if held_for is not None else None,
        )


@dataclass(frozen=True)
class SpareStatus:
    """A group waiting as a spare (a claim parked, or about to be repeated)."""

    claimant: str
    #: The slot it was started for (None: started as a spare).
    preferred: int | None = None
    waiting_for: float = 0.0
    #: Claims parked (one per rank of the group; 0 between two polls).
    polls: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"claimant": self.claimant, "preferred": self.preferred, "waiting_for": self.waiting_for,
                "polls": self.polls}  # fmt: skip

    @classmethod
    def from_json(cls, d: Any) -> SpareStatus:
        d = _object(d, "spare")
        return cls(
            claimant=_get(d, "claimant", str),
            preferred=_get(d, "preferred", (int, type(None)), None),
            waiting_for=float(_get(d, "waiting_for", (float, int), 0.0)),
            polls=_get(d, "polls", int, 0),
        )


@dataclass(frozen=True)
class SparesStatus:
    """The slot table of a job with spares (absent from the status of a job without)."""

    slots: tuple[SlotStatus, ...] = ()
    #: The spares waiting, longest first.
    waiting: tuple[SpareStatus, ...] = ()
    #: Slots handed to a spare after their holder failed.
    promotions: int = 0
    #: Lighthouse names refused because a newer holder has their slot.
    fenced: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "slots": [s.to_json() for s in self.slots],
            "waiting": [w.to_json() for w in self.waiting],
            "promotions": self.promotions,
            "fenced": list(self.fenced),
        }

    @classmethod
    def from_json(cls, d: Any) -> SparesStatus:
        d = _object(d, "spares")
        fenced = _get(d, "fenced", list, [])
        if not all(isinstance(f, str) for f in fenced):
            raise ValueError("status field 'fenced' must list replica ids")
        return cls(
            slots=tuple(SlotStatus.from_json(s) for s in _get(d, "slots", list, [])),
            waiting=tuple(SpareStatus.from_json(w) for w in _get(d, "waiting", list, [])),
            promotions=_get(d, "promotions", int, 0),
            fenced=tuple(fenced),
        )


# ---- stragglers (lighthouse/stragglers.py) ---------------------------------------------------------


@dataclass(frozen=True)
class StragglerStatus:
    """One member's straggler verdict: its compute per step (the median of its window), the other
    members' median, the ratio (``slowdown``), and whether it is a straggler (since when)."""

    replica_id: str
    slowdown: float = 1.0
    compute_seconds: float = 0.0
    reference_seconds: float = 0.0
    #: Committed steps its current process reported.
    steps: int = 0
    straggler: bool = False
    #: Unix time it became a straggler (None: it is not one).
    since: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "slowdown": self.slowdown,
            "compute_seconds": self.compute_seconds,
            "reference_seconds": self.reference_seconds,
            "steps": self.steps,
            "straggler": self.straggler,
            "since": self.since,
        }

    @classmethod
    def from_json(cls, d: Any) -> StragglerStatus:
        d = _object(d, "straggler")
        since = _get(d, "since", (float, int, type(None)), None)
        return cls(
            replica_id=_get(d, "replica_id", str),
            slowdown=float(_get(d, "slowdown", (float, int), 1.0)),
            compute_seconds=float(_get(d, "compute_seconds", (float, int), 0.0)),
            reference_seconds=float(_get(d, "reference_seconds", (float, int), 0.0)),
            steps=_get(d, "steps", int, 0),
            straggler=_get(d, "straggler", bool, False),
            since=float(since) if since is not None else None,
        )


@dataclass(frozen=True)
class ReplacedStatus:
    """A straggler the lighthouse replaced (policy ``replace``): by a hot spare (``how`` = ``spare``)
    or by restarting it (``restart``), at ``time``; its replacement first committed at ``arrived``."""

    replica_id: str
    slowdown: float
    how: str
    time: float
    arrived: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "slowdown": self.slowdown, "how": self.how, "time": self.time,
                "arrived": self.arrived}  # fmt: skip

    @classmethod
    def from_json(cls, d: Any) -> ReplacedStatus:
        d = _object(d, "replaced straggler")
        arrived = _get(d, "arrived", (float, int, type(None)), None)
        return cls(
            replica_id=_get(d, "replica_id", str),
            slowdown=float(_get(d, "slowdown", (float, int), 1.0)),
            how=_get(d, "how", str, ""),
            time=float(_get(d, "time", (float, int), 0.0)),
            arrived=float(arrived) if arrived is not None else None,
        )


@dataclass(frozen=True)
class StragglersStatus:
    """The straggler rule's state: the policy, its thresholds, each judged member's verdict, the
    replacement in flight and the last ones done."""

    policy: str = "report"
    #: Committed steps per window, and the slowdowns to become a straggler and to stop being one.
    window: int = 0
    enter: float = 0.0
    leave: float = 0.0
    #: The members of the quorum in use with a verdict, by replica id.
    groups: tuple[StragglerStatus, ...] = ()
    #: The replica id whose replacement has not committed yet (None: none in flight).
    replacing: str | None = None
    #: The last replacements, oldest first.
    replaced: tuple[ReplacedStatus, ...] = ()
    #: Replacements since the lighthouse started.
    replacements: int = 0

    @property
    def stragglers(self) -> tuple[StragglerStatus, ...]:
        return tuple(g for g in self.groups if g.straggler)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "window": self.window,
            "enter": self.enter,
            "leave": self.leave,
            "groups": [g.to_json() for g in self.groups],
            "replacing": self.replacing,
            "replaced": [r.to_json() for r in self.replaced],
            "replacements": self.replacements,
        }

    @classmethod
    def from_json(cls, d: Any) -> StragglersStatus:
        d = _object(d, "stragglers")
        return cls(
            policy=_get(d, "policy", str, "report"),
            window=_get(d, "window", int, 0),
            enter=float(_get(d, "enter", (float, int), 0.0)),
            leave=float(_get(d, "leave", (float, int), 0.0)),
            groups=tuple(StragglerStatus.from_json(g) for g in _get(d, "groups", list, [])),
            replacing=_get(d, "replacing", (str, type(None)), None),
            replaced=tuple(ReplacedStatus.from_json(r) for r in _get(d, "replaced", list, [])),
            replacements=_get(d, "replacements", int, 0),
        )


@dataclass(frozen=True)
class LighthouseStatus:
    """Everything the lighthouse knows, at one instant (``GET /status``)."""

    address: str = ""
    #: Unix time of the snapshot.
    time: float = 0.0
    options: StatusOptions = StatusOptions()
    #: The current (last formed) quorum.
    quorum: Quorum | None = None
    #: The id a quorum would get if the next one needs a new id.
    next_quorum_id: int = 0
    #: Every known group, sorted by replica id.
    groups: tuple[GroupStatus, ...] = ()
    #: Replica ids with a quorum request waiting, sorted.
    pending: tuple[str, ...] = ()
    #: Why the pending requests (if any) still wait.
    decision: str = ""
    #: Evicted groups not yet told (their next request gets 410).
    evicted: tuple[str, ...] = ()
    #: Newest first.
    history: tuple[HistoryEvent, ...] = ()
    #: The slot table, only for a job started with spares (see `SparesStatus`).
    spares: SparesStatus | None = None
    # -- training progress the group leaders report (lighthouse/progress.py)
    #: Every group that reported, those that left or died included, sorted by replica id.
    progress: tuple[GroupProgress, ...] = ()
    #: Quorums formed with a new id since the lighthouse started.
    quorum_changes: int = 0
    #: The job's committed steps per second (recent window).
    step_rate: float = 0.0
    #: Slow groups (lighthouse/stragglers.py); None from a lighthouse that does not judge them.
    stragglers: StragglersStatus | None = None
    #: Times the job went back to an earlier step (no group holding its state was left), oldest first.
    rewinds: tuple[Rewind, ...] = ()
    #: Each group's health check before it (re)joined (lighthouse/health.py), by replica id.
    health: tuple[HealthStatus, ...] = ()

    def group_progress(self, replica_id: str) -> GroupProgress | None:
        return next((p for p in self.progress if p.replica_id == replica_id), None)

    @property
    def quorum_id(self) -> int | None:
        """The current quorum's id, or None before the first quorum."""
        return self.quorum.quorum_id if self.quorum is not None else None

    @property
    def live_count(self) -> int:
        """How many groups are live (connected and heard from within the heartbeat timeout)."""
        return sum(1 for g in self.groups if g.live)

    def group(self, replica_id: str) -> GroupStatus | None:
        return next((g for g in self.groups if g.replica_id == replica_id), None)

    def to_json(self) -> dict[str, Any]:
        """The ``GET /status`` document (docs/lighthouse.md), ``version`` included."""
        return {
            "version": API_VERSION,
            "address": self.address,
            "time": self.time,
            "options": self.options.to_json(),
            "quorum": self.quorum.to_json() if self.quorum is not None else None,
            "next_quorum_id": self.next_quorum_id,
            "groups": [g.to_json() for g in self.groups],
            "pending": list(self.pending),
            "decision": self.decision,
            "evicted": list(self.evicted),
            "history": [h.to_json() for h in self.history],
            **({"spares": self.spares.to_json()} if self.spares is not None else {}),
            "progress": [p.to_json() for p in self.progress],
            "quorum_changes": self.quorum_changes,
            "step_rate": self.step_rate,
            **({"stragglers": self.stragglers.to_json()} if self.stragglers is not None else {}),
            "rewinds": [r.to_json() for r in self.rewinds],
            "health": [h.to_json() for h in self.health],
        }

    @classmethod
    def from_json(cls, d: Any) -> LighthouseStatus:
        """Parse a status document; raises ValueError when it is not one (wrong types, missing fields)."""
        d = _object(d, "lighthouse status")
        quorum = d.get("quorum")
        lists = {name: _get(d, name, list) for name in ("groups", "pending", "evicted", "history")}
        for name in ("pending", "evicted"):
            if not all(isinstance(rid, str) for rid in lists[name]):
                raise ValueError(f"status field {name!r} must list replica ids")
        return cls(
            address=_get(d, "address", str),
            time=float(_get(d, "time", (float, int))),
            options=StatusOptions.from_json(d.get("options")),
            quorum=Quorum.from_json(quorum) if quorum is not None else None,
            next_quorum_id=_get(d, "next_quorum_id", int),
            groups=tuple(GroupStatus.from_json(g) for g in lists["groups"]),
            pending=tuple(lists["pending"]),
            decision=_get(d, "decision", str),
            evicted=tuple(lists["evicted"]),
            history=tuple(HistoryEvent.from_json(h) for h in lists["history"]),
            spares=SparesStatus.from_json(d["spares"]) if d.get("spares") is not None else None,
            progress=tuple(GroupProgress.from_json(p) for p in _get(d, "progress", list, [])),
            quorum_changes=_get(d, "quorum_changes", int, 0),
            step_rate=float(_get(d, "step_rate", (float, int), 0.0)),
            stragglers=StragglersStatus.from_json(d["stragglers"])
            if d.get("stragglers") is not None
            else None,
            rewinds=tuple(Rewind.from_json(r) for r in _get(d, "rewinds", list, [])),
            health=tuple(HealthStatus.from_json(h) for h in _get(d, "health", list, [])),
        )

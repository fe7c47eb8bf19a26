"""The quorum decision, as a pure function of (state, now, options).

Everything that decides *whether* a quorum forms and *which id* it gets lives here, with no I/O,
no threads and no clock reads: the server snapshots its bookkeeping into a `LighthouseState`, passes
its own monotonic clock reading as ``now`` and applies the returned `QuorumDecision`. That keeps the
rules unit- and property-testable without sockets or sleeps.

Rules (in the order `decide_quorum` applies them):

1. A group is *live* when its last request (heartbeat or quorum request) is at most
   ``heartbeat_timeout`` old and it is not marked disconnected or failed.
2. Candidates are the live groups with a pending quorum request. If any candidate sets
   ``shrink_only``, only members of the previous quorum stay candidates.
3. Never fewer than ``min_replicas`` candidates.
4. Split-brain guard: the candidates must be MORE than half of the live groups. Two quorums formed
   from the same live set therefore always share a member.
5. The first quorum waits for the groups the launcher announced (``expected_replicas``) until
   ``join_timeout`` after the first request: otherwise the first group to start would train alone
   and every other group would heal from it. Later quorums ignore the announcement.
6. The state is lost to the live groups (every candidate is behind the step of the previous
   quorum: no group holding the job's state asked, e.g. every group died and their agents restart
   them from a durable checkpoint or from scratch) and members of the previous quorum the lighthouse
   still knows have not asked (down, or restarting): wait for them until ``join_timeout`` after the
   first request of the round. Otherwise the first group back would train alone from the rewound
   state while the others are still starting, and the job would diverge from the run it repeats (a
   group that asks at the previous quorum's step or later holds the state: it never waits here).
7. Form at once when every member of the previous quorum is a candidate ("fast quorum"), or when
   every live group has asked. Otherwise wait for stragglers until ``join_timeout`` after the first
   request of the round, then form with those present.
8. The quorum id changes when the membership changes, when any participant reports
   ``commit_failures > 0``, or when a member of the previous quorum lost liveness since it formed
   (it may be a new incarnation with the same name); otherwise the previous id is kept, so Managers
   do not reconfigure.

Quorum ids (`encode_quorum_id`) are ``epoch * 2**12 + counter`` where ``epoch`` is milliseconds since
2020-01-01 at lighthouse start: a restarted lighthouse starts from a later epoch, so ids strictly
increase across restarts, and they stay below 2**53 (exact in JSON doubles) until 2089.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Collection, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ftlaunch.env import Count, Duration

#: Bits of a quorum id that count quorum changes within one epoch (one millisecond).
ID_COUNTER_BITS = 12
#: Start of the id epoch: 2020-01-01T00:00:00Z in Unix milliseconds.
ID_EPOCH_BASE_MS = 1_577_836_800_000
_ID_COUNTER_MAX = (1 << ID_COUNTER_BITS) - 1

_MEMBER_FIELDS: dict[str, tuple[type, ...]] = {
    "replica_id": (str,),
    "address": (str,),
    "store_address": (str,),
    "step": (int,),
    "world_size": (int,),
    "shrink_only": (bool,),
    "commit_failures": (int,),
    "data": (dict,),
}


_MEMBER_KEYS = frozenset(_MEMBER_FIELDS)


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass; a JSON `true` where a number belongs is a client bug, not a 1.
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"field {name!r} must be {types[0].__name__}, got bool")
    if not isinstance(value, types):
        raise ValueError(f"field {name!r} must be {types[0].__name__}, got {type(value).__name__}")


@dataclass(frozen=True)
class QuorumMember:
    """One replica group's quorum request (and, once formed, its entry in the quorum)."""

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 1
    shrink_only: bool = False
    commit_failures: int = 0
    data: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The usual member (one per quorum request) passes on this one expression; else each field is
        # checked (and the first wrong one named).
        if not (
            type(self.replica_id) is str and type(self.address) is str and type(self.store_address) is str
            and type(self.step) is int and type(self.world_size) is int and type(self.shrink_only) is bool
            and type(self.commit_failures) is int and type(self.data) is dict
        ):  # fmt: skip
            for name, types in _MEMBER_FIELDS.items():
                _check_type(name, getattr(self, name), types)
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        if self.step < 0 or self.commit_failures < 0:
            raise ValueError("step and commit_failures must be >= 0")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    def to_json(self) -> dict:
        return {
            "replica_id": self.replica_id,
            "address": self.address,
            "store_address": self.store_address,
            "step": self.step,
            "world_size": self.world_size,
            "shrink_only": self.shrink_only,
            "commit_failures": self.commit_failures,
            "data": self.data,
        }

    @classmethod
    def from_json(cls, d: Any) -> QuorumMember:
        """Strict parse: unknown keys, a missing replica_id or wrong types raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"quorum member must be a JSON object, got {type(d).__name__}")
        unknown = () if d.keys() <= _MEMBER_KEYS else sorted(set(d) - _MEMBER_KEYS)
        if unknown:
            raise ValueError(f"unknown quorum member field(s): {', '.join(map(repr, unknown))}")
        if "replica_id" not in d:
            raise ValueError("quorum member needs 'replica_id'")
        # What ``cls(**d)`` does, without the frozen __init__'s one object.__setattr__ per field (a
        # member per quorum request): the defaults, then the given fields, then the same checks.
        member = cls.__new__(cls)
        attrs = member.__dict__
        attrs.update(_MEMBER_DEFAULTS)
        attrs["data"] = {}
        attrs.update(d)
        member.__post_init__()
        return member


#: The defaults of `QuorumMember`'s fields, read from the class (``data``'s factory is not one: a new
#: dict each time), for `QuorumMember.from_json`.
_MEMBER_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(QuorumMember) if f.default is not MISSING
}


@dataclass(frozen=True)
class Quorum:
    """A formed quorum: its id and participants (sorted by replica_id)."""

    quorum_id: int
    participants: tuple[QuorumMember, ...]
    created: float

    def __post_init__(self) -> None:
        _check_type("quorum_id", self.quorum_id, (int,))
        _check_type("created", self.created, (float, int))
        ids = [p.replica_id for p in self.participants]
        if ids != sorted(ids) or len(set(ids)) != len(ids):
            raise ValueError("quorum participants must be unique and sorted by replica_id")

    @functools.cached_property
    def replica_ids(self) -> tuple[str, ...]:
        """The participants' ids, in order (computed once: with 1024 groups the membership reads it
        several times a round)."""
        return tuple(p.replica_id for p in self.participants)

    def member(self, replica_id: str) -> QuorumMember | None:
        for p in self.participants:
            if p.replica_id == replica_id:
                return p
        return None

    def to_json(self) -> dict:
        return {
            "quorum_id": self.quorum_id,
            "participants": [p.to_json() for p in self.participants],
            "created": self.created,
        }

    @classmethod
    def from_json(cls, d: Any) -> Quorum:
        if not isinstance(d, dict):
            raise ValueError(f"quorum must be a JSON object, got {type(d).__name__}")
        expected = {"quorum_id", "participants", "created"}
        if set(d) != expected:
            raise ValueError(f"quorum must have exactly the fields {sorted(expected)}, got {sorted(d)}")
        if not isinstance(d["participants"], list):
            raise ValueError("field 'participants' must be a list")
        members = tuple(QuorumMember.from_json(p) for p in d["participants"])
        return cls(quorum_id=d["quorum_id"], participants=members, created=d["created"])


class Connection(str, enum.Enum):
    """What the server knows about a group's processes, apart from heartbeat age."""

    CONNECTED = "connected"
    #: Its last connection closed without a `leave`: the process died.
    DISCONNECTED = "disconnected"
    #: The supervisor or an admin reported it failed.
    FAILED = "failed"


class Health(str, enum.Enum):
    LIVE = "live"
    #: Connected (or never tracked) but no heartbeat within heartbeat_timeout: hung or gone.
    SILENT = "silent"
    DISCONNECTED = "disconnected"
    FAILED = "failed"


@dataclass(frozen=True)
class GroupState:
    """Liveness input of one known replica group."""

    replica_id: str
    last_seen: float  # monotonic seconds of its last heartbeat or quorum request
    connection: Connection = Connection.CONNECTED


#: Bounds of the options (`ftlaunch.env.Duration`; the command lines and ``--rdzv-conf`` use the same).
#: A heartbeat timeout must leave a group's heartbeats room for a beat or two, or every healthy
#: group is "silent" between two of them and no quorum ever forms. Below `QUICK_HEARTBEAT_TIMEOUT`
#: the lighthouse warns: groups beating at the Manager's default pace (every 0.1 s) have fewer than
#: 5 beats per timeout, so a beat delayed on a loaded host can call a healthy group silent. The floor
#: is the quickest pace a Manager may beat at with room for one beat (``heartbeat_interval``).
HEARTBEAT_TIMEOUT = Duration(0.05)
#: Heartbeat timeouts under this are accepted with a warning (see `HEARTBEAT_TIMEOUT`): 5 beats.
QUICK_HEARTBEAT_TIMEOUT = 0.5
#: 0 forms the first quorum with whoever asks first.
JOIN_TIMEOUT = Duration(0.0)
#: Replica groups in a quorum (``min_replicas``, ``expected_replicas``: 0 = none announced).
REPLICAS = Count(1)


@dataclass(frozen=True)
class QuorumOptions:
    min_replicas: int = 1
    join_timeout: float = 60.0
    heartbeat_timeout: float = 5.0
    #: Groups the launcher announced: the first quorum waits for them (rule 5). 0: none announced.
    expected_replicas: int = 0

    def __post_init__(self) -> None:
        """Every option in its bounds; a ValueError names the option (TypeError: not a number)."""
        checks: tuple[tuple[str, Count | Duration], ...] = (
            ("min_replicas", REPLICAS),
            ("expected_replicas", Count(0)),
            ("join_timeout", JOIN_TIMEOUT),
            ("heartbeat_timeout", HEARTBEAT_TIMEOUT),
        )
        for name, bounds in checks:
            value = getattr(self, name)
            kinds = (int,) if isinstance(bounds, Count) else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(
                    f"{name} must be {'an int' if kinds == (int,) else 'a number'}, got {value!r}"
                )
            try:
                bounds.check(value)
            except ValueError as e:
                raise ValueError(f"{name}={value!r} {e}") from None


@dataclass(frozen=True)
class LighthouseState:
    """Everything the decision depends on. Mappings are read, never modified."""

    groups: Mapping[str, GroupState]
    requests: Mapping[str, QuorumMember]  # pending quorum requests by replica_id
    round_start: float | None = None  # monotonic time of the first pending request of this round
    prev_quorum: Quorum | None = None
    #: A member of prev_quorum lost liveness since it formed: the next quorum needs a new id.
    prev_quorum_broken: bool = False
    #: Id to use if the next quorum needs a new one (from `QuorumIdAllocator.peek`).
    next_quorum_id: int = 0
    #: The members of prev_quorum without a pending request, when the caller keeps them (the
    #: membership does, so that `may_form` stays O(1) per request); None: `may_form` looks.
    prev_missing: Collection[str] | None = None


@dataclass(frozen=True)
class QuorumDecision:
    """Result of `decide_quorum`: form (participants set) or wait (participants None)."""

    participants: tuple[QuorumMember, ...] | None
    quorum_id: int | None
    new_id: bool
    reason: str
    #: Monotonic time at which the passage of time alone may change a "wait" decision.
    wake_at: float | None = None

    @property
    def formed(self) -> bool:
        return self.participants is not None

    def to_quorum(self, created: float) -> Quorum:
        if self.participants is None or self.quorum_id is None:
            raise ValueError("decision did not form a quorum")
        return Quorum(quorum_id=self.quorum_id, participants=self.participants, created=created)


def group_health(group: GroupState, now: float, options: QuorumOptions) -> Health:
    if group.connection is Connection.FAILED:
        return Health.FAILED
    if group.connection is Connection.DISCONNECTED:
        return Health.DISCONNECTED
    if now - group.last_seen > options.heartbeat_timeout:
        return Health.SILENT
    return Health.LIVE


_BY_ID = operator.attrgetter("replica_id")


def _wait(reason: str, wake_at: float | None) -> QuorumDecision:
    return QuorumDecision(participants=None, quorum_id=None, new_id=False, reason=reason, wake_at=wake_at)


def may_form(state: LighthouseState, now: float, options: QuorumOptions) -> bool:
    """Cheap necessary condition for `decide_quorum` to form a quorum (False => it would wait).

    Usually O(1): the server calls it on every request arrival and runs the full O(groups)
    decision only when it returns True, which with N groups asking in turn is about once per round.
    """
    requests = state.requests
    if len(requests) < options.min_replicas:
        return False
    prev, missing = state.prev_quorum, state.prev_missing
    if prev is not None and (
        not missing if missing is not None else all(p.replica_id in requests for p in prev.participants)
    ):
        return True  # a fast quorum is possible
    if state.round_start is None or now - state.round_start >= options.join_timeout:
        return True  # the join timeout has passed
    # Otherwise only "every live group asked" can form: look for a live group that has not asked,
    # first among the previous quorum's (usually the first one looked at is).
    cutoff = now - options.heartbeat_timeout
    connected = Connection.CONNECTED
    groups = state.groups
    for rid in missing or ():
        g = groups.get(rid)
        if g is not None and rid not in requests and g.connection is connected and g.last_seen >= cutoff:
            return False
    for rid, g in groups.items():
        if rid not in requests and g.connection is connected and g.last_seen >= cutoff:
            return False
    return True


def _coming_back(state: LighthouseState, prev: Quorum, candidates: set[str]) -> list[str]:
    """Rule 6: the members of ``prev`` still known (not left, replaced or forgotten) that did not
    ask, when every candidate is behind ``prev``'s step (none holds the job's state); else none.

    Why the members of the previous quorum: they are the groups the job was training with, and a
    group the lighthouse still knows is one its agent may be restarting (a group that left, or
    whose slot went to a hot spare, is no longer known). Why only when every candidate is behind:
    a candidate at the previous quorum's step or later holds the state, so the job goes on from it
    at once, as in any single group's recovery."""
    if not candidates:
        return []
    top = max(p.step for p in prev.participants)
    requests = state.requests
    if any(requests[rid].step >= top for rid in candidates):
        return []
    groups = state.groups
    return [rid for rid in prev.replica_ids if rid not in candidates and rid in groups]


def decide_quorum(state: LighthouseState, now: float, options: QuorumOptions) -> QuorumDecision:
    """Decide whether a quorum forms now, with whom and under which id (see module docstring)."""
    hb = options.heartbeat_timeout
    cutoff = now - hb
    connected = Connection.CONNECTED
    live: set[str] = set()
    oldest: float | None = None
    for rid, g in state.groups.items():
        if g.connection is connected and g.last_seen >= cutoff:
            live.add(rid)
            if oldest is None or g.last_seen < oldest:
                oldest = g.last_seen
    next_expiry = None if oldest is None else oldest + hb
    candidates = [rid for rid in state.requests if rid in live]
    prev = state.prev_quorum
    prev_ids = set(prev.replica_ids) if prev is not None else set()
    shrink = any(state.requests[rid].shrink_only for rid in candidates)
    if shrink and prev is not None:
        candidates = [rid for rid in candidates if rid in prev_ids]
    n, n_live = len(candidates), len(live)
    counts = f"{n} candidate(s), {n_live} live, min_replicas={options.min_replicas}"

    # Rules whose outcome only changes when a request arrives or a live group expires.
    if n < options.min_replicas:
        return _wait(f"waiting: fewer than min_replicas ({counts})", next_expiry)
    if 2 * n <= n_live:
        return _wait(
            f"waiting: need more than half of the live groups to avoid split brain ({counts})", next_expiry
        )

    if prev is None and n < options.expected_replicas:
        start = state.round_start if state.round_start is not None else now
        deadline = start + options.join_timeout
        if now < deadline:
            wake = deadline if next_expiry is None else min(deadline, next_expiry)
            return _wait(
                f"first quorum: waiting for the {options.expected_replicas} announced groups until the "
                f"join timeout ({counts})",
                wake,
            )
    cand_set = set(candidates)
    if prev is not None:
        coming = _coming_back(state, prev, cand_set)
        if coming:
            start = state.round_start if state.round_start is not None else now
            deadline = start + options.join_timeout
            if now < deadline:
                wake = deadline if next_expiry is None else min(deadline, next_expiry)
                return _wait(
                    f"no live group holds the state of step {max(p.step for p in prev.participants)}: "
                    f"waiting for {len(coming)} group(s) of quorum {prev.quorum_id} to come back "
                    f"({', '.join(sorted(coming))}) until the join timeout ({counts})",
                    wake,
                )
    if prev is not None and prev_ids and prev_ids <= cand_set:
        reason = f"fast quorum: every member of quorum {prev.quorum_id} asked again ({counts})"
    elif live <= set(state.requests):
        reason = f"every live group asked ({counts})"
    else:
        start = state.round_start if state.round_start is not None else now
        deadline = start + options.join_timeout
        if now < deadline:
            wake = deadline if next_expiry is None else min(deadline, next_expiry)
            return _wait(f"waiting for {n_live - n} straggler(s) until the join timeout ({counts})", wake)
        reason = f"join timeout passed, forming with those present ({counts})"

    requests = state.requests
    members = tuple(sorted([requests[rid] for rid in candidates], key=_BY_ID))
    if prev is None:
        new_id, why = True, "first quorum"
    elif set(candidates) != prev_ids:
        new_id, why = True, "membership changed"
    elif any(m.commit_failures > 0 for m in members):
        new_id, why = True, "a member reported commit failures"
    elif state.prev_quorum_broken:
        new_id, why = True, "a member lost liveness since the previous quorum"
    else:
        new_id, why = False, "same members"
    quorum_id = state.next_quorum_id if new_id or prev is None else prev.quorum_id
    return QuorumDecision(
        participants=members, quorum_id=quorum_id, new_id=new_id, reason=f"{reason}; {why}", wake_at=None
    )


def encode_quorum_id(epoch: int, counter: int) -> int:
    """Pack (epoch in ms since ID_EPOCH_BASE_MS, counter) into one increasing integer."""
    if epoch < 0 or not 0 <= counter <= _ID_COUNTER_MAX:
        raise ValueError(f"bad quorum id parts: epoch={epoch}, counter={counter}")
    return (epoch << ID_COUNTER_BITS) | counter


def decode_quorum_id(quorum_id: int) -> tuple[int, int]:
    return quorum_id >> ID_COUNTER_BITS, quorum_id & _ID_COUNTER_MAX


class QuorumIdAllocator:
    """Hands out strictly increasing quorum ids: epoch (start time in ms) + counter.

    ``wall_ms`` is the caller's wall-clock reading in Unix milliseconds (the allocator reads no
    clock). ``floor`` is an id known to be used already (e.g. persisted): every id handed out is
    larger. When the counter of an epoch is exhausted the epoch advances by one millisecond; that
    outruns the wall clock only beyond ~4 million quorum changes per second, so a later restart
    still starts above every id handed out here.
    """

    def __init__(self, wall_ms: int, floor: int = 0) -> None:
        epoch = max(0, int(wall_ms) - ID_EPOCH_BASE_MS)
        floor_epoch, _ = decode_quorum_id(max(0, floor))
        self._epoch = max(epoch, floor_epoch + 1) if floor > 0 else epoch
        self._counter = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def peek(self) -> int:
        """The id `take` will return next."""
        return encode_quorum_id(self._epoch, self._counter)

    def ensure_above(self, quorum_id: int) -> None:
        """Hand out only ids larger than ``quorum_id`` from now on: an id that groups report from a
        previous lighthouse, whose clock may have been ahead of this one's (another host)."""
        if quorum_id >= self.peek():
            epoch, _ = decode_quorum_id(quorum_id)
            self._epoch, self._counter = epoch + 1, 0

    def take(self) -> int:
        quorum_id = self.peek()
        if self._counter == _ID_COUNTER_MAX:
            self._epoch += 1
            self._counter = 0
        else:
            self._counter += 1
        return quorum_id

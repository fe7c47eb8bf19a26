"""The replica groups one lighthouse knows, and the one place their records change.

`Roster` keeps two records per replica id: what the quorum decision reads (`quorum.GroupState`:
when the group was last heard and whether its connection is up) and what only the lighthouse's
own rules and its status read (`GroupInfo`). The membership (`membership.Membership`) asks its
rules what should happen and tells the roster through the methods below; nothing else writes a
group's record. Readers get the records as mappings (`groups`, `infos`) and must not change them.

The rules that only read the roster sit beside it, in `quorum.py`'s shape (pure functions of the
records and the caller's clock reading): which ids may be forgotten (`forgettable`), which groups
fell silent since the last look (`newly_silent`), and what a group is as the holder of a hot-spare
slot (`slot_holder`).

Not thread-safe: it runs under the membership's lock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from ftlaunch.lighthouse.protocol import ANONYMOUS
from ftlaunch.lighthouse.quorum import Connection, GroupState, Health, Quorum, QuorumOptions, group_health
from ftlaunch.lighthouse.slots import Holder
from ftlaunch.lighthouse.status import HUNG_REASON

#: The holder of an id a restarted lighthouse only knows from a resume report (a stand-in): whichever
#: process of the group comes back first takes it (`GroupInfo.incarnation`).
ADOPTED = "<adopted>"
#: How fast a group's usual heartbeat gap forgets a long one (per heartbeat): a decaying maximum.
GAP_DECAY = 0.9


@dataclass(slots=True)
class GroupInfo:
    """Per-group facts the quorum decision does not need (changed only by `Roster`)."""

    first_seen: float  # wall clock
    step: int = 0
    address: str = ""
    reason: str = ""  # why it is disconnected / failed / silent
    heartbeats: int = 0
    #: Its falling silent was noted (once per incident, until it is back).
    silent_noted: bool = False
    #: Its going down was counted in the progress book (once per incident, until it is back).
    down_counted: bool = False
    #: Which process holds the id (a quorum request's or heartbeat's incarnation; `ADOPTED`).
    incarnation: str = ANONYMOUS
    #: It was a participant of some quorum (ids that never were are forgotten once gone).
    in_a_quorum: bool = False
    #: Its usual gap between two heartbeats (a decaying maximum): the hung rule's silence limit
    #: scales with it (lighthouse/hung.py).
    beat_gap: float = 0.0
    #: A kill the admin asked for, told in the answer to its next heartbeat (None: none).
    kill: str | None = None


class Roster:
    """The groups' records (see the module docstring)."""

    def __init__(self, options: QuorumOptions) -> None:
        self._heartbeat_timeout = options.heartbeat_timeout
        self._groups: dict[str, GroupState] = {}
        self._info: dict[str, GroupInfo] = {}
        #: Every group's liveness record, by replica id: the mapping itself (the decision reads it),
        #: read-only to everybody but the roster.
        self.groups: Mapping[str, GroupState] = self._groups
        #: Every group's facts, by replica id (the same keys as `groups`), read-only to everybody but
        #: the roster.
        self.infos: Mapping[str, GroupInfo] = self._info

    # ---- a group is heard

    def join(self, replica_id: str, now: float, first_seen: float, incarnation: str, *, beat: bool) -> None:
        """A new id, heard now from ``incarnation`` (``beat``: in a heartbeat, counted)."""
        self._info[replica_id] = GroupInfo(
            first_seen=first_seen, incarnation=incarnation, heartbeats=int(beat)
        )
        self._groups[replica_id] = GroupState(replica_id, now, Connection.CONNECTED)

    def heard(self, replica_id: str, now: float, incarnation: str, *, back: bool, beat: bool) -> None:
        """A request of a known id was admitted: it is connected, heard now, from ``incarnation``
        (``beat``: in a heartbeat, counted). ``back``: it was not live before, so why it went down is
        forgotten."""
        info = self._info[replica_id]
        if back:
            info.reason, info.silent_noted, info.down_counted = "", False, False
            if incarnation != info.incarnation and ANONYMOUS not in (incarnation, info.incarnation):
                # Another process holds the id now (its agent restarted the group): what it holds
                # is unknown until it asks a quorum, not the step its predecessor had (a group
                # restarting beside it reads the steps to decide whether to heal from it).
                info.step = 0
        if beat:
            info.heartbeats += 1
        self._groups[replica_id] = GroupState(replica_id, now, Connection.CONNECTED)
        info.incarnation = incarnation

    def learn_gap(self, replica_id: str, now: float) -> None:
        """A heartbeat of ``replica_id`` arrives (before it counts as a sign of life): learn its usual
        gap. Not from a stand-in (its last_seen is the adoption of a resume report, not a beat), nor
        over a gap as long as the heartbeat timeout (it was down, not slow)."""
        g, info = self._groups.get(replica_id), self._info.get(replica_id)
        if (
            g is None
            or info is None
            or g.connection is not Connection.CONNECTED
            or info.incarnation == ADOPTED
        ):
            return
        gap = now - g.last_seen
        if gap < self._heartbeat_timeout:
            info.beat_gap = max(gap, info.beat_gap * GAP_DECAY)

    def note_request(self, replica_id: str, step: int, address: str) -> None:
        """The step and address of its newest quorum request."""
        info = self._info[replica_id]
        info.step, info.address = step, address

    def note_quorum(self, quorum: Quorum) -> None:
        """Its participants are in a quorum now, at the steps they asked with."""
        infos = self._info
        for member in quorum.participants:
            info = infos[member.replica_id]
            info.step, info.in_a_quorum = member.step, True

    def note_in_a_quorum(self, replica_id: str) -> None:
        """It was a participant of the job's quorum (an adopted one: told ``superseded`` on waking)."""
        self._info[replica_id].in_a_quorum = True

    # ---- a group goes down or away

    def mark_down(self, replica_id: str, connection: Connection, reason: str) -> bool:
        """It disconnected or failed, for ``reason``. False when the id is unknown or was already so."""
        g = self._groups.get(replica_id)
        if g is None or g.connection is connection:
            return False
        self._groups[replica_id] = GroupState(replica_id, g.last_seen, connection)
        self._info[replica_id].reason = reason
        return True

    def note_silent(self, replica_id: str, reason: str) -> None:
        """It fell silent (see `newly_silent`)."""
        info = self._info[replica_id]
        info.silent_noted, info.reason = True, reason

    def count_down(self, replica_id: str) -> bool:
        """Its going down counts once per incident (a group reported failed whose connection then
        closes went down once): True the first time. A kill not yet told is void: it was meant for
        the process that went down."""
        info = self._info[replica_id]
        info.kill = None
        if info.down_counted:
            return False
        info.down_counted = True
        return True

    def remove(self, replica_id: str) -> bool:
        """Forget ``replica_id`` (it left, was evicted or replaced). Returns whether it was known."""
        self._info.pop(replica_id, None)
        return self._groups.pop(replica_id, None) is not None

    def forget(self, replica_ids: Iterable[str]) -> None:
        for rid in replica_ids:
            del self._groups[rid], self._info[rid]

    def stand_in(self, replica_id: str, now: float, first_seen: float, reason: str) -> None:
        """A member of a quorum reported from a previous lighthouse, not heard from yet: live from
        ``now`` (for a heartbeat timeout), held by whichever of its processes comes first."""
        self._groups[replica_id] = GroupState(replica_id, now, Connection.CONNECTED)
        self._info[replica_id] = GroupInfo(first_seen=first_seen, reason=reason, incarnation=ADOPTED)

    # ---- kill requests (the dashboard's Kill button)

    def request_kill(self, replica_id: str, reason: str) -> bool:
        """Ask the group to kill its own process at its next heartbeat. False if the id is unknown."""
        info = self._info.get(replica_id)
        if info is None:
            return False
        info.kill = reason
        return True

    def take_kill(self, replica_id: str) -> str | None:
        """The kill asked of ``replica_id``, once (then it is told)."""
        info = self._info.get(replica_id)
        if info is None or info.kill is None:
            return None
        kill, info.kill = info.kill, None
        return kill


# ---------------------------------------------------------------------------------- rules


def newly_silent(
    groups: Mapping[str, GroupState], infos: Mapping[str, GroupInfo], now: float, heartbeat_timeout: float
) -> list[str]:
    """The connected groups heard from last more than ``heartbeat_timeout`` ago whose silence is
    not noted yet (each incident once)."""
    connected = Connection.CONNECTED
    return [
        rid
        for rid, g in groups.items()
        if g.connection is connected and now - g.last_seen > heartbeat_timeout and not infos[rid].silent_noted
    ]


def forgettable(
    groups: Mapping[str, GroupState],
    infos: Mapping[str, GroupInfo],
    requests: Collection[str],
    now: float,
    options: QuorumOptions,
    forget_after: float,
    *,
    force: bool = False,
) -> list[str]:
    """The ids to forget: never in a quorum, no request waiting, not live for ``forget_after``
    seconds (any time since they stopped being live when ``force``). Why: heartbeat-only ids that
    went away must not stay listed, and walked by every tick, forever."""
    return [
        rid
        for rid, g in groups.items()
        if not infos[rid].in_a_quorum
        and rid not in requests
        and group_health(g, now, options) is not Health.LIVE
        and (force or now - g.last_seen > forget_after)
    ]


def slot_holder(
    group: GroupState | None, info: GroupInfo | None, now: float, options: QuorumOptions
) -> Holder:
    """What a group is as the holder of a hot-spare slot (`slots.Holder`): never heard, live or down.
    A member declared hung on evidence (lighthouse/hung.py) stays live until the heartbeat timeout:
    a stop of a few seconds is cheaper waited out than handed to a spare, which must heal while
    the stopped group wakes fenced and restarts."""
    if group is None:
        return Holder.NONE
    if (
        info is not None
        and info.reason.startswith(HUNG_REASON)
        and now - group.last_seen <= options.heartbeat_timeout
    ):
        return Holder.LIVE
    return Holder.LIVE if group_health(group, now, options) is Health.LIVE else Holder.DOWN

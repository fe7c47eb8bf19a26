"""Who may make a request of the membership: the rules a hostile or confused client meets first
(docs/security.md), as pure functions, and the little they remember (`Admission`).

A group's heartbeat or quorum request is refused while the lighthouse closes, when the group was
evicted (told once), when its name was fenced (a hot spare has its slot), when another live
process holds the id (`refusal`), and -- a quorum request -- when it claims a step no quorum led
to (`implausible_step`). An admitted request is, to the group's record, a new id, a live one, or
one back from being down (`arrival`). The membership raises the refusal or applies the arrival
(lighthouse/roster.py), under its lock; the id cap (`membership.MAX_GROUPS`) is its own, since
making room forgets ids.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from ftlaunch.lighthouse.quorum import (
    Connection,
    GroupState,
    Health,
    Quorum,
    QuorumMember,
    QuorumOptions,
    group_health,
)
from ftlaunch.lighthouse.resume import stepped_through_outage
from ftlaunch.lighthouse.roster import ADOPTED
from ftlaunch.lighthouse.tickets import Evicted, HeldElsewhere, ImplausibleStep, MembershipError, ShuttingDown

#: How far past the highest step of any quorum a group's claimed step may be (one committed round).
MAX_STEP_ADVANCE = 1


class Arrival(enum.Enum):
    """What an admitted request is to its group's record."""

    #: An id the roster does not know.
    NEW = "new"
    #: A live group's sign of life.
    LIVE = "live"
    #: A group that was silent, disconnected or failed is back.
    BACK = "back"


def held_elsewhere(
    replica_id: str,
    group: GroupState | None,
    holder: str | None,
    incarnation: str,
    now: float,
    options: QuorumOptions,
) -> HeldElsewhere | None:
    """One incarnation holds an id at a time: while ``holder`` (the incarnation holding it; a
    stand-in's is anybody's) is live, another is refused."""
    if group is None or holder is None or holder == incarnation or holder == ADOPTED:
        return None
    if group_health(group, now, options) is not Health.LIVE:
        return None
    return HeldElsewhere(
        f"replica id {replica_id} is held by another live process of the group; it is released when that "
        "process exits, leaves, fails or falls silent"
    )


def refusal(
    replica_id: str,
    incarnation: str,
    now: float,
    options: QuorumOptions,
    *,
    closed: bool,
    evicted: str | None,
    fenced: str | None,
    group: GroupState | None,
    holder: str | None,
) -> MembershipError | None:
    """Why a heartbeat or quorum request of ``replica_id`` from ``incarnation`` is refused, or None.
    In order: the lighthouse is ``closed``; the group was ``evicted`` for that reason (the caller
    tells it once); its name is ``fenced`` for that reason (refused every time: a newer holder has
    the slot); another live incarnation (``holder``) holds the id."""
    if closed:
        return ShuttingDown("lighthouse shutting down")
    if evicted is not None:
        return Evicted(f"replica {replica_id} was evicted: {evicted}")
    if fenced is not None:
        return Evicted(f"replica {replica_id} was replaced: {fenced}")
    if holder is None or holder == incarnation:  # the usual request: its own holder's
        return None
    return held_elsewhere(replica_id, group, holder, incarnation, now, options)


def arrival(group: GroupState | None, now: float, options: QuorumOptions) -> Arrival:
    """What an admitted request is to ``group``'s record."""
    if group is None:
        return Arrival.NEW
    if group.connection is Connection.CONNECTED and now - group.last_seen <= options.heartbeat_timeout:
        return Arrival.LIVE  # group_health's LIVE, without the call: once per request
    return Arrival.LIVE if group_health(group, now, options) is Health.LIVE else Arrival.BACK


def implausible_step(
    member: QuorumMember, high_step: int | None, current: Quorum | None
) -> ImplausibleStep | None:
    """The plausibility rule for healing sources (docs/security.md). A group's step advances by one
    per committed quorum round, and a healer jumps to a step some quorum had: so no group can be
    more than `MAX_STEP_ADVANCE` past ``high_step``, the highest step any quorum of this lighthouse
    had. A claim beyond it is refused; it would make the claimant every group's healing source (and
    its store their meeting point). With no quorum yet (a new or restarted lighthouse) nothing is
    checked, nor for a participant of the ``current`` quorum that reports having stepped on it while
    this lighthouse was unreachable (`resume.stepped_through_outage`)."""
    if (
        high_step is None
        or member.step <= high_step + MAX_STEP_ADVANCE
        or stepped_through_outage(member, current)
    ):
        return None
    return ImplausibleStep(
        f"replica {member.replica_id} claims step {member.step}, but no quorum of this lighthouse got "
        f"past step {high_step}: refused, it would become every group's healing source"
    )


class Admission:
    """What admission remembers: the evictions not yet told to their group, and the highest step of
    any quorum formed (`implausible_step`'s bound; None before the first)."""

    def __init__(self) -> None:
        self._evicted: dict[str, str] = {}
        # What the others read (written only here).
        #: Replica id -> why it was evicted, until the group is told.
        self.evicted: Mapping[str, str] = self._evicted
        #: The highest step of any quorum formed (None: none formed yet).
        self.high_step: int | None = None

    def evict(self, replica_id: str, reason: str) -> None:
        """Tell ``replica_id`` at its next request that it was evicted."""
        self._evicted[replica_id] = reason

    def clear(self, replica_id: str) -> None:
        """Its eviction was told (or is moot: it left)."""
        self._evicted.pop(replica_id, None)

    def quorum_formed(self, quorum: Quorum) -> None:
        top = max(p.step for p in quorum.participants)
        self.high_step = top if self.high_step is None else max(self.high_step, top)

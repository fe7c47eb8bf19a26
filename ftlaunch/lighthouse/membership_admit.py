"""Who may make a request of the membership, and the ids it forgets (`membership.Membership` mixes
it in): the admission of a group's heartbeat or quorum request -- refused while closing, an
eviction told once, a fenced name, a second live incarnation of an id, a step no quorum led to,
one id too many -- and its sign of life; and forgetting ids that never joined a quorum.

Why apart: these are the rules a hostile or confused client meets first (docs/security.md), read
together; the bookkeeping of rounds and quorums (`membership`) reads without them. Runs under the
membership's lock like the rest of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftlaunch.lighthouse.membership_status import ADOPTED, GroupInfo
from ftlaunch.lighthouse.protocol import ANONYMOUS
from ftlaunch.lighthouse.quorum import (
    Connection,
    GroupState,
    Health,
    QuorumMember,
    QuorumOptions,
    group_health,
)
from ftlaunch.lighthouse.spares import SpareSlots
from ftlaunch.lighthouse.tickets import Evicted, HeldElsewhere, ImplausibleStep, ShuttingDown, TooManyGroups

log = logging.getLogger("ftlaunch.lighthouse.membership")

#: How far past the highest step of any quorum a group's claimed step may be (one committed round).
MAX_STEP_ADVANCE = 1


class AdmitMixin:
    """`Membership`'s admission rules; the attributes and helpers below are the membership's."""

    _lock: threading.Lock
    _closed: bool
    _clock: Callable[[], float]
    _wall: Callable[[], float]
    _options: QuorumOptions
    _spares: SpareSlots | None
    _groups: dict[str, GroupState]
    _info: dict[str, GroupInfo]
    _requests: dict[str, QuorumMember]
    _evicted: dict[str, str]
    _high_step: int | None
    max_groups: int
    forget_after: float

    if TYPE_CHECKING:

        def _record(self, event: str, replica_id: str | None, detail: str = "") -> None: ...

        def _mark_prev_broken(self, replica_id: str) -> None: ...

        def _stepped_through_outage(self, member: QuorumMember) -> bool: ...

    def _check_holder(self, rid: str, now: float, incarnation: str) -> None:
        """One incarnation holds an id at a time: while the holder is live, another is refused."""
        g, info = self._groups.get(rid), self._info.get(rid)
        if g is None or info is None or info.incarnation in (incarnation, ADOPTED):
            return
        if group_health(g, now, self._options) is Health.LIVE:
            raise HeldElsewhere(
                f"replica id {rid} is held by another live process of the group; it is released when that "
                "process exits, leaves, fails or falls silent"
            )

    def _check_step(self, member: QuorumMember) -> None:
        """The plausibility rule for healing sources (docs/security.md). A group's step advances by one
        per committed quorum round, and a healer jumps to a step some quorum had: so no group can be
        more than `MAX_STEP_ADVANCE` past the highest step any quorum of this lighthouse had. A claim
        beyond it is refused; it would make the claimant every group's healing source (and its store
        their meeting point). With no quorum yet (a new or restarted lighthouse) nothing is checked,
        nor for a participant of the current quorum that reports having stepped on it while this
        lighthouse was unreachable (`_stepped_through_outage`)."""
        high = self._high_step
        if (
            high is not None
            and member.step > high + MAX_STEP_ADVANCE
            and not self._stepped_through_outage(member)
        ):
            raise ImplausibleStep(
                f"replica {member.replica_id} claims step {member.step}, but no quorum of this lighthouse got "
                f"past step {high}: refused, it would become every group's healing source"
            )

    def _admit(self, rid: str, now: float, incarnation: str = ANONYMOUS) -> bool:
        """Common start of a group's request: refuse while closed, tell an eviction once, refuse a
        second incarnation, count a sign of life. Returns True if the group was not live before."""
        if self._closed:
            raise ShuttingDown("lighthouse shutting down")
        reason = self._evicted.pop(rid, None)
        if reason is not None:
            raise Evicted(f"replica {rid} was evicted: {reason}")
        fenced = self._spares.fenced(rid) if self._spares is not None else None
        if fenced is not None:  # refused every time: the name is never valid again
            raise Evicted(f"replica {rid} was replaced: {fenced}")
        self._check_holder(rid, now, incarnation)
        g = self._groups.get(rid)
        if g is None:
            if len(self._groups) >= self.max_groups:
                self._forget_gone(now, force=True)
                if len(self._groups) >= self.max_groups:
                    raise TooManyGroups(f"the lighthouse tracks {self.max_groups} replica ids already")
            self._info[rid] = GroupInfo(first_seen=self._wall())
            self._record("joined", rid)
            log.info("lighthouse: replica %s joined", rid)
            self._mark_prev_broken(rid)
            revived = True
        elif g.connection is Connection.CONNECTED and now - g.last_seen <= self._options.heartbeat_timeout:
            revived = False  # live (group_health's LIVE, without the call: once per request)
        else:
            health = group_health(g, now, self._options)
            revived = health is not Health.LIVE
            if revived:
                self._record("revived", rid, f"was {health.value}")
                log.info("lighthouse: replica %s is back (was %s)", rid, health.value)
                self._mark_prev_broken(rid)
                info = self._info[rid]
                info.reason, info.silent_noted, info.down_counted = "", False, False
        self._groups[rid] = GroupState(rid, now, Connection.CONNECTED)
        self._info[rid].incarnation = incarnation
        return revived

    def _forget_gone(self, now: float, *, force: bool = False) -> None:
        """Drop ids that never joined a quorum and have not been live for `forget_after` (any time
        since they stopped being live when ``force``): heartbeat-only ids that went away must not
        stay listed, and walked by every tick, forever."""
        gone = [
            rid
            for rid, g in self._groups.items()
            if not self._info[rid].in_a_quorum
            and rid not in self._requests
            and group_health(g, now, self._options) is not Health.LIVE
            and (force or now - g.last_seen > self.forget_after)
        ]
        for rid in gone:
            del self._groups[rid], self._info[rid]
        if gone:
            self._record(
                "forgotten",
                gone[0] if len(gone) == 1 else None,
                f"{len(gone)} id(s) that never joined a quorum",
            )
            log.info(
                "lighthouse: forgot %d replica id(s) that never joined a quorum (e.g. %s)", len(gone), gone[0]
            )

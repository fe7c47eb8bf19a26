"""The quorum requests waiting for a quorum, and the quorum they are compared with (`QuorumRound`).

A round runs from the first parked request to the quorum that answers them. Each request is a
`QuorumTicket`, resolved once: with the quorum it is in (`form`), or with the refusal the
membership withdraws it with (`withdraw`). Between rounds the round remembers the last quorum: the
one this lighthouse formed (`current`), or, before it formed one, the one a restarted lighthouse
adopted from the groups' resume reports (`adopted`, lighthouse/resume.py). The next quorum is
compared with it -- the fast path forms when all its members asked again, and its id changes when
a member lost liveness since (`member_changed`) -- and its members are answered from it: which
participants are lost (`lost_in_quorum`), and whether a group's quorum went on without it
(`superseded_for`).

`state` is the view the pure decision (`quorum.decide_quorum`) reads. It keeps the members of the
previous quorum that have no request parked as requests come and go, so `quorum.may_form` checks
the fast path in O(1): a scan of the previous quorum per request made a round of N requests O(N^2).

Not thread-safe: it runs under the membership's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ftlaunch.lighthouse.quorum import (
    GroupState,
    Health,
    LighthouseState,
    Quorum,
    QuorumMember,
    QuorumOptions,
    group_health,
)
from ftlaunch.lighthouse.tickets import MembershipError, QuorumTicket, Superseded


def lost_members(
    quorum: Quorum, groups: Mapping[str, GroupState], now: float, options: QuorumOptions
) -> tuple[str, ...]:
    """The participants of ``quorum`` not live now (silent, disconnected, failed, or gone)."""
    return tuple(
        p.replica_id for p in quorum.participants
        if (g := groups.get(p.replica_id)) is None or group_health(g, now, options) is not Health.LIVE
    )  # fmt: skip


class QuorumRound:
    """The parked quorum requests and the quorum they are compared with (see the module docstring)."""

    def __init__(self) -> None:
        self._requests: dict[str, QuorumMember] = {}
        self._tickets: dict[str, QuorumTicket] = {}
        # What the others read (each written only here; attributes, not properties: every request reads them).
        #: The parked requests, by replica id.
        self.requests: Mapping[str, QuorumMember] = self._requests
        #: When the first parked request of the round arrived (None: none is parked).
        self.start: float | None = None
        #: The last quorum this lighthouse formed.
        self.current: Quorum | None = None
        #: The newest quorum adopted from resume reports (kept after this lighthouse formed one).
        self.adopted: Quorum | None = None
        #: How many times a quorum with a new id formed.
        self.changes = 0
        #: The members of the previous quorum (this lighthouse's, or the adopted one).
        self._members: frozenset[str] = frozenset()
        #: A member of the previous quorum lost liveness since it formed (or it was adopted).
        self._broken = False
        #: Members of the previous quorum with no request parked; None: to be recounted.
        self._missing: set[str] | None = None
        self._state_cache: LighthouseState | None = None  # see `state`
        #: Bumped whenever a member of the previous quorum goes down or comes back.
        self._lost_version = 0
        self._lost_cache: tuple[int, int, tuple[str, ...]] | None = None  # (quorum id, version, lost)

    # ---- reading

    def watched(self) -> tuple[Quorum | None, bool]:
        """The quorum the groups step on now, and whether it is adopted: this lighthouse's current
        quorum, or before it formed one, the quorum it adopted (its members step on it through the
        outage, worker/outage.py)."""
        if self.current is not None:
            return self.current, False
        return self.adopted, self.adopted is not None

    def state(self, groups: Mapping[str, GroupState], next_quorum_id: int) -> LighthouseState:
        """What the decision reads: a view, not a copy (the decision functions do not mutate)."""
        adopted = self.current is None and self.adopted is not None
        prev = self.adopted if adopted else self.current
        if prev is not None and self._missing is None:  # once per quorum (and per adoption)
            self._missing = {rid for rid in prev.replica_ids if rid not in self._requests}
        missing = self._missing if prev is not None else None
        # Whether an adopted quorum's members are the same incarnations is unknown: new id.
        broken = self._broken or adopted
        # The same view serves every request of a round (its mappings and its set are the live
        # ones, compared by identity): it is made again only when another of its fields changed.
        state = self._state_cache
        if (
            state is not None
            and state.prev_missing is missing
            and state.prev_quorum is prev
            and state.round_start == self.start
            and state.prev_quorum_broken == broken
            and state.next_quorum_id == next_quorum_id
            and state.groups is groups
            and state.requests is self._requests
        ):
            return state
        state = self._state_cache = LighthouseState(
            groups=groups,
            requests=self._requests,
            round_start=self.start,
            prev_quorum=prev,
            prev_quorum_broken=broken,
            next_quorum_id=next_quorum_id,
            prev_missing=missing,
        )
        return state

    def lost_in_quorum(
        self,
        replica_id: str,
        groups: Mapping[str, GroupState],
        clock: Callable[[], float],
        options: QuorumOptions,
    ) -> tuple[int, tuple[str, ...]] | None:
        """When ``replica_id`` is a member of the quorum the groups step on (`watched`, adopted or
        not) and some of its participants are no longer live, the quorum's id and theirs; else None.
        O(1) while the quorum is whole (every heartbeat asks): the list is computed once per change
        of a member's liveness (`member_changed`)."""
        quorum = self.current if self.current is not None else self.adopted
        if not self._broken or quorum is None or replica_id not in self._members:
            return None
        cached = self._lost_cache
        if cached is None or cached[0] != quorum.quorum_id or cached[1] != self._lost_version:
            cached = self._lost_cache = (
                quorum.quorum_id,
                self._lost_version,
                lost_members(quorum, groups, clock(), options),
            )
        return (quorum.quorum_id, cached[2]) if cached[2] else None

    def superseded_for(self, replica_id: str, was_in_a_quorum: bool) -> int | None:
        """The current quorum's id when ``replica_id`` was in a quorum before (``was_in_a_quorum``)
        but is not a participant of the current one; else None. O(1)."""
        if self.current is None or not was_in_a_quorum or replica_id in self._members:
            return None
        return self.current.quorum_id

    # ---- changing

    def park(self, member: QuorumMember, now: float) -> QuorumTicket:
        """Park ``member``'s request; a request of the same group still parked is answered `Superseded`."""
        rid = member.replica_id
        old = self._tickets.get(rid)
        if old is not None:
            old.resolve(error=Superseded(f"superseded by a newer quorum request of replica {rid}"))
        ticket = QuorumTicket(member)
        self._tickets[rid] = ticket
        self._requests[rid] = member
        if self._missing is not None:
            self._missing.discard(rid)
        if self.start is None:
            self.start = now
        return ticket

    def withdraw(
        self, replica_id: str, ticket: QuorumTicket | None = None, error: MembershipError | None = None
    ) -> bool:
        """Withdraw ``replica_id``'s parked request (only if it is ``ticket``, when given) and answer
        it ``error``. Returns True if there was one."""
        current = self._tickets.get(replica_id)
        if current is None or (ticket is not None and current is not ticket):
            return False
        del self._tickets[replica_id], self._requests[replica_id]
        if self._missing is not None and replica_id in self._members:
            self._missing.add(replica_id)
        if not self._requests:
            self.start = None
        current.resolve(error=error)
        return True

    def form(self, quorum: Quorum, now: float) -> bool:
        """``quorum`` formed: answer its participants' requests with it; it is the previous quorum
        from now on. The requests of others stay parked (a new round from ``now``). Returns whether
        its id is new."""
        changed = self.current is None or quorum.quorum_id != self.current.quorum_id
        self.current = quorum
        self._missing = None
        self._members = frozenset(quorum.replica_ids)
        self._broken = False
        requests, tickets = self._requests, self._tickets
        for member in quorum.participants:
            rid = member.replica_id
            del requests[rid]
            tickets.pop(rid).resolve(quorum=quorum)
        self.start = now if requests else None
        if changed:
            self.changes += 1
        return changed

    def adopt(self, quorum: Quorum) -> None:
        """``quorum``, reported from a previous lighthouse, is the previous quorum until this
        lighthouse forms one. Its members are the previous quorum's: a member that goes down is
        then told to its peers (`lost_in_quorum`), which may step on it through the outage."""
        self.adopted = quorum
        self._missing = None
        self._members, self._broken = frozenset(quorum.replica_ids), True

    def member_changed(self, replica_id: str) -> None:
        """``replica_id`` lost or regained liveness (or joined, left): if it is a member of the
        previous quorum, the next quorum needs a new id and its lost members are counted again."""
        if replica_id in self._members:
            self._broken = True
            self._lost_version += 1

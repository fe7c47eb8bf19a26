"""The lighthouse's slot bookkeeping for hot spares: who holds which replica-group slot, who waits.

`SpareSlots` lives inside `ftlaunch.lighthouse.membership.Membership` and is only called under its
lock: the membership tells it what happened to groups (through a health function of lighthouse
names) and applies the `Reassignment`s it returns (the old holder's name is fenced: forgotten and
refused from then on). The rule that picks a spare for a slot is the pure
`ftlaunch.lighthouse.slots.assign`. The table is created by the first claim (its ``slots`` count is
the job's N), so a job without spares never has one and pays nothing.

A claim is a long poll (`ClaimTicket`): resolved once with a `ClaimGrant` (the slot, its lighthouse
name), with ``done`` (every slot's training finished: the spare can exit), with nothing (the poll's
timeout passed: ask again) or with an error. Its connection closing withdraws it, so a spare killed
while it waits disappears from the status at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ftlaunch.lighthouse.slots import Claimant, Holder, SlotView, all_done, assign, replica_id_for


class ClaimError(ValueError):
    """A claim the table refuses (its slot count or preferred slot does not fit the job)."""


@dataclass(frozen=True)
class ClaimGrant:
    """The answer to a claim: train as replica group ``slot`` under lighthouse name ``replica_id``."""

    slot: int
    replica_id: str
    #: It replaced another holder of the slot (a spare promoted, or a restarted group reclaiming).
    replaced: str | None = None


class ClaimTicket:
    """One parked claim: resolved once (grant, done, nothing, or error); callbacks like `QuorumTicket`'s."""

    __slots__ = ("claimant", "grant", "done_job", "error", "_done", "_callbacks", "_lock")

    def __init__(self, claimant: str) -> None:
        self.claimant = claimant
        self.grant: ClaimGrant | None = None
        self.done_job = False
        self.error: Exception | None = None
        self._done = False
        self._callbacks: list[Callable[[ClaimTicket], None]] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[ClaimTicket], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def _resolve(
        self, grant: ClaimGrant | None = None, *, done_job: bool = False, error: Exception | None = None
    ) -> bool:
        with self._lock:
            if self._done:
                return False
            self.grant, self.done_job, self.error, self._done = grant, done_job, error, True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True


@dataclass
class _Slot:
    index: int
    holder: str | None = None
    replica_id: str | None = None
    generation: int = -1  # of the current holder; -1: never held
    assigned_at: float | None = None


@dataclass
class _Waiting:
    preferred: int | None
    since: float
    tickets: list[ClaimTicket] = field(default_factory=list)
    #: When its last parked claim timed out (it is about to ask again).
    last_poll: float = 0.0


@dataclass(frozen=True)
class Reassignment:
    """A slot changed hands: ``old`` (a lighthouse name, or None) is fenced, ``new`` will join."""

    slot: int
    claimant: str
    new: str
    old: str | None


class SpareSlots:
    """The slot table of one job (see the module docstring). Not thread-safe: the membership's lock."""

    def __init__(self, slots: int, *, started: float, arrival_grace: float, unclaimed_grace: float) -> None:
        if slots < 1:
            raise ClaimError(f"slots must be >= 1, got {slots}")
        self.count = slots
        self._slots = [_Slot(i) for i in range(slots)]
        self._waiting: dict[str, _Waiting] = {}
        self._fenced: dict[str, str] = {}  # old lighthouse name -> why
        self._left: set[str] = set()
        self._started = started
        self._arrival_grace = arrival_grace
        self._unclaimed_grace = unclaimed_grace
        self.promotions = 0

    # ---- what claimants do

    def claim(self, claimant: str, preferred: int | None, slots: int, now: float) -> ClaimTicket:
        """Park a claim of ``claimant`` (one ticket per rank of the group)."""
        if slots != self.count:
            raise ClaimError(f"this job has {self.count} slots, the claim says {slots}")
        if preferred is not None and not 0 <= preferred < self.count:
            preferred = None  # a group started as a spare (its index is >= the slot count)
        ticket = ClaimTicket(claimant)
        waiting = self._waiting.get(claimant)
        if waiting is None:
            waiting = self._waiting[claimant] = _Waiting(preferred, now)
        waiting.tickets.append(ticket)
        return ticket

    def withdraw(self, ticket: ClaimTicket, now: float, *, timed_out: bool) -> None:
        """A ticket's poll ended unanswered (timeout: answered "ask again", the claimant keeps its
        place in the queue; closed: nobody to tell, the claimant is gone if no other rank waits)."""
        waiting = self._waiting.get(ticket.claimant)
        if waiting is not None and ticket in waiting.tickets:
            waiting.tickets.remove(ticket)
            waiting.last_poll = now
            if not waiting.tickets and not timed_out:
                del self._waiting[ticket.claimant]
        ticket._resolve()

    def forget_idle(self, now: float, idle: float) -> None:
        """Drop claimants with no poll parked for ``idle`` seconds (they stopped asking)."""
        for name, waiting in list(self._waiting.items()):
            if not waiting.tickets and now - waiting.last_poll > idle:
                del self._waiting[name]

    # ---- what the membership asks and tells

    def fenced(self, replica_id: str) -> str | None:
        """Why ``replica_id`` may not be heard any more (a newer holder has its slot), or None."""
        return self._fenced.get(replica_id)

    def left(self, replica_id: str) -> None:
        """The holder named ``replica_id`` left gracefully: its slot is done."""
        if any(s.replica_id == replica_id for s in self._slots):
            self._left.add(replica_id)

    def reconcile(self, now: float, health: Callable[[str], Holder]) -> list[Reassignment]:
        """Apply the rule to the current state: resolve the tickets of claimants that got a slot
        (or everybody's, with ``done``, when every slot is done) and return the slots that changed
        hands. ``health(name)`` is LIVE, DOWN or NONE (never heard) for a lighthouse name."""
        views = [self._view(s, health) for s in self._slots]
        if all_done(views):
            for waiting in self._waiting.values():
                for ticket in waiting.tickets:
                    ticket._resolve(done_job=True)
            self._waiting.clear()
            return []
        claimants = [Claimant(name, w.preferred, w.since) for name, w in self._waiting.items() if w.tickets]
        if not claimants:
            return []
        chosen = assign(views, claimants, now=now, started=self._started, arrival_grace=self._arrival_grace,
                        unclaimed_grace=self._unclaimed_grace)  # fmt: skip
        changes = []
        for name, index in chosen.items():
            slot = self._slots[index]
            waiting = self._waiting.pop(name)
            old = None
            if slot.holder != name:
                old = slot.replica_id
                new = replica_id_for(index, slot.generation + 1)
                if old is not None:
                    self._fenced[old] = f"slot {index} was given to {name} (now {new})"
                    if waiting.preferred != index:  # a spare, not the slot's own group restarted
                        self.promotions += 1
                slot.holder, slot.generation, slot.replica_id, slot.assigned_at = (
                    name,
                    slot.generation + 1,
                    new,
                    now,
                )
                changes.append(Reassignment(index, name, new, old))
            assert slot.replica_id is not None  # set above or by an earlier assignment
            grant = ClaimGrant(index, slot.replica_id, old)
            for ticket in waiting.tickets:
                ticket._resolve(grant)
        return changes

    def close(self, error: Exception) -> None:
        for waiting in self._waiting.values():
            for ticket in waiting.tickets:
                ticket._resolve(error=error)
        self._waiting.clear()

    def _view(self, slot: _Slot, health: Callable[[str], Holder]) -> SlotView:
        if slot.replica_id is None:
            return SlotView(slot.index)
        if slot.replica_id in self._left:
            return SlotView(slot.index, slot.holder, Holder.LEFT, slot.assigned_at, slot.generation)
        state = health(slot.replica_id)
        if state is Holder.NONE:
            state = Holder.ARRIVING  # given, not heard from yet under its new name
        return SlotView(slot.index, slot.holder, state, slot.assigned_at, slot.generation)

    # ---- status (built into `status.SparesStatus` by the membership)

    def slots(
        self, health: Callable[[str], Holder]
    ) -> list[tuple[int, str | None, str | None, Holder, float | None]]:
        """Each slot: (index, lighthouse name, holder, state, when it was given)."""
        return [
            (s.index, s.replica_id, s.holder, self._view(s, health).state, s.assigned_at) for s in self._slots
        ]

    def waiting(self) -> list[tuple[str, int | None, float, int]]:
        """The claimants waiting, longest first: (name, preferred slot, since, parked polls)."""
        ordered = sorted(self._waiting.items(), key=lambda kv: (kv[1].since, kv[0]))
        return [(name, w.preferred, w.since, len(w.tickets)) for name, w in ordered]

    @property
    def fenced_names(self) -> list[str]:
        return sorted(self._fenced)

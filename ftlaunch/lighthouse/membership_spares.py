"""The hot-spares part of the membership (`membership.Membership` mixes it in): claims for a
replica-group slot, and the slot table's changes applied to the groups.

Why apart: a job without spares never touches it (the table is created by the first claim), and
the rule of who takes which slot is `slots.py`'s, the table `spares.py`'s; what is left here is
the glue to the groups -- a replaced holder fenced, forgotten and its parked request answered.
Runs under the membership's lock like the rest of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftlaunch.lighthouse.quorum import GroupState, Health, QuorumOptions, group_health
from ftlaunch.lighthouse.slots import Holder
from ftlaunch.lighthouse.spares import ClaimTicket, SpareSlots
from ftlaunch.lighthouse.status import HUNG_REASON, SlotStatus, SparesStatus, SpareStatus
from ftlaunch.lighthouse.tickets import Evicted, MembershipError, QuorumTicket, ShuttingDown

log = logging.getLogger("ftlaunch.lighthouse.membership")


class SparesMixin:
    """`Membership`'s hot-spare methods; the attributes and helpers below are the membership's."""

    _lock: threading.Lock
    _closed: bool
    _clock: Callable[[], float]
    _options: QuorumOptions
    _spares: SpareSlots | None
    _groups: dict[str, GroupState]
    _info: dict[str, Any]

    if TYPE_CHECKING:

        def _decide(self, now: float) -> None: ...

        def _drop_request(
            self, rid: str, ticket: QuorumTicket | None = None, error: MembershipError | None = None
        ) -> bool: ...

        def _mark_prev_broken(self, replica_id: str) -> None: ...

        def _record(self, event: str, replica_id: str | None, detail: str = "") -> None: ...

    def claim(self, claimant: str, *, slots: int, preferred: int | None) -> ClaimTicket:
        """Park ``claimant``'s claim for one of the job's ``slots`` replica-group slots (maybe
        answered at once). The first claim creates the slot table. Raises `ShuttingDown`, or
        `ClaimError` when ``slots`` differs from the table's."""
        with self._lock:
            if self._closed:
                raise ShuttingDown("lighthouse shutting down")
            now = self._clock()
            if self._spares is None:
                opts = self._options
                self._spares = SpareSlots(
                    slots,
                    started=now,
                    arrival_grace=opts.heartbeat_timeout,
                    unclaimed_grace=opts.join_timeout,
                )
            ticket = self._spares.claim(claimant, preferred, slots, now)
            self._decide(now)
        return ticket

    def end_claim(self, ticket: ClaimTicket, *, timed_out: bool) -> None:
        """A claim's poll ended unanswered: its timeout passed (``timed_out``; the spare asks
        again) or its connection closed (the spare is gone, unless another rank still waits)."""
        with self._lock:
            if self._spares is not None and not ticket.done:
                self._spares.withdraw(ticket, self._clock(), timed_out=timed_out)

    def _holder(self, rid: str, now: float) -> Holder:
        g = self._groups.get(rid)
        if g is None:
            return Holder.NONE
        info = self._info.get(rid)
        if (
            info is not None
            and info.reason.startswith(HUNG_REASON)
            and now - g.last_seen <= self._options.heartbeat_timeout
        ):
            return (
                Holder.LIVE
            )  # declared hung on evidence: its slot waits for the heartbeat timeout, as before
        return Holder.LIVE if group_health(g, now, self._options) is Health.LIVE else Holder.DOWN

    def _spares_status(self, now: float) -> SparesStatus | None:
        spares = self._spares
        if spares is None:
            return None
        slots = tuple(
            SlotStatus(index, rid, holder, state.value, round(now - at, 3) if at is not None else None)
            for index, rid, holder, state, at in spares.slots(lambda rid: self._holder(rid, now))
        )
        waiting = tuple(
            SpareStatus(name, preferred, round(now - since, 3), polls)
            for name, preferred, since, polls in spares.waiting()
        )
        return SparesStatus(slots, waiting, spares.promotions, tuple(spares.fenced_names))

    def _reconcile_spares(self, now: float) -> None:
        """Give claimable slots to waiting claimants; fence and forget the replaced holders."""
        assert self._spares is not None
        for change in self._spares.reconcile(now, lambda rid: self._holder(rid, now)):
            old = change.old
            if old is not None:
                self._groups.pop(old, None)
                self._info.pop(old, None)
                self._drop_request(old, error=Evicted(f"replica {old} was replaced by {change.new}"))
                self._mark_prev_broken(old)
                self._record(
                    "replaced", old, f"slot {change.slot} given to {change.claimant} as {change.new}"
                )
            self._record("claimed", change.new, f"slot {change.slot} by {change.claimant}")
            log.info(
                "lighthouse: slot %d given to %s as %s%s", change.slot, change.claimant, change.new,
                f" (replacing {old})" if old else "",
            )  # fmt: skip

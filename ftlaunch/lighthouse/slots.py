"""Which hot spare takes which replica-group slot: a pure rule, no I/O, no clock reads.

With ``--spares K`` a job runs N *slots* (the replica-group ids 0..N-1: a data shard and a sampler
position each) and N+K groups of workers. Every group *claims* a slot when it is ready to train
(``POST /claim``); the groups that get none wait as spares. The lighthouse's bookkeeping
(`ftlaunch.lighthouse.spares`) turns its state into `SlotView`s and `Claimant`s, passes its clock
reading as ``now`` and applies what `assign` returns. So the rule is unit-tested without sockets or
sleeps (tests/unit/test_spares.py).

Rules (in the order `assign` applies them):

1. A claimant that already holds a slot keeps it (every rank of a group claims under one name, and
   a claim may be repeated).
2. A slot is *claimable* when its holder is down (disconnected, failed, silent), or when its holder
   was given it but never showed up within the grace (``arrival_grace`` for a spare, which is hot;
   ``unclaimed_grace`` for a slot's first holder, which may still be waiting for its own ranks at
   start-up), or when nobody ever held it.
   A slot whose holder left gracefully is *done*: the training of that shard finished. Once a slot
   is done and no holder is live (or arriving), the job has finished: the claims are answered
   ``done``, so a group restarted after the end does not train a slot from scratch alone.
3. A slot nobody ever held goes to the claimant that prefers it (the group started for it); to
   anybody else only after ``unclaimed_grace`` from the first claim (its own group never came).
4. Claimable slots are filled lowest index first; each goes to the claimant preferring it if one
   waits, else to the claimant waiting longest (ties: by name). A spare therefore takes a failed
   group's slot the moment the failure is known, and the failed group, restarted, finds its slot
   taken and waits as a spare in turn.

A holder's lighthouse name changes with every new holder (`replica_id_for`): the first holder of
slot 1 is ``rg1``, the next ``rg1.1``, then ``rg1.2``. The old name is then *fenced*: a late request
under it (a hung holder that wakes up) is refused, so two processes never train the same shard.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass


class Holder(enum.Enum):
    """What the lighthouse knows about a slot holder's lighthouse name."""

    #: Never held.
    NONE = "none"
    #: Given to a claimant that has not yet been heard under its new name.
    ARRIVING = "arriving"
    #: Heard from and live.
    LIVE = "live"
    #: Disconnected, failed or silent: the slot can be claimed.
    DOWN = "down"
    #: Left gracefully: its training is over, the slot is done.
    LEFT = "left"


@dataclass(frozen=True)
class SlotView:
    """One slot as the rule sees it."""

    index: int
    #: The claimant holding it (None: never held).
    holder: str | None = None
    state: Holder = Holder.NONE
    #: When it was last given to a claimant (monotonic seconds), for the arrival grace.
    assigned_at: float | None = None
    #: How many holders it had before the current one (0: the current holder is its first).
    generation: int = 0


@dataclass(frozen=True)
class Claimant:
    """A group waiting for a slot: its name (the same for all its ranks), the slot it was started
    for (None: started as a spare) and when it first asked."""

    name: str
    preferred: int | None
    since: float


def replica_id_for(slot: int, generation: int) -> str:
    """The lighthouse name of slot ``slot``'s ``generation``-th holder.

    0 gives ``rg<slot>``, as without spares.
    """
    return f"rg{slot}" if generation == 0 else f"rg{slot}.{generation}"


_HOLDER_NAME = re.compile(r"rg(\d+)(?:\.\d+)?")
_TRAILING_NUMBER = re.compile(r".*?(\d+)")


def slot_of(replica_id: str) -> int | None:
    """The replica-group slot a lighthouse name stands for: ``rg1``, ``rg1.1`` and ``rg1.2`` are all
    slot 1 (`replica_id_for`). A name of another form counts by the number it ends in (torchft-style
    ``train_ddp_3`` is slot 3); None when it ends in none."""
    m = _HOLDER_NAME.fullmatch(replica_id) or _TRAILING_NUMBER.fullmatch(replica_id)
    return int(m.group(1)) if m is not None else None


def claimable(
    slot: SlotView, now: float, arrival_grace: float, first_arrival_grace: float | None = None
) -> bool:
    """Whether a new claimant may take ``slot`` now (rule 2; a never-held slot: see `assign`)."""
    if slot.state is Holder.DOWN or slot.state is Holder.NONE:
        return True
    if slot.state is Holder.ARRIVING:
        grace = (
            first_arrival_grace if slot.generation == 0 and first_arrival_grace is not None else arrival_grace
        )
        return slot.assigned_at is not None and now - slot.assigned_at > grace
    return False


def all_done(slots: Sequence[SlotView]) -> bool:
    """The training finished (a holder left and nobody trains any more): spares may go home."""
    return any(s.state is Holder.LEFT for s in slots) and not any(
        s.state is Holder.LIVE or s.state is Holder.ARRIVING for s in slots
    )


def assign(
    slots: Sequence[SlotView],
    claimants: Sequence[Claimant],
    *,
    now: float,
    started: float,
    arrival_grace: float,
    unclaimed_grace: float,
) -> dict[str, int]:
    """The new assignments, claimant name -> slot index (rules 1-4 of the module docstring).

    ``started`` is when the first claim arrived (for ``unclaimed_grace``). A claimant that already
    holds a slot is returned with it too, so its waiting ranks are answered.
    """
    out: dict[str, int] = {}
    held = {s.holder: s.index for s in slots if s.holder is not None and s.state is not Holder.LEFT}
    waiting = []
    for c in claimants:
        if c.name in held:
            out[c.name] = held[c.name]
        else:
            waiting.append(c)
    waiting.sort(key=lambda c: (c.since, c.name))
    for slot in sorted(slots, key=lambda s: s.index):
        if not waiting or not claimable(slot, now, arrival_grace, unclaimed_grace):
            continue
        chosen = next((c for c in waiting if c.preferred == slot.index), None)
        if chosen is None:
            open_to_all = slot.holder is not None or now - started > unclaimed_grace
            if not open_to_all:
                continue
            chosen = waiting[0]
        waiting.remove(chosen)
        out[chosen.name] = slot.index
    return out

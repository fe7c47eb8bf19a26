"""What one replica group does in one step, given the quorum: a pure function.

Every group computes its own plan from the same `Quorum`, so all groups agree without further
messages: who is in the cross-group process group and at which rank, which groups are up to date
(the *sources*), which must heal, who sends to whom, and whose gradients count (the
*participants*: every source, or with `WorldSizeMode.FIXED_WITH_SPARES` the first
``min_replica_size`` of them). Healing assignments are round-robin over the sources so a burst of
rejoining groups spreads its load over every healthy group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ftlaunch.lighthouse.quorum import Quorum


class WorldSizeMode(Enum):
    """How many groups' gradients a step averages when more than ``min_replica_size`` are up to date
    (torchft's semantics).

    ``DYNAMIC``: all of them; the divisor follows the quorum. ``FIXED_WITH_SPARES``: exactly
    ``min_replica_size`` (the lowest-ranked up-to-date groups); the others are *spares*: they take
    part in every collective and step with the average, contributing zero gradients, so a job's
    effective batch size stays fixed while spares stand by to replace a failed group at once.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


@dataclass(frozen=True)
class StepPlan:
    quorum_id: int
    #: This group's rank in the cross-group process group, and that group's size.
    replica_rank: int
    replica_world_size: int
    #: The step every source group is at; a healed group resumes from it.
    max_step: int
    #: Number of up-to-date groups: the divisor of the gradient average (healers contribute zeros).
    num_sources: int
    #: This group's rank among the sources, or None when it heals this step.
    source_rank: int | None
    #: Healing: the replica rank (and id) to copy the state from, or None.
    recover_src_rank: int | None
    recover_src_id: str | None
    #: Sources only: replica ranks of the healers assigned to this group.
    recover_dst_ranks: tuple[int, ...]
    #: store address ("host:port") that hosts the cross-group rendezvous for this quorum.
    store_address: str
    #: Groups whose gradients count, the divisor of the average: ``num_sources``, or at most
    #: ``min_replica_size`` with `WorldSizeMode.FIXED_WITH_SPARES`.
    num_participants: int = 0
    #: This group's rank among them; None when it heals or is a spare (it contributes zeros).
    participant_rank: int | None = None
    #: Groups at ``max_step`` when the quorum formed (with init_sync at step 0: all of them, though
    #: only the primary is a source): what ``min_replica_size`` is checked against, as in torchft.
    num_up_to_date: int = 0

    @property
    def heal(self) -> bool:
        return self.recover_src_rank is not None

    @property
    def participates(self) -> bool:
        """Whether this group's gradients count this step."""
        return self.participant_rank is not None


def plan_step(
    quorum: Quorum,
    replica_id: str,
    *,
    init_sync: bool = True,
    world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
    min_replica_size: int = 1,
) -> StepPlan:
    """Compute this group's plan for the step from the quorum (pure, deterministic)."""
    members = list(quorum.participants)
    ids = [m.replica_id for m in members]
    if replica_id not in ids:
        raise ValueError(f"replica {replica_id!r} is not in quorum {quorum.quorum_id} ({ids})")
    me = ids.index(replica_id)
    max_step = max(m.step for m in members)
    if init_sync and max_step == 0:
        # At the very start everyone is at step 0 but their weights differ (random init): one primary
        # (the first participant) is the source, everyone else copies it.
        sources = [0]
    else:
        sources = [i for i, m in enumerate(members) if m.step == max_step]
    healers = [i for i in range(len(members)) if i not in sources]

    src_of = {h: sources[k % len(sources)] for k, h in enumerate(healers)}
    recover_src = src_of.get(me)
    dsts = tuple(h for h, s in src_of.items() if s == me)
    # The rendezvous store of the lowest-ranked source: sources are the groups most likely to be
    # healthy, and every group picks the same one.
    store_address = members[sources[0]].store_address
    participants = sources
    if world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
        participants = sources[:min_replica_size]
    return StepPlan(
        quorum_id=quorum.quorum_id,
        replica_rank=me,
        replica_world_size=len(members),
        max_step=max_step,
        num_sources=len(sources),
        source_rank=sources.index(me) if me in sources else None,
        recover_src_rank=recover_src,
        recover_src_id=members[recover_src].replica_id if recover_src is not None else None,
        recover_dst_ranks=dsts,
        store_address=store_address,
        num_participants=len(participants),
        participant_rank=participants.index(me) if me in participants else None,
        num_up_to_date=sum(1 for m in members if m.step == max_step),
    )

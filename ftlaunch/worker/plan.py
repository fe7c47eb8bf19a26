"""What one replica group does in one step, given the quorum: a pure function.

Every group computes its own plan from the same `Quorum`, so all groups agree without further
messages: who is in the cross-group process group and at which rank, which groups are up to date
(the *sources*), which must heal, and who sends to whom. Healing assignments are round-robin over
the sources so a burst of rejoining groups spreads its load over every healthy group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftlaunch.lighthouse.quorum import Quorum


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

    @property
    def heal(self) -> bool:
        return self.recover_src_rank is not None


def plan_step(quorum: Quorum, replica_id: str, *, init_sync: bool = True) -> StepPlan:
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
    )

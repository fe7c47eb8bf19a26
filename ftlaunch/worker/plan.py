"""What one replica group does in one step, given the quorum: a pure function.

Every group computes its own plan from the same `Quorum`, so all groups agree without further
messages: who is in the cross-group process group and at which rank, which groups are up to date
(the *sources*), which must heal, who sends to whom, and whose gradients count (the
*participants*: every source, or with `WorldSizeMode.FIXED_WITH_SPARES` the first
``min_replica_size`` of them). Healing assignments are round-robin over the sources so a burst of
rejoining groups spreads its load over every healthy group.

Heal sources serve a snapshot (`STAGED_KEY`): the state they committed, copied at the commit boundary
(`worker/committed.py`), never the training tensors, which the next forward pass changes (BatchNorm
statistics) while a heal reads them. Copying costs a pass over the state, so a group snapshots only
when a heal is due (`snapshot_due`: the step it last planned left a group behind); a healer that first shows
up in a quorum without a snapshotted source waits that one step (`StepPlan.waits`: it takes part with zero
gradients, commits nothing) while its sources commit it and snapshot its end, and heals in the next. Training
loops that hold their state still while a quorum is taken (LocalSGD, DiLoCo: a sync point) serve their live
state at every quorum instead.

Heal sources must agree (`CLAIM_KEY`): each snapshotted group at the quorum's highest step claims, in
its quorum data, a checksum of the state it serves (one per group rank). Healers copy only from sources
whose claim is the one most of them make; a lone dissenter (a group that lies, or drifted) or a
group that makes no claim while others do serves nobody. When the most common claims tie, nobody
can tell which is right: every claimant serves (DiLoCo groups legitimately hold different local
weights at a sync, BatchNorm statistics differ between groups that see different data), and each
healer checks what it gets against its own source's claim (`StepPlan.contested` says so). The
healer checks what it receives against the claim (`worker/recovery.py`). A healer whose previous
heal failed (its ``commit_failures``) is moved to the next agreeing source, so one source that
serves bad state cannot hold a healer back for good.

A snapshot's claim goes with the group's quorum request. Groups serving their live state claim on
demand instead (`claims_wanted`): they ask with an empty claim (``[]``: "I claim on demand"); when the
quorum then holds a healer, every member asks again at once, this time with its checksum, and plans
from that second quorum. The choice depends on the quorum alone, so every rank of every group makes
the same one (a group that asked again alone would wait in the lighthouse for peers already waiting
for it in a collective).

Groups that publish a *layout* (how they shard their state, `LAYOUT_KEY` in their quorum data) are
checked against the sources' layouts: a group laid out differently would average gradient shards
with the wrong peers' shards and heal into the wrong places, so it must not take part.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ftlaunch.lighthouse.quorum import Quorum, QuorumMember

#: Key of a group's layout in its quorum data: ``{"digest": str, "text": str}``.
LAYOUT_KEY = "layout"
#: Key of a group's heal claim in its quorum data: ``[checksum of group rank 0's state, rank 1's, ...]``
#: (`worker.recovery.state_claim`), made for the step the group asks with.
CLAIM_KEY = "claim"
#: Key of ``true`` in a group's quorum data when every rank of it holds a snapshot of the state it
#: committed at the step it asks with (`worker.committed`): only such a group serves heals.
STAGED_KEY = "staged"
#: Key of ``true`` in a group's quorum data when it can heal in this step: it waits for the heal
#: before its forward pass (or holds its state still, `worker.committed`'s live mode).
HEAL_READY_KEY = "heal_ready"
#: Longest claim list / checksum text a plan accepts (anything else counts as no claim).
_MAX_CLAIM_RANKS = 4096
_MAX_CLAIM_LEN = 128


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
    #: Why this group must not take part (its layout differs from a source's), or None.
    layout_conflict: str | None = None
    #: Groups whose gradients count, the divisor of the average: ``num_sources``, or at most
    #: ``min_replica_size`` with `WorldSizeMode.FIXED_WITH_SPARES`.
    num_participants: int = 0
    #: This group's rank among them; None when it heals or is a spare (it contributes zeros).
    participant_rank: int | None = None
    #: Their replica ids, in quorum order (whose batches a committed step trained).
    participant_ids: tuple[str, ...] = ()
    #: Groups at ``max_step`` when the quorum formed (with init_sync at step 0: all of them, though
    #: only the primary is a source): what ``min_replica_size`` is checked against, as in torchft.
    num_up_to_date: int = 0
    #: Healing: the source's claim (per group rank) the received state must match; None when the
    #: sources make no claims (then nothing is checked beyond the transport's own checksums).
    recover_claim: tuple[str, ...] | None = None
    #: Ids of up-to-date groups whose claim disagrees with the trusted one (they heal nobody).
    untrusted_ids: tuple[str, ...] = ()
    #: The up-to-date groups' most common claims tie: no majority says which state is right.
    contested: bool = False
    #: Groups behind ``max_step`` (healing this step, or waiting for a snapshot to heal from).
    num_healers: int = 0
    #: Some healers wait this step: no up-to-date group holds a snapshot to serve yet (they take one
    #: at the end of this step, `snapshot_due`, and the healers heal in the next), or a healer was
    #: not ready (`HEAL_READY_KEY`: it asks ready next time).
    deferred: bool = False

    @property
    def heal(self) -> bool:
        return self.recover_src_rank is not None

    @property
    def waits(self) -> bool:
        """This group is behind and does not heal this step (`deferred`): it takes part with zero
        gradients, votes, and commits nothing."""
        return self.source_rank is None and self.recover_src_rank is None

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
    servers = [i for i in sources if staged(members[i])]
    trusted, contested = (servers, False) if len(servers) <= 1 else _trusted_sources(members, servers)

    # Round-robin over the trusted sources; a healer whose last heal failed moves on by its failures.
    # A healer not ready to heal now (its forward pass already runs on its old state) waits a step.
    healing = [h for h in healers if members[h].data.get(HEAL_READY_KEY) is True] if trusted else []
    src_of: dict[int, int] = {}
    for k, h in enumerate(healing):
        src_of[h] = trusted[(k + members[h].commit_failures) % len(trusted)]
    recover_src = src_of.get(me)
    dsts = tuple(h for h, s in src_of.items() if s == me)
    # The rendezvous store of the lowest-ranked source: sources are the groups most likely to be
    # healthy, and every group picks the same one. (Claims do not move it: whoever takes part in
    # the process group can disturb it anyway; docs/security.md.)
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
        layout_conflict=_layout_conflict(members[me], [members[i] for i in sources]),
        num_participants=len(participants),
        participant_rank=participants.index(me) if me in participants else None,
        participant_ids=tuple(ids[i] for i in participants),
        num_up_to_date=sum(1 for m in members if m.step == max_step),
        recover_claim=claim_of(members[recover_src]) if recover_src is not None else None,
        untrusted_ids=tuple(members[i].replica_id for i in servers if i not in trusted),
        contested=contested,
        num_healers=len(healers),
        deferred=len(healing) < len(healers),
    )


def claims_wanted(quorum: Quorum, *, init_sync: bool = True) -> bool:
    """Whether every member must ask again with its heal claim: someone heals in this quorum (a
    member behind the highest step, or the start's primary copy) and the members that serve claim
    on demand (an empty claim: they serve their live state, which they hold still meanwhile). Pure:
    all members decide the same from the same quorum."""
    members = quorum.participants
    serving = [m for m in members if staged(m)]
    if len(members) < 2 or not serving or not all(m.data.get(CLAIM_KEY) == [] for m in serving):
        return False
    max_step = max(m.step for m in members)
    return (init_sync and max_step == 0) or any(m.step < max_step for m in members)


def snapshot_due(step: int, last: StepPlan | None) -> bool:
    """Whether a group at ``step`` snapshots its committed state before its next quorum, given the
    plan of the step it took last (None: none yet): when a heal is due -- the last step left a group
    behind (it waited, or the step and its heal did not commit; round robin may pick any source
    next). Not at a process's first step: most first steps are a restarted group's or a hot spare's,
    which serve nobody; at the job's start the others wait one step for the primary's snapshot. A
    group behind itself serves nobody. Pure: every rank of a group decides the same, so all of them
    snapshot, or none."""
    if last is None or behind_after(step, last):
        return False
    return last.num_healers > 0 and (last.deferred or step == last.max_step)


def may_heal(step: int, last: StepPlan | None) -> bool:
    """Whether a group at ``step`` may heal in its next quorum, given the plan of the step it took
    last (None: its first): it was behind, or it has just started. Such a group waits for its quorum
    (and heal) before its forward pass, so that the step runs on the healed state, and says so
    (`HEAL_READY_KEY`). Pure, like `snapshot_due`."""
    return last is None or behind_after(step, last)


def behind_after(step: int, last: StepPlan) -> bool:
    """Whether a group now at ``step`` is still behind after the step it planned as ``last``: it was
    behind there (a healer -- at the start, every group but the primary) and did not catch up (it
    waited, or its heal did not commit)."""
    return step < last.max_step or (last.source_rank is None and step <= last.max_step)


def staged(m: QuorumMember) -> bool:
    """Whether the member holds a snapshot of its committed state to serve (`STAGED_KEY`)."""
    return m.data.get(STAGED_KEY) is True


def claim_of(m: QuorumMember) -> tuple[str, ...] | None:
    """A member's heal claim, or None when it makes none (or one that is not a list of checksums)."""
    c = m.data.get(CLAIM_KEY)
    if not isinstance(c, list) or not 0 < len(c) <= _MAX_CLAIM_RANKS:
        return None
    if not all(isinstance(s, str) and 0 < len(s) <= _MAX_CLAIM_LEN for s in c):
        return None
    return tuple(c)


def _trusted_sources(members: list[QuorumMember], sources: list[int]) -> tuple[list[int], bool]:
    """The sources whose claim is the most common one among ``sources``, and whether the most
    common claims tie (then every source that claims is trusted: no majority can tell). While any
    source claims, a source that makes no claim is not trusted (a group cannot escape the rule by
    staying silent); when none claims, all are trusted, as before claims existed."""
    claims = [claim_of(members[i]) for i in sources]
    ranked = Counter(c for c in claims if c is not None).most_common()
    if not ranked:
        return sources, False
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return [i for i, c in zip(sources, claims, strict=True) if c is not None], True
    top = ranked[0][0]
    return [i for i, c in zip(sources, claims, strict=True) if c == top], False


def _layout(m: QuorumMember) -> dict[str, Any] | None:
    lay = m.data.get(LAYOUT_KEY)
    return lay if isinstance(lay, dict) and isinstance(lay.get("digest"), str) else None


def _layout_conflict(me: QuorumMember, sources: list[QuorumMember]) -> str | None:
    """A message when a source lays out its state differently from ``me`` (groups that publish no
    layout are not compared). A healing group that differs refuses alone; sources that differ
    from each other all refuse: there is no telling which one is right."""
    mine = _layout(me)
    if mine is None:
        return None
    differ = [
        (s, lay) for s in sources if (lay := _layout(s)) is not None and lay["digest"] != mine["digest"]
    ]
    if not differ:
        return None
    other, theirs = differ[0]
    return (
        f"replica group {me.replica_id} lays out its state differently from {other.replica_id}: "
        f"here {mine.get('text') or mine['digest']}; there {theirs.get('text') or theirs['digest']}. "
        "Refusing to take part: gradient shards and healed state would land in the wrong places. "
        "Every replica group must shard the same way (same workers per group, same sharding)."
    )

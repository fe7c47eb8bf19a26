"""Durable checkpoints, the decisions: pure functions of steps, names and counts.

Why pure: every replica group decides on its own, from the same committed quorum, whether a save is
due and whether it is the one that writes it -- no message, no lock, no leader. A rule that depends
only on the step, the checkpoint interval and the committed quorum's participants gives every group
the same answer. The I/O (`ftlaunch.checkpointing.durable`) and the Manager hook
(`ftlaunch.worker.durable`) act on these answers.

The directory layout these names describe::

    DIR/step-00000100/        a complete checkpoint: DCP's files, ``.metadata``, then the manifest
    DIR/step-00000200.tmp/    a save in progress (or one whose writer died): never read
    DIR/group-1/step-00000100/   what replica group 1 holds on its own at that step (LocalSGD and
                                 DiLoCo: its model and inner optimizer), written by that group
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Listing",
    "ResumeChoice",
    "choose_resume",
    "dir_name",
    "group_dir_name",
    "own_keys",
    "is_writer",
    "list_dir",
    "parse_name",
    "resume_from_disk",
    "save_due",
    "stale",
    "to_delete",
    "writer_index",
]

#: Suffix of a checkpoint being written; renamed away atomically when it is complete.
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"^step-(\d{8,})(\.tmp)?$")


def dir_name(step: int, tmp: bool = False) -> str:
    """``step-00000100`` (``.tmp`` while it is written): names sort in step order."""
    if step < 0:
        raise ValueError(f"a checkpoint step is >= 0, got {step}")
    return f"step-{step:08d}" + (TMP_SUFFIX if tmp else "")


def group_dir_name(group_id: int) -> str:
    """``group-1``: the directory, beside the job's checkpoints, of what replica group 1 saves on
    its own (`own_keys`). Not a checkpoint's name, so listings and retention of the job's
    checkpoints pass it over."""
    if group_id < 0:
        raise ValueError(f"a replica group id is >= 0, got {group_id}")
    return f"group-{group_id}"


def own_keys(keys: Iterable[str], shared: Iterable[str], positions: Iterable[str]) -> list[str]:
    """The registered state a replica group saves on its own when its algorithm syncs every so many
    steps (LocalSGD, DiLoCo): everything but the algorithm's ``shared`` entries (every group holds
    them bit-identical after a sync; the Manager's step among them) and the data ``positions`` (the
    job's checkpoint has them, and re-shards them for another number of groups).

    Why: such groups legitimately differ in the rest -- each trains its inner optimizer (Adam's
    moments, momentum) on its own data -- and a resumed run repeats the uninterrupted one only if
    every group gets back its own."""
    skip = {*shared, *positions}
    return sorted(k for k in keys if k not in skip)


def parse_name(name: str) -> tuple[int, bool] | None:
    """``(step, complete)`` for a checkpoint directory's name; None for anything else."""
    m = _NAME.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) is None


@dataclass(frozen=True)
class Listing:
    """What a checkpoint directory holds: complete checkpoints and saves in progress, by step."""

    complete: tuple[int, ...] = ()
    tmp: tuple[int, ...] = ()


def list_dir(names: Iterable[str]) -> Listing:
    """Sort a directory's entries into complete checkpoints and temporary ones (ascending steps)."""
    complete: set[int] = set()
    tmp: set[int] = set()
    for name in names:
        parsed = parse_name(name)
        if parsed is not None:
            (complete if parsed[1] else tmp).add(parsed[0])
    return Listing(tuple(sorted(complete)), tuple(sorted(tmp)))


def save_due(step: int, every: int, resumed_at: int | None = None) -> bool:
    """Whether the state committed at ``step`` is due for a durable checkpoint: every ``every``
    committed steps (0: never), not step 0 (the initial state is the script's to recreate) and not
    the step the job resumed from (it is on disk already)."""
    return every > 0 and step > 0 and step % every == 0 and step != resumed_at


def writer_index(step: int, every: int, num_participants: int) -> int:
    """Which participant (by its rank among the committed quorum's participants, which every group
    derives from the same quorum) writes the checkpoint of ``step``.

    Rotates with each due save: a writer that died mid-save is not in the next quorum, and the next
    due save falls to a live group either way; a writer that is slow (its disk) does not get every
    save."""
    if num_participants < 1:
        raise ValueError(f"num_participants must be >= 1, got {num_participants}")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return (step // every) % num_participants


def is_writer(step: int, every: int, participant_rank: int | None, num_participants: int) -> bool:
    """Whether the group with ``participant_rank`` (None: it healed or stood by in that quorum, so
    it contributes nothing and writes nothing) writes the checkpoint of ``step``."""
    if participant_rank is None or num_participants < 1:
        return False
    return participant_rank == writer_index(step, every, num_participants)


def to_delete(complete: Sequence[int], keep_last: int) -> list[int]:
    """The complete checkpoints retention removes: all but the newest ``keep_last`` (0: keep all)."""
    if keep_last <= 0:
        return []
    ordered = sorted(complete)
    return ordered[: max(0, len(ordered) - keep_last)]


def stale(tmp: Sequence[int], published: int) -> list[int]:
    """Temporary checkpoints a writer that has just published ``published`` removes: the older
    ones, left by a writer that died or that a newer save overtook (never a newer one: a later
    save may be in progress in another group)."""
    return [s for s in tmp if s < published]


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint to resume from (None: none usable) and each newer one refused, with why."""

    step: int | None
    refused: tuple[tuple[int, str], ...] = ()


def choose_resume(complete: Sequence[int], verify: Callable[[int], str | None]) -> ResumeChoice:
    """The newest complete checkpoint that verifies: ``verify(step)`` returns None when it is
    intact, else why not. Newer damaged ones are skipped, with their reasons."""
    refused: list[tuple[int, str]] = []
    for step in sorted(complete, reverse=True):
        why = verify(step)
        if why is None:
            return ResumeChoice(step, tuple(refused))
        refused.append((step, why))
    return ResumeChoice(None, tuple(refused))


def resume_from_disk(
    checkpoint_step: int | None, live_peer_steps: Iterable[int], reached: int | None = None
) -> bool:
    """Whether a group that (re)starts while the job runs -- its agent restarted it, or a hot spare
    took a failed group's slot -- loads the newest usable checkpoint (of ``checkpoint_step``, None:
    none) rather than healing from a live peer (``live_peer_steps``: the steps of the other groups
    the lighthouse sees live; ``reached``: the step of the job's last quorum, None: none formed).

    Why: live recovery is the fast path and never reads the disk, so a peer that holds the
    checkpoint's state or a newer one is healed from: one past the checkpoint, or one at it that
    the job's last quorum had reached (a survivor). Only when no live group holds it -- every
    group died, or the only one holding it died mid-heal -- is the disk the way back; without it
    the job would restart from step 0. A peer at the checkpoint's step below the step the job had
    reached is a group back from the same loss that loaded the same checkpoint: this group loads
    it too, so both are up to date in the job's first quorum after the loss and both train its
    first step, as the run it repeats did (healing from that peer would cost that step: a healer
    waits one step for a snapshot and contributes nothing to it). Groups restarting together so
    all load the same checkpoint; a group that loads while a peer turns out to be ahead still
    heals from it at its first quorum (loading is never wrong, only slower)."""
    if checkpoint_step is None:
        return False
    return not any(
        step > checkpoint_step or (step == checkpoint_step and (reached is None or step >= reached))
        for step in live_peer_steps
    )

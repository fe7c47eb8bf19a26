"""The exactly-once sampler's bookkeeping as pure functions: which samples the job has still to train,
where each worker's draws for a step come from, and what a committed step takes out.

**Positions.** The job's samples form one stream: position ``p`` is element ``p % L`` of epoch
``p // L``'s order (its permutation), ``L`` the dataset's length. A `Pool` is the set of positions
not trained yet: a cursor (everything from it on) and the *holes* below it, positions that a step
drew but did not train (it did not commit, or the group that drew them was not among the step's
participants). Every group holds the same pool after every committed step: it is replicated state,
and a restarted group heals it from a peer with the weights.

**Layout.** A worker's draws for a step must be placed *before* the step's quorum is known: the
DataLoader fetches the batch before ``optimizer.zero_grad()`` starts the step. So a draw's place
cannot depend on who takes part; it depends only on what the worker knows of itself, its
*worker slot* ``q = replica_group * W + rank`` (``W`` workers per group), and on the pool. Once the
number ``m`` of samples a worker draws per step is known, worker slot ``q`` takes the pool's
elements ``q*m .. q*m + m - 1``: the groups, in replica-group order, take consecutive slices of
what is left, each split over its workers. A slot whose group is down (or not up to date) draws
nothing that counts, so its slice stays in the pool and the next step's slices start with it: the
live groups fill it in. Before ``m`` is known (a job's first step) a worker cannot size a slice;
then the pool is dealt in rows, one sample to each worker of each group the job was started with:
exact for any set of participants, only ordered less tidily (the rows of the groups that did not
take part stay in the pool).

**Commit.** After a committed step every group takes out the slices of exactly the step's
participants (the quorum says who they were; a group that healed or stood by as a spare drew for
nothing), assuming every participant drew as many samples as this worker did. A step that did not
commit takes out nothing: its samples are drawn again. Groups never place two draws on one position:
slots are distinct (one holder per replica group at a time), so slices are disjoint.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

Range = tuple[int, int]


def merge(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, disjoint, non-empty ranges covering the same positions (touching ones joined)."""
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


@dataclass(frozen=True)
class Pool:
    """The untrained positions: ``holes`` (sorted, disjoint, separated, below ``cursor``) and every
    position from ``cursor`` on."""

    cursor: int = 0
    holes: tuple[Range, ...] = ()
    #: Pool index at which each hole starts (cumulative sizes), for `position`.
    _starts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cursor < 0:
            raise ValueError(f"pool cursor must be >= 0, got {self.cursor}")
        prev = -1
        starts = []
        total = 0
        for lo, hi in self.holes:
            if not prev < lo < hi:
                raise ValueError(f"pool holes must be sorted, separated and non-empty: {self.holes}")
            starts.append(total)
            total += hi - lo
            prev = hi
        if self.holes and self.holes[-1][1] >= self.cursor:
            raise ValueError(f"pool holes must end below the cursor {self.cursor}: {self.holes}")
        object.__setattr__(self, "_starts", tuple(starts))

    @classmethod
    def of(cls, untrained_below: Iterable[Range], cursor: int) -> Pool:
        """The pool of ``untrained_below`` (any ranges below ``cursor``) and everything from ``cursor``."""
        holes = merge((lo, min(hi, cursor)) for lo, hi in untrained_below)
        while holes and holes[-1][1] >= cursor:  # a hole that reaches the cursor is part of it
            cursor = holes.pop()[0]
        return cls(cursor, tuple(holes))

    @property
    def below_cursor(self) -> int:
        """Untrained positions below the cursor (the holes' total size)."""
        if not self.holes:
            return 0
        lo, hi = self.holes[-1]
        return self._starts[-1] + hi - lo

    def first(self) -> int:
        """The smallest untrained position."""
        return self.holes[0][0] if self.holes else self.cursor

    def position(self, index: int) -> int:
        """The ``index``-th untrained position (0-based, in order)."""
        if index < 0:
            raise ValueError(f"pool index must be >= 0, got {index}")
        below = self.below_cursor
        if index >= below:
            return self.cursor + index - below
        k = bisect.bisect_right(self._starts, index) - 1
        return self.holes[k][0] + index - self._starts[k]

    def positions(self, indices: Iterable[Range]) -> list[Range]:
        """The positions at the pool indices ``indices`` (ranges of indices), as position ranges."""
        out: list[Range] = []
        below = self.below_cursor
        for lo, hi in merge(indices):
            i = lo
            while i < hi:
                if i >= below:
                    out.append((self.cursor + i - below, self.cursor + hi - below))
                    break
                k = bisect.bisect_right(self._starts, i) - 1
                start, (a, b) = self._starts[k], self.holes[k]
                take = min(hi, start + b - a)
                out.append((a + i - start, a + take - start))
                i = take
        return merge(out)

    def untrained_in(self, lo: int, hi: int) -> int:
        """How many positions of ``[lo, hi)`` are untrained."""
        n = max(0, hi - max(lo, self.cursor))
        for a, b in self.holes:
            n += max(0, min(b, hi) - max(a, lo))
        return n

    def remove(self, trained: Iterable[Range]) -> Pool:
        """The pool without the positions ``trained`` (which must all be untrained: a position is
        trained once)."""
        taken = merge(trained)
        if not taken:
            return self
        cursor = max(self.cursor, taken[-1][1])
        untrained = [*self.holes, (self.cursor, cursor)]
        left: list[Range] = []
        t = 0
        for lo, hi in untrained:
            cur = lo
            while t < len(taken) and taken[t][1] <= cur:
                t += 1
            k = t
            while k < len(taken) and taken[k][0] < hi:
                a, b = taken[k]
                if a > cur:
                    left.append((cur, a))
                cur = max(cur, b)
                k += 1
            if cur < hi:
                left.append((cur, hi))
        removed = sum(hi - lo for lo, hi in untrained) - sum(hi - lo for lo, hi in left)
        if removed != sum(hi - lo for lo, hi in taken):
            raise ValueError(f"removing positions that were already trained: {taken} from {self}")
        return Pool.of(left, cursor)

    def skip_to(self, position: int) -> Pool:
        """The pool without any position below ``position`` (a deliberate skip)."""
        if position <= self.first():
            return self
        return Pool.of(((max(lo, position), hi) for lo, hi in self.holes), max(self.cursor, position))


def frontier(pool: Pool, length: int) -> tuple[int, int]:
    """``(epoch, trained)``: the earliest epoch with untrained samples and how many of its samples
    are trained."""
    epoch = pool.first() // length
    return epoch, length - pool.untrained_in(epoch * length, (epoch + 1) * length)


@dataclass(frozen=True)
class Layout:
    """Where worker ``(group, rank)``'s ``j``-th draw of a step comes from (a pool index).

    ``per_step``: the samples every worker draws per step, None until known. Known, worker slot
    ``q = group * workers + rank`` takes the pool's ``[q * per_step, (q + 1) * per_step)``. Unknown
    (a job's first step), the pool is dealt in rows of one sample per worker of each of the
    ``groups`` the job was started with: draw ``j`` is ``(j * groups + group) * workers + rank``.
    Any number of draws fits, and the groups never meet as long as each participant's group is
    below ``groups`` (checked by `commit`).
    """

    workers: int
    per_step: int | None
    groups: int

    def __post_init__(self) -> None:
        if self.workers < 1 or self.groups < 1 or (self.per_step is not None and self.per_step < 1):
            raise ValueError(f"invalid layout {self}")

    def index(self, group: int, rank: int, j: int) -> int:
        if j < 0 or (self.per_step is not None and j >= self.per_step):
            raise ValueError(f"draw {j} of a step is outside 0..{self.per_step}")
        if self.per_step is not None:
            return (group * self.workers + rank) * self.per_step + j
        return (j * self.groups + group) * self.workers + rank

    def slice(self, group: int, rank: int) -> Range | None:
        """Worker ``(group, rank)``'s pool indices for a step (None: not a slice, see `index`)."""
        if self.per_step is None:
            return None
        start = (group * self.workers + rank) * self.per_step
        return start, start + self.per_step

    def consumed(self, groups: Iterable[int], drawn: int) -> list[Range]:
        """The pool indices the workers of ``groups`` drew when each drew ``drawn`` samples."""
        if drawn < 0 or (self.per_step is not None and drawn > self.per_step):
            raise ValueError(f"{drawn} draws in a step, outside 0..{self.per_step}")
        w = self.workers
        out: list[Range] = []
        for g in groups:
            if self.per_step is None:
                out.extend(((j * self.groups + g) * w, (j * self.groups + g + 1) * w) for j in range(drawn))
            elif drawn == self.per_step:
                out.append((g * w * drawn, (g + 1) * w * drawn))
            else:
                out.extend(
                    ((g * w + r) * self.per_step, (g * w + r) * self.per_step + drawn) for r in range(w)
                )
        return merge(out)


@dataclass(frozen=True)
class Cursor:
    """The replicated position of the job's data: the pool, the Manager step it reflects, and the
    samples every worker draws per step (None until a step with draws committed)."""

    pool: Pool = Pool()
    step: int = 0
    per_step: int | None = None


class LayoutError(ValueError):
    """The participants of a step drew overlapping samples (see `commit`)."""


def commit(cursor: Cursor, layout: Layout, participants: Sequence[int], drawn: int) -> Cursor:
    """The cursor after the step at ``cursor.step`` committed: the slices of the participating
    replica groups (each of whose workers drew ``drawn`` samples, placed by ``layout``) are trained.

    `LayoutError` when their draws overlapped, which only a misconfigured job can cause: two
    participants claiming one replica group, or, in a job's first step, several participants of
    which one's group is past the group count the job was started with."""
    if len(set(participants)) != len(participants):
        raise LayoutError(f"two participants of one step hold the same replica group: {sorted(participants)}")
    if layout.per_step is None and drawn and len(participants) > 1 and max(participants) >= layout.groups:
        raise LayoutError(
            f"replica group {max(participants)} took part in the job's first step with others, but the job "
            f"was started with {layout.groups} groups: their first draws overlapped"
        )
    if drawn == 0 or not participants:
        return replace(cursor, step=cursor.step + 1)
    trained = cursor.pool.positions(layout.consumed(participants, drawn))
    return Cursor(
        cursor.pool.remove(trained),
        cursor.step + 1,
        cursor.per_step if cursor.per_step is not None else drawn,
    )

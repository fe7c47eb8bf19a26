"""`ExactlyOnceSampler`: every sample of every epoch trained exactly once by the job, whatever fails.

Why not fixed shards: with a shard per replica group, the samples of a group that is down are
skipped while it is down (its peers do not read its shard, and the group heals to their position),
and a job cannot grow past the group count it started with (a shard belongs to a group). Here no
sample belongs to a group: the job keeps one *pool* of untrained samples, the same in every group
(replicated like the weights; a restarted group heals it from a peer), and at each committed step
the groups that took part in it take consecutive slices of it. A group that is down takes nothing;
a step that does not commit takes nothing: its samples are drawn again. `worker/sample_pool.py`
holds the rules as pure functions; this module applies them to a running DataLoader.

The catch is timing: a DataLoader fetches a step's batch *before* ``optimizer.zero_grad()`` starts
the step and asks for its quorum, so a worker cannot know who will take part when it draws. It does
not need to: its slice is placed by its own replica-group number and rank, the one thing no other
live worker shares, and the step's commit then takes out the slices of exactly the groups that
took part. The worker learns that after the fact, at its next draw (or when the position is read):
the Manager's step moved on, and its latest plan names the participants (`Manager.latest_plan`).

So the sampler needs the two-line form's loop shape: **every batch of a step is drawn before the
step begins** (``for x, y in loader: optimizer.zero_grad(); ...``), every worker draws the same
number of samples per step, and the DataLoader draws when the loop asks (``num_workers=0``; worker
processes draw batches ahead of the steps that train them, which it cannot follow). Loops it can
tell apart from that shape get a `ConfigurationError` naming the fix; docs/data.md has the rest.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from torch.utils.data import Sampler

from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.slots import slot_of
from ftlaunch.worker import sample_pool
from ftlaunch.worker.plan import StepPlan
from ftlaunch.worker.sample_pool import Cursor, Layout, Pool
from ftlaunch.worker.sampler_args import (
    LAUNCH_HINT_RANKS,
    as_bool,
    as_int,
    as_seed,
    check_epoch,
    dataset_length,
    epoch_order,
    resolve_pair,
)

logger = logging.getLogger(__name__)

#: Version of the ``state_dict`` format. Version 1 is `DistributedSampler`'s (fixed shards), which
#: `ExactlyOnceSampler.load_state_dict` also reads.
STATE_DICT_VERSION = 2

#: Keys of ``ExactlyOnceSampler.state_dict()``: plain ints, and ``holes``, a list of ``[start, end)``
#: position pairs.
STATE_DICT_KEYS = (
    "version",
    "epoch",
    "position",
    "cursor",
    "holes",
    "step",
    "per_step",
    "dataset_len",
    "seed",
    "shuffle",
    "workers",
)
_V1_KEYS = ("version", "epoch", "position", "dataset_len", "num_shards", "seed", "shuffle", "drop_last")

#: Epoch orders kept: a step's slices may reach into the next epoch, and a slice nobody trained
#: (its group was down) may lie in the one before.
_ORDERS_KEPT = 3

_LOOP_SHAPE = (
    "draw every batch of a step before the step begins (`for x, y in loader: optimizer.zero_grad(); "
    "...`), the same number of samples on every worker, from a DataLoader with num_workers=0 "
    "(docs/data.md); or use ft.sampler(dataset, mode='shard'), the fixed shards"
)


class StepSource(Protocol):
    """What the sampler reads from the Manager (``ftlaunch.Manager`` has it)."""

    replica_id: str

    def current_step(self) -> int: ...

    def latest_plan(self) -> tuple[int, StepPlan | None]: ...

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...


class ExactlyOnceSampler(Sampler[int]):
    """Draws the samples of a job's epochs so that every sample is trained exactly once per epoch.

    Args:
        dataset: a sized dataset (``len(dataset)`` is read once, here).
        manager: this worker's `ftlaunch.Manager`. Its replica id names the worker's replica group
            (``rg3``, or ``rg3.1`` for a spare that took over group 3: both are group 3).
        rank, num_replicas: this worker's rank inside its replica group and the group's worker
            count (default: ``RANK``/``WORLD_SIZE``, else 0 of 1). Every group must have as many.
        shuffle, seed: each epoch's order is a permutation seeded with ``seed + epoch`` (the same
            as `DistributedSampler`'s), or ``0..len-1``.
        drop_last: accepted for `DistributedSampler`'s callers; it changes nothing (no batch is ever
            short: a step's slices reach into the next epoch rather than pad or drop).
        num_replica_groups: the group count the job was started with (default:
            ``NUM_REPLICA_GROUPS``). Only the job's very first step uses it, to deal out samples
            before the samples per step are known; the job may grow past it later.

    The sampler yields dataset indices, one per draw, and keeps one position for the whole job:
    ``epoch`` (the earliest epoch with untrained samples) and ``position`` (how many of its
    samples are trained). An iterator (one pass of ``for batch in loader``) ends once every sample
    of its epoch is trained, at a step boundary, in every group at the same step.
    """

    def __init__(
        self,
        dataset: Any,
        manager: StepSource,
        *,
        rank: int | None = None,
        num_replicas: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replica_groups: int | None = None,
    ) -> None:
        self.dataset_len = dataset_length(dataset, "ExactlyOnceSampler")
        if self.dataset_len == 0:
            raise ValueError("ExactlyOnceSampler needs a dataset with at least one sample")
        self.rank, self.num_replicas = resolve_pair(
            rank,
            num_replicas,
            ("rank", "num_replicas"),
            (env.RANK, env.WORLD_SIZE),
            LAUNCH_HINT_RANKS,
            "ExactlyOnceSampler cannot tell its worker's place in the group",
            default=(0, 1),
        )
        group = slot_of(manager.replica_id)
        if group is None:
            raise ConfigurationError(
                f"ExactlyOnceSampler places a group's samples by its replica-group number, read from its "
                f"replica id; {manager.replica_id!r} ends in none: name the groups ...<N> (ftlaunch names "
                "them rg<N>), or use the fixed shards (DistributedSampler, ft.sampler(dataset, mode='shard'))"
            )
        #: This worker's replica group (its slot: a spare that took group 3 over is group 3).
        self.replica_group = group
        self.shuffle = as_bool(shuffle, "shuffle")
        self.drop_last = as_bool(drop_last, "drop_last")
        self.seed = as_seed(seed)
        if num_replica_groups is None:
            num_replica_groups = env.count(env.NUM_REPLICA_GROUPS)
        groups = as_int(num_replica_groups, "num_replica_groups") if num_replica_groups is not None else 0
        self._groups_started = max(groups, 1)

        self.dataset = dataset
        self._manager = manager
        # `_lock` makes the position's reads and moves atomic: the Manager reads state_dict() on
        # its quorum thread while the training thread may be drawing.
        self._lock = threading.Lock()
        self._cursor = Cursor(step=manager.current_step())
        self._layout_cache: tuple[int | None, Layout] | None = None
        self._slice: list[tuple[int, int]] | None = None  # this worker's draws of a step, once read
        self._slice_of: Cursor | None = None
        self._orders: dict[int, Sequence[int]] = {}
        # The draws of the step being drawn for (the *window*): opened by the first draw after a
        # step began (`latest_plan`'s attempt moved on), counted until the step's commit is applied.
        self._window: int | None = None
        self._k = 0
        self._drawn: list[tuple[int, int]] = []
        self._participants_seen = self._groups_started
        self._warned_short = False
        # The running iterator (only the newest may draw) and the epoch it is in (None: not yet
        # known; a load or a set_epoch moves it, so the running iterator follows).
        self._owner: object | None = None
        self._iter_epoch: int | None = None

    # ------------------------------------------------------------------------------ position
    @property
    def epoch(self) -> int:
        """The earliest epoch with untrained samples (after a heal: the peers')."""
        with self._lock:
            self._settle()
            return sample_pool.frontier(self._cursor.pool, self.dataset_len)[0]

    @property
    def position(self) -> int:
        """How many samples of `epoch` the job has trained (0..``len(dataset)-1``)."""
        with self._lock:
            self._settle()
            return sample_pool.frontier(self._cursor.pool, self.dataset_len)[1]

    def __len__(self) -> int:
        """An estimate of the indices this worker draws per epoch: the dataset over the workers of
        the groups that took part in the latest step (membership decides the real number)."""
        return math.ceil(self.dataset_len / (self._participants_seen * self.num_replicas))

    def drawn(self) -> list[tuple[int, int]]:
        """``(epoch, index)`` of every sample this worker drew for the current step, in order: what
        a committed step in which this group took part trained here (for logs and audits)."""
        with self._lock:
            return list(self._drawn)

    def _layout(self) -> Layout:
        per_step = self._cursor.per_step
        if self._layout_cache is None or self._layout_cache[0] != per_step:
            self._layout_cache = (per_step, Layout(self.num_replicas, per_step, self._groups_started))
        return self._layout_cache[1]

    def _prepare(self) -> None:
        """Read this worker's slice of the step from the epoch orders (under the lock): once per
        step, and again when the cursor moved meanwhile (a heal, `set_epoch`)."""
        layout = self._layout()
        bounds = layout.slice(self.replica_group, self.rank)
        self._slice = None if bounds is None else self._entries(self._cursor.pool.positions([bounds]))
        self._slice_of = self._cursor

    def _entry(self, j: int) -> tuple[int, int]:
        """``(epoch, index)`` of this worker's draw ``j`` of the step (under the lock)."""
        if self._slice is not None:
            if j >= len(self._slice):
                raise ConfigurationError(
                    f"ExactlyOnceSampler: drew sample {j + 1} for one step, more than the {len(self._slice)} "
                    f"of each step before: {_LOOP_SHAPE}"
                )
            return self._slice[j]
        layout = self._layout()
        p = self._cursor.pool.position(layout.index(self.replica_group, self.rank, j))
        return p // self.dataset_len, self._order(p // self.dataset_len)[p % self.dataset_len]

    def _entries(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        length = self.dataset_len
        out: list[tuple[int, int]] = []
        for lo, hi in ranges:
            while lo < hi:
                epoch = lo // length
                end = min(hi, (epoch + 1) * length)
                out.extend((epoch, i) for i in self._order(epoch)[lo - epoch * length : end - epoch * length])
                lo = end
        return out

    def _order(self, epoch: int) -> Sequence[int]:
        order = self._orders.get(epoch)
        if order is None:
            if not self.shuffle:
                order = range(self.dataset_len)
            else:
                order = epoch_order(self.dataset_len, True, self.seed, check_epoch(epoch, self.seed)).tolist()
            while len(self._orders) >= _ORDERS_KEPT:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order

    # ------------------------------------------------------------------------------ commits
    def _settle(self) -> None:
        """Apply the steps the Manager committed since the cursor's step (under the lock).

        A commit trains the slices of the step's participants, each as large as this worker's
        draws for it (every worker draws alike); the draws are then spent."""
        step = self._manager.current_step()
        cur = self._cursor
        if step == cur.step:
            return
        if step < cur.step or self._k == 0:
            # Back: the Manager loaded an older step (a checkpoint, DiLoCo's lost lineage); or no
            # draws since: nothing trained. Either way only the step moves.
            self._cursor = replace(cur, step=step)
            return
        attempt, plan = self._manager.latest_plan()
        if (
            step != cur.step + 1
            or plan is None
            or plan.max_step != cur.step
            or self._window is None
            or self._window >= attempt
        ):
            raise ConfigurationError(
                f"ExactlyOnceSampler: step {step} committed on samples drawn after a step began, or "
                f"several steps on one draw, so it cannot tell which samples were trained: {_LOOP_SHAPE}"
            )
        if plan.num_participants and not plan.participant_ids:
            raise ConfigurationError(
                "ExactlyOnceSampler: the Manager's plan does not name the step's participants"
            )
        groups = []
        for replica_id in plan.participant_ids:
            g = slot_of(replica_id)
            if g is None:
                raise ConfigurationError(
                    f"ExactlyOnceSampler: participant {replica_id!r} has no replica-group number in its id"
                )
            groups.append(g)
        # A participant cannot have drawn more than `per_step` (it would have been refused); a
        # healer can, drawing with its own stale position (a prefetching DataLoader's first batches).
        drawn = self._k if cur.per_step is None else min(self._k, cur.per_step)
        took_part = self._manager.replica_id in plan.participant_ids
        if cur.per_step is not None and not took_part:
            # The slices are the participants' draws, `per_step` each (the healed cursor's). What
            # this worker drew says nothing of them: a healer drew with its stale position, and
            # when a step is a LocalSGD/DiLoCo sync (many batches) a group that joins inside its
            # first training step has drawn one batch of them before its heal.
            drawn = cur.per_step
        elif cur.per_step is not None and drawn < cur.per_step and not self._warned_short:
            self._warned_short = True
            logger.warning(
                "[%s/r%d step %d] ExactlyOnceSampler: drew %d samples for this step, fewer than the "
                "%d of the "
                "job's first: if this is a DataLoader with worker processes, it draws batches ahead "
                "of the steps "
                "that train them and samples are trained twice or not at all wherever the groups change: %s",
                self._manager.replica_id, self.rank, cur.step, drawn, cur.per_step, _LOOP_SHAPE,
            )  # fmt: skip
        try:
            self._cursor = sample_pool.commit(cur, self._layout(), groups, drawn)
        except sample_pool.LayoutError as e:
            raise ConfigurationError(
                f"ExactlyOnceSampler: {e}; pass num_replica_groups= (or set it)"
            ) from None
        self._k = 0
        if groups:
            self._participants_seen = len(groups)

    def _observe(self) -> None:
        """Open a new window when a step began since the last draw: settle the one before."""
        attempt, _ = self._manager.latest_plan()
        if attempt != self._window:
            self._settle()
            self._window = attempt
            self._k = 0
            self._drawn = []

    # ------------------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[int]:
        """Start drawing this step's samples (again: what an earlier iterator drew for a step that
        has not begun is not trained, so the same samples come again)."""
        token = object()
        with self._lock:
            self._settle()
            self._owner = token
            self._k = 0
            self._drawn = []
            self._iter_epoch = None
        return self._follow(token)

    def _follow(self, token: object) -> Iterator[int]:
        manager = self._manager
        while True:
            with self._lock:
                if self._owner is not token:
                    raise RuntimeError(
                        "this sampler iterator was superseded by a newer iter(sampler): a sampler has "
                        "one position, so only the most recent iterator may draw from it"
                    )
                if manager.latest_plan()[0] != self._window:
                    self._observe()
                j = self._k
                if j == 0:  # the step's first draw: is the iterator's epoch over?
                    epoch = self._cursor.pool.first() // self.dataset_len
                    if self._iter_epoch is None:
                        self._iter_epoch = epoch
                    elif epoch > self._iter_epoch:
                        return  # every sample of the iterator's epoch is trained
                if j == 0 or self._slice_of is not self._cursor:
                    self._prepare()
                entry = self._entry(j)
                self._k = j + 1
                self._drawn.append(entry)
            yield entry[1]

    def set_epoch(self, epoch: int) -> None:
        """Skip to ``epoch``: its samples come next, those of earlier epochs not yet trained are
        dropped. Setting the current epoch, or an earlier (complete) one, changes nothing, so
        ``for e in range(n): sampler.set_epoch(e)`` loops keep working (a backward move is logged:
        after a heal it means the loop counts epochs itself; iterate `epochs` instead). Every
        group must call it at the same step, as they do when it is in the same place in the loop."""
        with self._lock:
            self._settle()
            e = check_epoch(epoch, self.seed)
            current = self._cursor.pool.first() // self.dataset_len
            if e == current:
                return
            if e < current:
                logger.warning(
                    "set_epoch(%d) ignored: every sample of epoch %d is trained, the sampler is at "
                    "epoch %d (a "
                    "heal loaded it, or the loop counts epochs itself); iterate `for epoch in "
                    "sampler.epochs(n)`",
                    e, e, current,
                )  # fmt: skip
                return
            logger.info("set_epoch(%d): skipping the untrained samples of epochs %d..%d", e, current, e - 1)
            self._cursor = replace(self._cursor, pool=self._cursor.pool.skip_to(e * self.dataset_len))
            self._iter_epoch = e

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Loop over epochs ``sampler.epoch .. num_epochs - 1``::

            for epoch in sampler.epochs(num_epochs):
                for batch in loader:
                    ...

        An epoch ends when all its samples are trained (the loader's pass ends by itself); a body
        that leaves its epoch early skips the rest of it. The epoch comes from the sampler, so a
        group that heals into a later epoch continues there with its peers."""
        n = as_int(num_epochs, "num_epochs")
        while True:
            current = self.epoch
            if current >= n:
                return
            yield current
            if self.epoch == current:
                self.set_epoch(current + 1)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The job's data position as a small JSON-able dict (see `STATE_DICT_KEYS`): ``epoch`` and
        ``position`` (its trained samples), ``cursor`` and ``holes`` (the untrained positions of
        the stream of epochs: every position from ``cursor`` on, and the ``[start, end)`` pairs
        below it), the Manager ``step`` it reflects, the samples each worker draws per step
        (``per_step``, 0 until known), and the dataset and order it was taken with."""
        with self._lock:
            self._settle()
            cur = self._cursor
        epoch, position = sample_pool.frontier(cur.pool, self.dataset_len)
        return {
            "version": STATE_DICT_VERSION,
            "epoch": epoch,
            "position": position,
            "cursor": cur.pool.cursor,
            "holes": [[lo, hi] for lo, hi in cur.pool.holes],
            "step": cur.step,
            "per_step": cur.per_step or 0,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "workers": self.num_replicas,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Move to a saved position -- a peer's (a heal) or a checkpoint's -- also redirecting an
        iterator that is running. Reads `DistributedSampler`'s format too (version 1: the trained
        part of its epoch is the first ``position * num_shards`` samples of the order). The state is
        checked first (format; same dataset length, seed, shuffle, and workers per group); on any
        error nothing changes."""
        cursor = self._parse(state_dict)
        with self._lock:
            old = sample_pool.frontier(self._cursor.pool, self.dataset_len)
            self._cursor = cursor
            self._iter_epoch = cursor.pool.first() // self.dataset_len
        epoch, position = sample_pool.frontier(cursor.pool, self.dataset_len)
        logger.info(
            "[%s/r%d] sampler: loaded epoch %d position %d at step %d (was epoch %d position %d)",
            self._manager.replica_id, self.rank, epoch, position, cursor.step, *old,
        )  # fmt: skip

    def _parse(self, state_dict: Mapping[str, Any]) -> Cursor:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"sampler state must be a dict, got {type(state_dict).__name__}")
        version = as_int(state_dict.get("version"), "sampler state['version']")
        keys = {STATE_DICT_VERSION: STATE_DICT_KEYS, 1: _V1_KEYS}.get(version)
        if keys is None:
            raise ValueError(f"sampler state has version {version}, this ftlaunch reads versions 1 and 2")
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"sampler state has no entries {missing} (expected keys {list(keys)})")
        sd = {k: as_int(state_dict[k], f"sampler state[{k!r}]") for k in keys if k != "holes"}
        expected = {"dataset_len": self.dataset_len, "seed": self.seed, "shuffle": int(self.shuffle)}
        if version == STATE_DICT_VERSION:
            expected["workers"] = self.num_replicas
        mismatched = [f"{k}: saved {sd[k]}, here {v}" for k, v in expected.items() if sd[k] != v]
        if mismatched:
            raise ConfigurationError(
                "sampler state was saved with a different dataset or layout (" + "; ".join(mismatched) + "): "
                "every replica group must build its sampler over the same dataset with the same seed and "
                "shuffle, and have as many workers"
            )
        length = self.dataset_len
        if version == 1:  # DistributedSampler: `position` indices handed out per shard, all shards alike
            epoch = check_epoch(sd["epoch"], self.seed)
            if not 0 <= sd["position"] or sd["num_shards"] < 1:
                raise ValueError(
                    f"sampler state position {sd['position']}/num_shards {sd['num_shards']} is invalid"
                )
            trained = min(sd["position"] * sd["num_shards"], length)
            return Cursor(Pool(epoch * length + trained), self._manager.current_step(), None)
        holes = state_dict["holes"]
        if not isinstance(holes, list) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 for h in holes
        ):
            raise ValueError(f"sampler state['holes'] must be a list of [start, end) pairs, got {holes!r}")
        pairs = tuple((as_int(a, "sampler hole start"), as_int(b, "sampler hole end")) for a, b in holes)
        pool = Pool(sd["cursor"], pairs)  # ValueError: unsorted, overlapping or misplaced holes
        check_epoch(pool.first() // length, self.seed)
        if sd["step"] < 0 or sd["per_step"] < 0:
            raise ValueError(f"sampler state step {sd['step']}/per_step {sd['per_step']} must be >= 0")
        return Cursor(pool, sd["step"], sd["per_step"] or None)

    def register(self, manager: StepSource, key: str = "sampler") -> None:
        """Make the position travel with live recovery: ``manager.register_state_dict_fn(key, ...)``.

        Every replica group must register under the same key (the healed state is looked up by key).
        """
        manager.register_state_dict_fn(key, self.load_state_dict, self.state_dict)

    def __repr__(self) -> str:
        epoch, position = sample_pool.frontier(self._cursor.pool, self.dataset_len)
        return (
            f"{type(self).__name__}(replica_group={self.replica_group}, "
            f"rank={self.rank}/{self.num_replicas}, "
            f"len(dataset)={self.dataset_len}, epoch={epoch}, position={position}, "
            f"per_step={self._cursor.per_step}, shuffle={self.shuffle}, seed={self.seed})"
        )

"""A `DistributedSampler` whose position survives a replica group's restart.

Why a sampler of our own: with per-step fault tolerance a replica group that dies is restarted and
*heals* from a healthy peer in the middle of an epoch. The model and optimizer come back through the
Manager's state transfer, but a stock sampler would restart the group's data at the beginning of
epoch 0, so the group would train on the same samples again and its epochs would drift out of phase
with its peers. This sampler

- shards the dataset over *replica groups x ranks* (every worker of every group owns one shard, all
  shards have the same length, so groups stepping in lockstep are always at the same position);
- exposes its position (``epoch``, indices yielded so far in the epoch) as a small ``state_dict``
  that the Manager ships with the rest of the healed state (``register(manager)``);
- applies a loaded position to the iterator that is *already running*: the heal is loaded inside
  ``optimizer.step()`` while the training loop's ``for batch in loader`` is suspended mid-epoch, and
  the very next index that loop draws is the one at the loaded position of this worker's shard.

Positions are exchanged between *different* groups: group 1 loads group 0's state. That is correct
because every shard has the same length and all groups draw the same number of indices per step, so
"position p of epoch e" means the same step everywhere; each group then reads its own shard there.

See docs/data.md for the DataLoader caveat (worker prefetching) and an example.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.worker.sampler_args import (
    LAUNCH_HINT_GROUPS,
    LAUNCH_HINT_RANKS,
    StateRegistrar,
    alias,
    as_bool,
    as_int,
    as_seed,
    check_epoch,
    dataset_length,
    epoch_order,
    resolve_pair,
)

logger = logging.getLogger(__name__)

#: Version of the ``state_dict`` format; bumped when its meaning changes.
STATE_DICT_VERSION = 1

#: Keys of ``DistributedSampler.state_dict()``; every value is a plain ``int``.
STATE_DICT_KEYS = (
    "version",
    "epoch",
    "position",
    "dataset_len",
    "num_shards",
    "seed",
    "shuffle",
    "drop_last",
)


class DistributedSampler(Sampler[int]):
    """Shards a map-style dataset over replica groups x ranks, with a position that survives heals.

    Args:
        dataset: a sized dataset (``len(dataset)`` is read once, here).
        replica_group_id: this worker's replica group (default: ``REPLICA_GROUP_ID``).
        num_replica_groups: number of replica groups the job was started with
            (default: ``NUM_REPLICA_GROUPS``). The sharding is static: a dead group's shard is not
            redistributed, so the groups' positions stay comparable.
        rank: this worker's rank *inside its replica group* (default: ``RANK``).
        num_replicas: number of workers in a replica group (default: ``WORLD_SIZE``). Note the
            name: unlike torch's sampler this is *not* the total number of shards, which is
            ``num_replica_groups * num_replicas``. If neither ``RANK`` nor ``WORLD_SIZE`` is set
            the group is taken to have a single worker (rank 0 of 1), as the Manager does.
        shuffle: permute the dataset each epoch (seeded by ``seed + epoch``, same on every shard).
        seed: base seed; must be the same on every worker of every group.
        drop_last: drop the tail so the dataset divides evenly over the shards, instead of padding.
        replica_rank, group_rank: torchft's names for ``replica_group_id`` and ``rank`` (keyword
            only; positionally the order is torchft's already: ``(dataset, replica_rank,
            num_replica_groups, group_rank, num_replicas)``).

    Sharding mirrors ``torch.utils.data.distributed.DistributedSampler`` with
    ``num_replicas=num_shards`` and ``rank=shard_index``, where
    ``shard_index = replica_group_id * num_replicas + rank``: the epoch's order (a permutation, or
    ``0..len-1``) is padded by repeating its head (``drop_last=False``) or cut (``drop_last=True``)
    to a multiple of the number of shards, and shard ``k`` takes elements ``k, k + S, k + 2S, ...``.

    Unlike torch's sampler this one has a single cursor ``(epoch, position)``: iterating advances
    it, ``set_epoch``/``load_state_dict`` move it and the running iterator follows. A new
    ``iter(sampler)`` starts the current epoch at 0 (as torch's does) unless ``load_state_dict``
    was called since the last iterator started, in which case it resumes at the loaded position.
    """

    def __init__(
        self,
        dataset: Any,
        replica_group_id: int | None = None,
        num_replica_groups: int | None = None,
        rank: int | None = None,
        num_replicas: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        replica_rank: int | None = None,
        group_rank: int | None = None,
    ) -> None:
        replica_group_id = alias(replica_group_id, replica_rank, "replica_group_id", "replica_rank")
        rank = alias(rank, group_rank, "rank", "group_rank")
        dataset_len = dataset_length(dataset, "DistributedSampler")
        who = "DistributedSampler cannot tell its shard"
        self.replica_group_id, self.num_replica_groups = resolve_pair(
            replica_group_id,
            num_replica_groups,
            ("replica_group_id", "num_replica_groups"),
            (env.REPLICA_GROUP_ID, env.NUM_REPLICA_GROUPS),
            LAUNCH_HINT_GROUPS,
            who,
        )
        self.rank, self.num_replicas = resolve_pair(
            rank,
            num_replicas,
            ("rank", "num_replicas"),
            (env.RANK, env.WORLD_SIZE),
            LAUNCH_HINT_RANKS,
            who,
            default=(0, 1),
        )
        self.shuffle = as_bool(shuffle, "shuffle")
        self.drop_last = as_bool(drop_last, "drop_last")
        self.seed = as_seed(seed)

        self.dataset = dataset
        self.dataset_len = dataset_len
        #: Total number of shards, and this worker's one.
        self.num_shards = self.num_replica_groups * self.num_replicas
        self.shard_index = self.replica_group_id * self.num_replicas + self.rank
        if self.drop_last:
            self.num_samples = dataset_len // self.num_shards
        else:
            self.num_samples = math.ceil(dataset_len / self.num_shards)
        self.total_size = self.num_samples * self.num_shards

        # The cursor. `_lock` makes reads and moves atomic: the Manager calls state_dict() from its
        # quorum thread while the training thread may be drawing indices.
        self._lock = threading.Lock()
        self._epoch = 0
        self._position = 0
        # Set by load_state_dict: the next iterator resumes at _position instead of 0. Cleared by
        # whichever iterator picks the loaded position up (a new one, or the running one).
        self._resume = False
        # Bumped whenever the cursor is moved from outside (load/set_epoch): tells the running
        # iterator to re-read epoch and position instead of continuing its own sequence.
        self._moves = 0
        # The most recently started iterator; older ones refuse to continue (they would advance
        # the shared cursor behind the new one's back).
        self._owner: object | None = None

    # ------------------------------------------------------------------------------ properties
    @property
    def global_rank(self) -> int:
        """torchft's name for `shard_index`: ``group_rank + num_replicas * replica_rank``."""
        return self.shard_index

    @property
    def global_world_size(self) -> int:
        """torchft's name for `num_shards`: ``num_replicas * num_replica_groups``."""
        return self.num_shards

    @property
    def epoch(self) -> int:
        """The current epoch (after a heal: the epoch loaded from the peer)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Indices of this epoch yielded so far by this sampler (0..``num_samples``)."""
        return self._position

    def __len__(self) -> int:
        """Indices per epoch for this shard (the same for every shard)."""
        return self.num_samples

    # ------------------------------------------------------------------------------ order
    def shard_indices(self, epoch: int) -> list[int]:
        """The full index sequence of this shard for ``epoch`` (what an uninterrupted epoch yields)."""
        epoch = self._check_epoch(epoch)
        if len(self.dataset) != self.dataset_len:
            raise ValueError(
                f"the dataset's length changed from {self.dataset_len} to {len(self.dataset)} after the "
                "sampler was built: build a new sampler"
            )
        n = self.dataset_len
        order = epoch_order(n, self.shuffle, self.seed, epoch)
        if self.total_size > n:  # pad by wrapping around (repeats the head, several times if needed)
            order = order[torch.arange(self.total_size) % n]
        else:  # drop_last (or already divisible): cut the tail
            order = order[: self.total_size]
        return order[self.shard_index :: self.num_shards].tolist()

    def _check_epoch(self, epoch: object) -> int:
        return check_epoch(epoch, self.seed)

    # ------------------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[int]:
        """Start an iterator over this shard; it follows the cursor, so heals redirect it.

        It starts at the loaded position if ``load_state_dict`` was called since the last iterator
        started (resuming from a checkpoint), else at the beginning of the current epoch.
        """
        token = object()
        with self._lock:
            self._owner = token
            if not self._resume:
                self._position = 0
            self._resume = False
            moves = self._moves
            epoch = self._epoch
        return self._follow(token, epoch, moves)

    def _follow(self, token: object, epoch: int, moves: int) -> Iterator[int]:
        order = self.shard_indices(epoch)
        while True:
            with self._lock:
                if self._owner is not token:
                    raise RuntimeError(
                        "this sampler iterator was superseded by a newer iter(sampler): a sampler has "
                        "one position, so only the most recent iterator may draw from it"
                    )
                if self._moves != moves:  # load_state_dict/set_epoch moved the cursor: follow it
                    moves = self._moves
                    self._resume = False  # this iterator has picked the loaded position up
                    if self._epoch != epoch:
                        epoch = self._epoch
                        order = self.shard_indices(epoch)
                pos = self._position
                if pos >= len(order):
                    return
                self._position = pos + 1
            # Outside the lock: the consumer (and a heal) runs while we are suspended here.
            yield order[pos]

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (the shuffle seed is ``seed + epoch``), as with torch's sampler.

        Moving to a different epoch starts it at position 0, and a running iterator follows (one
        cursor); setting the current epoch again keeps the position, so
        ``load_state_dict(ckpt); set_epoch(ckpt_epoch)`` still resumes mid-epoch. Moving *back*
        is logged as a warning: after a heal it usually means the training loop counts epochs
        itself instead of reading ``sampler.epoch`` (see `epochs`).
        """
        e = self._check_epoch(epoch)
        with self._lock:
            if e == self._epoch:
                return
            if e < self._epoch:
                logger.warning(
                    "set_epoch(%d) moves the sampler back from epoch %d: if a heal loaded epoch %d, "
                    "the training loop's own epoch counter is stale; iterate `for epoch in "
                    "sampler.epochs(n)` or read sampler.epoch instead",
                    e,
                    self._epoch,
                    self._epoch,
                )
            self._epoch = e
            self._position = 0
            self._resume = False
            self._moves += 1

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Loop over epochs ``sampler.epoch .. num_epochs - 1``, advancing the sampler after each.

        Use it instead of ``for epoch in range(n): sampler.set_epoch(epoch)``: a healed group loads
        its peer's epoch mid-loop, and a ``range`` counter would then be stale (the group would
        replay epochs its peers have finished). This reads the epoch from the sampler, so after
        the epoch's body the next epoch is the one after the *loaded* one::

            for epoch in sampler.epochs(num_epochs):
                for batch in loader:
                    ...
        """
        n = as_int(num_epochs, "num_epochs")
        while True:
            current = self._epoch
            if current >= n:
                return
            yield current
            self.set_epoch(self._epoch + 1)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        """The position as a small JSON-able dict of ints (see `STATE_DICT_KEYS`).

        ``position`` counts the indices this sampler has *handed out* in ``epoch``; under a
        DataLoader with ``num_workers=0`` that is exactly the samples of the batches the loop has
        received. The other entries identify the sharding, so a state from a differently configured
        job is refused instead of silently mixing up shards.
        """
        with self._lock:
            epoch, position = self._epoch, self._position
        return {
            "version": STATE_DICT_VERSION,
            "epoch": epoch,
            "position": position,
            "dataset_len": self.dataset_len,
            "num_shards": self.num_shards,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Move to a saved position, also redirecting an iterator that is already running.

        The state may come from another replica group (a heal) or from a checkpoint. It is
        validated first (format, and that the sharding matches: same dataset length, number of
        shards, seed, shuffle, drop_last); on any error nothing changes. After a successful load,
        the next index drawn -- by the running iterator or, if none, by the next one -- is the one
        at ``position`` in ``epoch`` of *this* worker's shard.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"sampler state must be a dict, got {type(state_dict).__name__}")
        missing = [k for k in STATE_DICT_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"sampler state has no entries {missing} (expected keys {list(STATE_DICT_KEYS)})"
            )
        sd = {k: as_int(state_dict[k], f"sampler state[{k!r}]") for k in STATE_DICT_KEYS}
        if sd["version"] != STATE_DICT_VERSION:
            raise ValueError(
                f"sampler state has version {sd['version']}, this ftlaunch reads version {STATE_DICT_VERSION}"
            )
        expected = {
            "dataset_len": self.dataset_len,
            "num_shards": self.num_shards,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }
        mismatched = [f"{k}: saved {sd[k]}, here {v}" for k, v in expected.items() if sd[k] != v]
        if mismatched:
            raise ConfigurationError(
                "sampler state was saved with a different sharding (" + "; ".join(mismatched) + "): every "
                "replica group must build its DistributedSampler over the same dataset with the same "
                "num_replica_groups, num_replicas, seed, shuffle and drop_last"
            )
        epoch = self._check_epoch(sd["epoch"])
        position = sd["position"]
        if not 0 <= position <= self.num_samples:
            raise ValueError(
                f"sampler state position {position} is outside 0..{self.num_samples} (num_samples)"
            )
        with self._lock:
            old = (self._epoch, self._position)
            self._epoch, self._position = epoch, position
            self._resume = True
            self._moves += 1
        logger.info(
            "sampler shard %d/%d: loaded epoch %d position %d (was epoch %d position %d)",
            self.shard_index,
            self.num_shards,
            epoch,
            position,
            *old,
        )

    def register(self, manager: StateRegistrar, key: str = "sampler") -> None:
        """Make the position travel with live recovery: ``manager.register_state_dict_fn(key, ...)``.

        Every replica group must register under the same key (the healed state is looked up by key).
        """
        manager.register_state_dict_fn(key, self.load_state_dict, self.state_dict)

    # ------------------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_owner"] = None  # iterators do not travel; a copy starts its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shard {self.shard_index}/{self.num_shards}: replica_group_id="
            f"{self.replica_group_id}/{self.num_replica_groups}, rank={self.rank}/{self.num_replicas}, "
            f"len={self.num_samples}, epoch={self._epoch}, position={self._position}, "
            f"shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last})"
        )

"""ftlaunch.worker.data.DistributedSampler: sharding over groups x ranks, resumable and
redirectable position."""

from __future__ import annotations

import copy
import json
import logging
import pickle
from collections import Counter
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from ftlaunch import env
from ftlaunch.errors import ConfigurationError
from ftlaunch.worker.data import STATE_DICT_KEYS, DistributedSampler

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # the dev extra installs it; without it the property test is skipped
    st = None  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests pass their shard explicitly unless they set the environment themselves."""
    for name in (env.REPLICA_GROUP_ID, env.NUM_REPLICA_GROUPS, env.RANK, env.WORLD_SIZE):
        monkeypatch.delenv(name, raising=False)


def make(
    n: int, group: int = 0, groups: int = 1, rank: int = 0, ranks: int = 1, **kw: Any
) -> DistributedSampler:
    return DistributedSampler(range(n), group, groups, rank, ranks, **kw)


def all_shards(n: int, groups: int, ranks: int, **kw: Any) -> list[DistributedSampler]:
    """Samplers of every (group, rank), in global shard order."""
    return [make(n, g, groups, r, ranks, **kw) for g in range(groups) for r in range(ranks)]


# (num_replica_groups, num_replicas, dataset length, shuffle, drop_last)
PARTITION_CASES = [
    (1, 1, 10, False, False),
    (2, 1, 10, True, False),
    (2, 2, 12, True, False),  # divisible
    (2, 2, 10, True, False),  # uneven: padded
    (3, 2, 17, True, False),
    (3, 2, 17, True, True),  # uneven: tail dropped
    (3, 2, 17, False, True),
    (2, 3, 5, False, False),  # fewer samples than shards
    (4, 2, 3, True, False),  # padding wraps around several times
    (2, 2, 3, True, True),  # drop_last with fewer samples than shards: empty shards
    (2, 2, 0, True, False),  # empty dataset
    (1, 4, 16, True, True),
]


@pytest.mark.parametrize(("groups", "ranks", "n", "shuffle", "drop_last"), PARTITION_CASES)
@pytest.mark.parametrize("epoch", [0, 3])
def test_exact_partition(groups: int, ranks: int, n: int, shuffle: bool, drop_last: bool, epoch: int) -> None:
    shards = all_shards(n, groups, ranks, shuffle=shuffle, drop_last=drop_last, seed=7)
    num_shards = groups * ranks
    for s in shards:
        s.set_epoch(epoch)
    per_shard = [list(s) for s in shards]
    # Every shard has the same length: groups stepping in lockstep are at the same position.
    expected_len = n // num_shards if drop_last else -(-n // num_shards)
    assert all(len(p) == expected_len == len(s) for p, s in zip(per_shard, shards, strict=True))
    union = Counter(i for p in per_shard for i in p)
    total = expected_len * num_shards
    assert sum(union.values()) == total
    if drop_last:
        # No index twice; the dropped tail is shorter than one round over the shards.
        assert all(c == 1 for c in union.values())
        assert set(union) <= set(range(n))
        assert n - total < num_shards
    elif n:
        # Every index at least once; padding repeats some, never more than one extra round.
        assert set(union) == set(range(n))
        q = total // n
        assert all(c in (q, q + 1) for c in union.values())
        if n % num_shards == 0:
            assert all(c == 1 for c in union.values())


@pytest.mark.parametrize(("groups", "ranks", "n", "shuffle", "drop_last"), PARTITION_CASES)
def test_same_as_torch_sampler_over_all_shards(
    groups: int, ranks: int, n: int, shuffle: bool, drop_last: bool
) -> None:
    """Shard g*W + r is exactly torch's DistributedSampler(num_replicas=N*W, rank=g*W + r)."""
    for s in all_shards(n, groups, ranks, shuffle=shuffle, drop_last=drop_last, seed=3):
        ref: TorchDistributedSampler[int] = TorchDistributedSampler(
            cast(Any, range(n)),
            num_replicas=s.num_shards,
            rank=s.shard_index,
            shuffle=shuffle,
            seed=3,
            drop_last=drop_last,
        )
        for epoch in (0, 5):
            s.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(s) == list(ref)
            assert len(s) == len(ref)


def test_shard_index_is_group_major() -> None:
    s = make(100, group=2, groups=3, rank=1, ranks=4)
    assert (s.shard_index, s.num_shards) == (9, 12)


def test_torchft_keywords_and_attributes() -> None:
    """torchft: DistributedSampler(dataset, replica_rank=, num_replica_groups=, group_rank=,
    num_replicas=, **torch's kwargs) shards as torch's sampler at rank group_rank + num_replicas *
    replica_rank of num_replicas * num_replica_groups."""
    data = cast(Any, range(50))
    s = DistributedSampler(
        data, replica_rank=2, num_replica_groups=3, group_rank=1, num_replicas=4, shuffle=True, seed=5
    )
    assert (s.global_rank, s.global_world_size) == (9, 12)
    ref: TorchDistributedSampler[int] = TorchDistributedSampler(
        data, num_replicas=12, rank=9, shuffle=True, seed=5
    )
    assert list(s) == list(ref)
    positional = DistributedSampler(data, 2, 3, 1, 4, seed=5)  # torchft's positional order
    assert (positional.global_rank, list(positional)) == (9, list(ref))
    assert (
        DistributedSampler(
            data, replica_group_id=2, replica_rank=2, num_replica_groups=3, rank=1, num_replicas=4
        ).shard_index
        == 9
    )  # the same value under both names is fine
    with pytest.raises(TypeError, match="name the same argument"):
        DistributedSampler(
            data, replica_group_id=1, replica_rank=2, num_replica_groups=3, rank=0, num_replicas=1
        )
    with pytest.raises(TypeError, match="name the same argument"):
        DistributedSampler(data, replica_rank=0, num_replica_groups=1, rank=0, group_rank=1, num_replicas=2)


def test_same_permutation_on_every_shard() -> None:
    """Interleaving the shards back gives one permutation of the dataset: all shards used the same one."""
    n, groups, ranks = 24, 2, 3
    shards = all_shards(n, groups, ranks, seed=11)
    for s in shards:
        s.set_epoch(4)
    per_shard = [list(s) for s in shards]
    merged = [per_shard[k % len(shards)][k // len(shards)] for k in range(n)]
    gen = torch.Generator()
    gen.manual_seed(11 + 4)
    assert merged == torch.randperm(n, generator=gen).tolist()


def test_set_epoch_changes_order_deterministically() -> None:
    a, b = make(200, 1, 2, seed=5), make(200, 1, 2, seed=5)
    e0 = list(a)
    a.set_epoch(1)
    e1 = list(a)
    assert e0 != e1 and sorted(e0) != e1
    b.set_epoch(1)
    assert list(b) == e1  # same seed and epoch: same order on another instance
    a.set_epoch(0)
    assert list(a) == e0  # going back reproduces the epoch
    assert list(make(200, 1, 2, seed=6)) != e0  # another seed, another order
    plain = make(200, 1, 2, shuffle=False)
    first = list(plain)
    plain.set_epoch(9)
    assert list(plain) == first == list(range(1, 200, 2))


def test_iterating_again_without_set_epoch_repeats_the_epoch() -> None:
    s = make(30, 0, 3)
    assert list(s) == list(s)  # like torch: a new iter() starts the current epoch over
    assert s.position == len(s)


# ------------------------------------------------------------------------------ state


def test_state_dict_is_small_json_of_ints() -> None:
    s = make(50, 1, 2, 1, 2, seed=9, drop_last=True)
    s.set_epoch(3)
    it = iter(s)
    for _ in range(4):
        next(it)
    sd = s.state_dict()
    assert tuple(sd) == STATE_DICT_KEYS
    assert all(type(v) is int for v in sd.values())
    assert sd == {
        "version": 1,
        "epoch": 3,
        "position": 4,
        "dataset_len": 50,
        "num_shards": 4,
        "seed": 9,
        "shuffle": 1,
        "drop_last": 1,
    }
    assert json.loads(json.dumps(sd)) == sd


def test_round_trip_resumes_a_new_iterator_at_the_saved_position() -> None:
    full = make(40, 1, 2, 0, 2, seed=1)
    full.set_epoch(2)
    expected = list(full)
    a = make(40, 1, 2, 0, 2, seed=1)
    a.set_epoch(2)
    it = iter(a)
    head = [next(it) for _ in range(7)]
    sd = json.loads(json.dumps(a.state_dict()))  # as a checkpoint would store it

    b = make(40, 1, 2, 0, 2, seed=1)
    b.load_state_dict(sd)
    assert (b.epoch, b.position) == (2, 7)
    b.set_epoch(2)  # the usual resume code sets the saved epoch again: keeps the position
    tail = list(b)
    assert head + tail == expected
    assert b.state_dict() == {**sd, "position": len(expected)}
    # The loaded position was used once: the next pass is a whole epoch again.
    assert list(b) == expected


def test_set_epoch_to_another_epoch_discards_a_loaded_position() -> None:
    a = make(20)
    it = iter(a)
    next(it)
    next(it)
    b = make(20)
    b.load_state_dict(a.state_dict())
    b.set_epoch(1)
    assert b.position == 0
    assert len(list(b)) == 20


@pytest.mark.parametrize(("k", "j"), [(5, 2), (2, 5), (0, 3), (7, 0), (11, 11), (12, 4)])
def test_load_redirects_running_iterator_same_shard(k: int, j: int) -> None:
    """A (the group before it died) ran k steps; B (its restart) ran j, then loads A's position."""
    n, groups = 25, 2  # 13 per shard, padded
    reference = list(make(n, 1, groups))
    a, b = make(n, 1, groups), make(n, 1, groups)
    it_a, it_b = iter(a), iter(b)
    head_a = [next(it_a) for _ in range(k)]
    head_b = [next(it_b) for _ in range(j)]
    assert head_b == reference[:j]
    b.load_state_dict(a.state_dict())
    rest_b = list(it_b)  # the *same* iterator, created before the load
    assert rest_b == list(it_a)  # B now yields exactly what A yields next
    assert head_a + rest_b == reference  # nothing repeated, nothing skipped
    assert b.position == len(reference)


def test_load_from_another_group_redirects_to_this_groups_shard() -> None:
    """A heal loads a *peer group's* state: same position, but this group's own shard."""
    n, groups, ranks, k = 50, 3, 2, 6
    peer = make(n, 0, groups, 1, ranks, seed=4)
    healed = make(n, 2, groups, 1, ranks, seed=4)
    reference = make(n, 2, groups, 1, ranks, seed=4).shard_indices(0)
    it_peer, it_healed = iter(peer), iter(healed)
    for _ in range(k):
        next(it_peer)
    next(it_healed)  # the restarted group drew its own first index before the heal
    healed.load_state_dict(peer.state_dict())
    assert list(it_healed) == reference[k:]
    assert not set(reference[k:]) & set(peer.shard_indices(0))  # groups' shards are disjoint here


def test_loaded_epoch_switches_the_running_iterators_permutation() -> None:
    peer, healed = make(30, 0, 2), make(30, 1, 2)
    peer.set_epoch(2)
    it_peer = iter(peer)
    for _ in range(4):
        next(it_peer)
    it_healed = iter(healed)  # restarted: still in epoch 0
    next(it_healed)
    healed.load_state_dict(peer.state_dict())
    assert healed.epoch == 2
    assert list(it_healed) == healed.shard_indices(2)[4:]
    assert healed.shard_indices(2) != healed.shard_indices(0)


def test_load_at_end_of_epoch_ends_the_running_iterator() -> None:
    peer, healed = make(12, 0, 2), make(12, 1, 2)
    list(peer)
    it_healed = iter(healed)
    next(it_healed)
    healed.load_state_dict(peer.state_dict())
    assert list(it_healed) == []
    healed.set_epoch(1)
    assert len(list(healed)) == 6


def test_set_epoch_moves_the_running_iterator() -> None:
    s = make(20)
    it = iter(s)
    next(it)
    s.set_epoch(1)
    assert list(it) == s.shard_indices(1)


def test_only_the_newest_iterator_may_continue() -> None:
    s = make(10)
    old = iter(s)
    next(old)
    new = iter(s)
    assert next(new) == s.shard_indices(0)[0]
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)


def test_set_epoch_back_warns_about_stale_epoch_counter(caplog: pytest.LogCaptureFixture) -> None:
    s = make(10)
    s.load_state_dict({**s.state_dict(), "epoch": 3})
    with caplog.at_level(logging.WARNING, logger="ftlaunch.worker.data"):
        s.set_epoch(1)
    assert "sampler.epochs" in caplog.text


def test_epochs_advances_from_the_sampler_epoch() -> None:
    s = make(4)
    seen = []
    for epoch in s.epochs(5):
        seen.append(epoch)
        if epoch == 1:  # a heal in epoch 1 loads a peer's state from epoch 3
            s.load_state_dict({**s.state_dict(), "epoch": 3, "position": 2})
    assert seen == [0, 1, 4]
    assert s.epoch == 5
    assert list(s.epochs(5)) == []


def test_copy_and_pickle() -> None:
    s = make(20, 1, 2, seed=3)
    it = iter(s)
    next(it)
    for clone in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert clone.state_dict() == s.state_dict()
        assert list(clone) == s.shard_indices(0)
    assert next(it) == s.shard_indices(0)[1]  # the original's iterator is unaffected


# ------------------------------------------------------------------------------ DataLoader


def test_dataloader_mid_epoch_load_redirects_the_loop() -> None:
    n, bs = 64, 4
    ds = TensorDataset(torch.arange(n))
    a, b = make(n, 0, 2, seed=2), make(n, 0, 2, seed=2)
    loader_a = DataLoader(ds, batch_size=bs, sampler=a, num_workers=0)
    loader_b = DataLoader(ds, batch_size=bs, sampler=b, num_workers=0)
    reference = [batch.tolist() for (batch,) in DataLoader(ds, batch_size=bs, sampler=make(n, 0, 2, seed=2))]
    it_a, it_b = iter(loader_a), iter(loader_b)
    head_a = [next(it_a)[0].tolist() for _ in range(5)]
    next(it_b)
    next(it_b)
    assert a.position == 5 * bs  # num_workers=0: exactly the samples of the batches received
    b.load_state_dict(a.state_dict())
    rest_b = [batch.tolist() for (batch,) in it_b]
    assert rest_b == [batch.tolist() for (batch,) in it_a]
    assert head_a + rest_b == reference


def _training_loop(
    sampler: DistributedSampler, loader: DataLoader, num_epochs: int, log: list
) -> Iterator[str]:
    """The shape of a training loop, paused where the Manager acts (the test drives it)."""
    for _ in sampler.epochs(num_epochs):
        for (batch,) in loader:
            log.append((sampler.epoch, batch.tolist()))
            yield "zero_grad"  # start_quorum: a healthy peer's state is captured after this point
            yield "step"  # should_commit: a healing group loads the state here


@pytest.mark.parametrize("heal_step", [0, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("loader_drop_last", [False, True])
def test_lockstep_heal_under_dataloader(heal_step: int, loader_drop_last: bool) -> None:
    """Group 1 dies at step 2, comes back at `heal_step` and heals from group 0, like the Manager does.

    After the heal, group 1 trains exactly the batches an uninterrupted group 1 would, at the same
    steps, across epoch boundaries, and finishes together with group 0.
    """
    n, groups, ranks, rank, bs, epochs = 37, 2, 2, 1, 3, 3  # 10 per shard: 4 (or 3) steps per epoch
    ds = TensorDataset(torch.arange(n))

    def group(g: int) -> tuple[DistributedSampler, Iterator[str], list]:
        sampler = make(n, g, groups, rank, ranks, seed=8)
        loader = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=0, drop_last=loader_drop_last)
        log: list = []
        return sampler, _training_loop(sampler, loader, epochs, log), log

    def run_alone(g: int) -> list:
        _, loop, log = group(g)
        for _ in loop:
            pass
        return log

    reference = run_alone(1)
    num_steps = len(reference)
    assert num_steps == epochs * (3 if loader_drop_last else 4)
    assert heal_step < num_steps

    s0, loop0, log0 = group(0)
    _, first_life, _ = group(1)
    for _ in range(min(2, heal_step)):  # both groups step together, then group 1 dies
        for _ in range(2):
            next(loop0), next(first_life)
    for _ in range(heal_step - min(2, heal_step)):  # group 0 trains alone
        next(loop0), next(loop0)

    s1, loop1, log1 = group(1)  # the restarted group: a fresh sampler in epoch 0
    assert next(loop0) == next(loop1) == "zero_grad"
    state = json.loads(json.dumps(s0.state_dict()))  # captured on the quorum thread, sent over the wire
    assert next(loop0) == next(loop1) == "step"
    s1.load_state_dict(state)  # should_commit(): the vote passed, load the peer's state
    steps_after = 0
    while True:
        r0, r1 = next(loop0, None), next(loop1, None)
        assert r0 == r1  # lockstep, including finishing at the same step
        if r0 is None:
            break
        next(loop0), next(loop1)
        steps_after += 1
    assert steps_after == num_steps - heal_step - 1
    assert log1[1:] == reference[heal_step + 1 :]
    assert log0 == run_alone(0)


# ------------------------------------------------------------------------------ manager


class _FakeManager:
    def __init__(self) -> None:
        self.fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None:
        self.fns[key] = (load_state_dict, state_dict)


def test_register_with_manager() -> None:
    peer, healed = make(20, 0, 2), make(20, 1, 2)
    m_peer, m_healed = _FakeManager(), _FakeManager()
    peer.register(m_peer)
    healed.register(m_healed, key="train_data")
    assert list(m_peer.fns) == ["sampler"] and list(m_healed.fns) == ["train_data"]
    it = iter(peer)
    next(it), next(it), next(it)
    it_healed = iter(healed)
    next(it_healed)
    m_healed.fns["train_data"][0](m_peer.fns["sampler"][1]())
    assert list(it_healed) == healed.shard_indices(0)[3:]


def test_register_matches_manager_signature() -> None:
    import inspect

    from ftlaunch.worker.manager import Manager

    params = list(inspect.signature(Manager.register_state_dict_fn).parameters)
    assert params == ["self", "key", "load_state_dict", "state_dict"]


# ------------------------------------------------------------------------------ configuration


def test_defaults_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.REPLICA_GROUP_ID, "1")
    monkeypatch.setenv(env.NUM_REPLICA_GROUPS, "3")
    monkeypatch.setenv(env.RANK, "2")
    monkeypatch.setenv(env.WORLD_SIZE, "4")
    s = DistributedSampler(range(100))
    assert (s.replica_group_id, s.num_replica_groups, s.rank, s.num_replicas) == (1, 3, 2, 4)
    assert (s.shard_index, s.num_shards) == (6, 12)
    # Arguments win over the environment.
    assert DistributedSampler(range(100), replica_group_id=0, rank=0).shard_index == 0


def test_single_worker_group_when_rank_and_world_size_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.REPLICA_GROUP_ID, "1")
    monkeypatch.setenv(env.NUM_REPLICA_GROUPS, "2")
    s = DistributedSampler(range(10))
    assert (s.rank, s.num_replicas, s.shard_index, s.num_shards) == (0, 1, 1, 2)


def test_missing_group_env_says_how_to_launch() -> None:
    with pytest.raises(ConfigurationError, match="REPLICA_GROUP_ID") as info:
        DistributedSampler(range(10))
    assert "ftlaunch --replicas" in str(info.value) and "replica_group_id=" in str(info.value)
    with pytest.raises(ConfigurationError, match="num_replica_groups"):
        DistributedSampler(range(10), replica_group_id=0)


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({env.REPLICA_GROUP_ID: "x", env.NUM_REPLICA_GROUPS: "2"}, "REPLICA_GROUP_ID='x' is not an integer"),
        ({env.REPLICA_GROUP_ID: "2", env.NUM_REPLICA_GROUPS: "2"}, r"replica_group_id must be in 0\.\.1"),
        ({env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "0"}, "num_replica_groups must be >= 1"),
        ({env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "1", env.RANK: "1"}, "WORLD_SIZE is not set"),
        ({env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "1", env.WORLD_SIZE: "2"}, "RANK is not set"),
        (
            {env.REPLICA_GROUP_ID: "0", env.NUM_REPLICA_GROUPS: "1", env.RANK: "2", env.WORLD_SIZE: "2"},
            "RANK=2",
        ),
    ],
)
def test_bad_environment(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], match: str) -> None:
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigurationError, match=match):
        DistributedSampler(range(10))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"replica_group_id": True}, TypeError, "replica_group_id must be an int, got bool"),
        ({"rank": 1.0}, TypeError, "rank must be an int"),
        ({"num_replicas": "2"}, TypeError, "num_replicas must be an int"),
        ({"replica_group_id": -1}, ConfigurationError, "replica_group_id must be in 0..1"),
        ({"rank": 2}, ConfigurationError, r"rank must be in 0\.\.1, got rank=2 with num_replicas=2"),
        ({"num_replicas": 0, "rank": 0}, ConfigurationError, "num_replicas must be >= 1"),
        ({"shuffle": 1}, TypeError, "shuffle must be a bool"),
        ({"drop_last": None}, TypeError, "drop_last must be a bool"),
        ({"seed": -1}, ValueError, "seed must be in"),
        ({"seed": 2**64}, ValueError, "seed must be in"),
        ({"seed": "0"}, TypeError, "seed must be an int"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"replica_group_id": 0, "num_replica_groups": 2, "rank": 1, "num_replicas": 2}
    with pytest.raises(exc, match=match):
        DistributedSampler(range(10), **{**args, **kwargs})


def test_dataset_without_len() -> None:
    with pytest.raises(TypeError, match="sized"):
        DistributedSampler(iter(range(10)), 0, 1, 0, 1)


def test_dataset_length_change_is_detected() -> None:
    data = list(range(10))
    s = DistributedSampler(data, 0, 1, 0, 1)
    data.append(10)
    with pytest.raises(ValueError, match="length changed from 10 to 11"):
        list(s)


def test_bad_epoch() -> None:
    s = make(10)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        s.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch must be an int"):
        s.set_epoch(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="below 2"):
        make(10, seed=2**64 - 1).set_epoch(1)


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"position": 11}, ValueError, r"position 11 is outside 0\.\.10"),
        ({"position": -1}, ValueError, "outside"),
        ({"epoch": -2}, ValueError, "epoch must be >= 0"),
        ({"epoch": True}, TypeError, r"sampler state\['epoch'\] must be an int, got bool"),
        ({"position": "3"}, TypeError, "must be an int"),
        ({"version": 2}, ValueError, "version 2"),
        ({"dataset_len": 21}, ConfigurationError, "dataset_len: saved 21, here 20"),
        ({"num_shards": 4}, ConfigurationError, "num_shards: saved 4, here 2"),
        ({"seed": 1}, ConfigurationError, "seed: saved 1, here 0"),
        ({"shuffle": 0}, ConfigurationError, "shuffle: saved 0, here 1"),
        (
            {"drop_last": 1, "seed": 5},
            ConfigurationError,
            "seed: saved 5, here 0; drop_last: saved 1, here 0",
        ),
    ],
)
def test_bad_state_is_refused_and_changes_nothing(
    change: dict[str, Any], exc: type[Exception], match: str
) -> None:
    s = make(20, 0, 2)
    it = iter(s)
    next(it)
    before = s.state_dict()
    with pytest.raises(exc, match=match):
        s.load_state_dict({**before, **change})
    assert s.state_dict() == before
    assert next(it) == s.shard_indices(0)[1]


def test_malformed_state() -> None:
    s = make(10)
    with pytest.raises(TypeError, match="must be a dict"):
        s.load_state_dict([1, 2])  # type: ignore[arg-type]
    sd = s.state_dict()
    del sd["position"], sd["seed"]
    with pytest.raises(ValueError, match=r"no entries \['position', 'seed'\]"):
        s.load_state_dict(sd)


# ------------------------------------------------------------------------------ properties

if st is None:

    def test_property_partition_and_redirect() -> None:
        pytest.skip("hypothesis is not installed (pip install -e .[dev])")

else:

    @settings(max_examples=80, deadline=None)
    @given(
        n=st.integers(0, 60),
        groups=st.integers(1, 4),
        ranks=st.integers(1, 3),
        shuffle=st.booleans(),
        drop_last=st.booleans(),
        epoch=st.integers(0, 5),
        data=st.data(),
    )
    def test_property_partition_and_redirect(  # type: ignore[misc]
        n: int, groups: int, ranks: int, shuffle: bool, drop_last: bool, epoch: int, data: st.DataObject
    ) -> None:
        shards = all_shards(n, groups, ranks, shuffle=shuffle, drop_last=drop_last, seed=epoch * 7)
        for s in shards:
            s.set_epoch(epoch)
        per_shard = [list(s) for s in shards]
        lengths = {len(p) for p in per_shard}
        assert len(lengths) == 1
        union = Counter(i for p in per_shard for i in p)
        if drop_last or n % len(shards) == 0:
            assert all(c == 1 for c in union.values())
        if not drop_last:
            assert set(union) == set(range(n))
        num = lengths.pop()

        # A restarted copy of a random shard, at a random own position, loads a random peer's position.
        g, r = data.draw(st.integers(0, groups - 1)), data.draw(st.integers(0, ranks - 1))
        peer = shards[data.draw(st.integers(0, len(shards) - 1))]
        k, j = data.draw(st.integers(0, num)), data.draw(st.integers(0, num))
        peer.set_epoch(epoch + 1)
        it_peer = iter(peer)
        for _ in range(k):
            next(it_peer)
        restarted = make(n, g, groups, r, ranks, shuffle=shuffle, drop_last=drop_last, seed=epoch * 7)
        it = iter(restarted)
        for _ in range(j):
            next(it)
        restarted.load_state_dict(peer.state_dict())
        assert list(it) == restarted.shard_indices(epoch + 1)[k:]

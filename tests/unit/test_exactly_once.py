"""ftlaunch.worker.exactly_once.ExactlyOnceSampler in one process, on a faithful fake of the Manager.

`Job` drives replica groups (each a few workers: a fake Manager, the sampler, a real DataLoader and
the two-line loop) through the Manager's protocol: every worker draws its batch, the step's quorum
is planned by the real `plan_step`, healers load a source's sampler state, the step commits or
not. Groups are killed, hung (SIGSTOP: their step fails and they drop out), replaced by a spare,
restarted and added past the group count the job started with; the samples the committed steps'
participants trained are exactly the dataset, once per epoch. The fixed shards, in the same job,
skip the samples of a group that is down.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.lighthouse.slots import slot_of
from ftlaunch.worker.data import DistributedSampler
from ftlaunch.worker.exactly_once import STATE_DICT_KEYS, ExactlyOnceSampler
from ftlaunch.worker.plan import (
    CLAIM_KEY,
    HEAL_READY_KEY,
    STAGED_KEY,
    StepPlan,
    WorldSizeMode,
    may_heal,
    plan_step,
    snapshot_due,
)


class FakeManager:
    """What the sampler reads from ``ftlaunch.Manager``; `Job` moves it as the protocol would."""

    def __init__(self, replica_id: str, step: int = 0) -> None:
        self.replica_id = replica_id
        self.step = step
        self.attempt = 0
        self.plan: StepPlan | None = None
        self.last_plan: StepPlan | None = None  # the plan of the last step taken, kept across steps
        self.snapshot: dict[str, Any] | None = None  # the committed state, as the boundary copied it
        self.heal_ready = False
        self.state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def current_step(self) -> int:
        return self.step

    def latest_plan(self) -> tuple[int, StepPlan | None]:
        return self.attempt, self.plan

    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        self.state_fns[key] = (load, save)

    def start(self) -> None:
        """start_quorum: the commit boundary (a snapshot of every registered state when a heal is
        due, `worker/committed.py`), then a new attempt whose plan is not known yet."""
        due = snapshot_due(self.step, self.last_plan)
        self.snapshot = {k: save() for k, (_, save) in self.state_fns.items()} if due else None
        self.heal_ready = may_heal(self.step, self.last_plan)
        self.attempt += 1
        self.plan = None

    def claim(self) -> str:
        return hashlib.sha256(json.dumps(self.snapshot, sort_keys=True).encode()).hexdigest()


class Worker:
    """One rank of one replica group running README's two-line loop."""

    def __init__(self, job: Job, replica_id: str, rank: int, shard: bool) -> None:
        self.manager = FakeManager(replica_id)
        self.rank = rank
        if shard:
            slot = slot_of(replica_id)
            self.sampler: Any = DistributedSampler(job.dataset, slot, job.started, rank, job.workers, seed=3)
        else:
            self.sampler = ExactlyOnceSampler(
                job.dataset,
                self.manager,
                rank=rank,
                num_replicas=job.workers,
                seed=3,
                num_replica_groups=job.started,
            )
        self.sampler.register(self.manager)
        self.loader = DataLoader(job.dataset, batch_size=job.batch, sampler=self.sampler)
        self.loop = self._loop(job.epochs)
        self.batch: list[tuple[int, int]] | None = None

    def _loop(self, epochs: int) -> Iterator[list[tuple[int, int]]]:
        for epoch in self.sampler.epochs(epochs):
            for (idx,) in self.loader:
                if isinstance(self.sampler, ExactlyOnceSampler):
                    drawn = self.sampler.drawn()
                    assert [i for _, i in drawn] == idx.tolist()
                    yield drawn
                else:
                    yield [(epoch, i) for i in idx.tolist()]

    def draw(self) -> bool:
        self.batch = next(self.loop, None)
        return self.batch is not None


class Job:
    def __init__(
        self, *, length: int = 60, started: int = 3, workers: int = 1, batch: int = 4, epochs: int = 2,
        shard: bool = False, mode: WorldSizeMode = WorldSizeMode.DYNAMIC, min_replicas: int = 1,
    ) -> None:  # fmt: skip
        self.dataset = TensorDataset(torch.arange(length))
        self.length, self.started, self.workers, self.batch, self.epochs = (
            length,
            started,
            workers,
            batch,
            epochs,
        )
        self.shard, self.mode, self.min_replicas = shard, mode, min_replicas
        self.groups: dict[str, list[Worker]] = {}
        self.stopped: set[str] = set()
        self.trained: list[tuple[int, int]] = []  # (epoch, index) of every committed participant's batch
        self.quorum_id = 0
        self.finished = False
        for g in range(started):
            self.start(f"rg{g}")

    def start(self, replica_id: str) -> None:
        """A group's workers start (a fresh process: step 0, a fresh sampler)."""
        self.groups[replica_id] = [Worker(self, replica_id, r, self.shard) for r in range(self.workers)]

    def kill(self, replica_id: str) -> None:
        del self.groups[replica_id]
        self.stopped.discard(replica_id)

    def step(self, fail: bool = False, stop: str | None = None) -> None:
        """One step of every live group: draw, quorum, (heal), commit -- unless ``fail``; ``stop``
        hangs that group inside the step (its peers' step fails, later quorums go on without it).

        As the Manager does it: a group snapshots its committed state at the boundary when a heal
        is due and says so (and claims its checksum) in its quorum data; a healer heals from such a
        snapshot before its forward pass, or waits a step (zero gradients, no commit) while its
        sources snapshot; only the participants' batches are trained, and nothing commits when
        fewer than ``min_replicas`` groups are up to date."""
        live = sorted(g for g in self.groups if g not in self.stopped)
        for g in live:
            if not all([w.draw() for w in self.groups[g]]):
                self.finished = True
                return
        for g in live:
            for w in self.groups[g]:
                w.manager.start()
        if stop is not None:
            self.stopped.add(stop)
            fail = True
        members = [g for g in live if g not in self.stopped]
        self.quorum_id += 1
        quorum = Quorum(self.quorum_id, tuple(self.member(g) for g in members), created=0.0)
        plans = {
            g: plan_step(quorum, g, world_size_mode=self.mode, min_replica_size=self.min_replicas)
            for g in members
        }
        for g, plan in plans.items():
            # The sources' snapshots agree: the sampler state is the same in every group after a commit.
            assert not plan.untrusted_ids and not plan.contested, plan
            for w in self.groups[g]:
                w.manager.plan = w.manager.last_plan = plan
            if plan.recover_src_id is not None:  # heals before its forward pass: from the snapshot
                for w in self.groups[g]:
                    src = self.groups[plan.recover_src_id][w.rank].manager
                    assert src.snapshot is not None and plan.recover_claim is not None
                    assert plan.recover_claim[w.rank] == src.claim()  # what it loads is what was claimed
                    if not self.shard:  # the position of the committed step the healer takes
                        assert src.snapshot["sampler"]["step"] == plan.max_step
                    w.manager.state_fns["sampler"][0](src.snapshot["sampler"])
                    w.manager.step = plan.max_step
        if fail or any(p.num_up_to_date < self.min_replicas for p in plans.values()):
            return
        for g, plan in plans.items():
            if plan.waits:
                continue
            for w in self.groups[g]:
                w.manager.step = plan.max_step + 1
            if plan.participates:
                for w in self.groups[g]:
                    assert w.batch is not None
                    self.trained.extend(w.batch)

    def member(self, g: str) -> QuorumMember:
        managers = [w.manager for w in self.groups[g]]
        data: dict[str, Any] = {HEAL_READY_KEY: all(m.heal_ready for m in managers)}
        if all(m.snapshot is not None for m in managers):
            data.update({STAGED_KEY: True, CLAIM_KEY: [m.claim() for m in managers]})
        return QuorumMember(g, step=managers[0].step, data=data)

    def wake(self, replica_id: str) -> None:
        """A hung group continues: its step did not commit; it is behind and heals next."""
        self.stopped.discard(replica_id)

    def run(self, until: int) -> None:
        for _ in range(until):
            self.step()
            if self.finished:
                return
        raise AssertionError(f"the job did not finish its {self.epochs} epochs in {until} steps")

    def per_epoch(self) -> dict[int, Counter[int]]:
        out: dict[int, Counter[int]] = {}
        for epoch, index in self.trained:
            out.setdefault(epoch, Counter())[index] += 1
        return out


def scenario(job: Job, rng: random.Random) -> None:
    """Kills, hangs, a failed step, a spare taking a slot over, a restart, a group added."""
    for _ in range(3):
        job.step()
    job.kill("rg1")  # dies: its peers' step fails, the next quorum goes on without it
    job.step(fail=True)
    for _ in range(rng.randint(1, 4)):
        job.step()
    job.start("rg1.1")  # a hot spare takes replica group 1 over and heals
    for _ in range(rng.randint(1, 3)):
        job.step()
    job.step(stop="rg2")  # hangs mid-step
    for _ in range(rng.randint(1, 4)):
        job.step()
    job.wake("rg2")  # comes back behind: heals
    job.step(fail=True)
    job.step()
    job.start(f"rg{job.started}")  # a group past the count the job started with
    for _ in range(rng.randint(2, 5)):
        job.step()
    job.kill("rg0")
    job.step(fail=True)
    job.step()
    job.start("rg0")  # restarted by its agent under its own name
    job.run(400)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "workers,mode",
    [(1, WorldSizeMode.DYNAMIC), (2, WorldSizeMode.DYNAMIC), (1, WorldSizeMode.FIXED_WITH_SPARES)],
)
def test_every_sample_is_trained_once_per_epoch_whatever_fails(
    seed: int, workers: int, mode: WorldSizeMode
) -> None:
    rng = random.Random(seed)
    job = Job(length=rng.choice([37, 60, 97]), workers=workers, batch=rng.choice([2, 3, 5]), epochs=3,
              mode=mode,
              min_replicas=2 if mode is WorldSizeMode.FIXED_WITH_SPARES else 1)  # fmt: skip
    scenario(job, rng)
    counts = job.per_epoch()
    for epoch in range(job.epochs):
        assert counts[epoch] == Counter(range(job.length)), (epoch, counts[epoch])
    # Steps that reach into the next epoch train its first samples; never one twice either.
    assert all(c == 1 for e, per in counts.items() if e >= job.epochs for c in per.values())
    # Every group that is up to date ends at the same position.
    workers_ = [w for ws in job.groups.values() for w in ws]
    last = max(w.manager.step for w in workers_)
    positions = {(w.sampler.epoch, w.sampler.position) for w in workers_ if w.manager.step == last}
    assert len(positions) == 1, positions


def test_the_same_failures_give_the_same_slices() -> None:
    runs = []
    for _ in range(2):
        job = Job(length=60, batch=3)
        scenario(job, random.Random(11))
        runs.append(job.trained)
    assert runs[0] == runs[1]


def test_fixed_shards_skip_the_samples_of_a_group_that_is_down() -> None:
    """The same job with the fixed shards: the batches of a step that does not commit, and of a
    group that is down or heals, are not trained (a shard's position moves on regardless, and a
    healed group takes its peers'), so epoch 0 misses them; a group past the started count has no
    shard at all."""
    job = Job(length=60, batch=2, epochs=1, shard=True)
    for _ in range(2):
        job.step()
    job.kill("rg1")
    job.step(fail=True)
    for _ in range(3):
        job.step()
    job.start("rg1")
    job.run(100)
    counts = job.per_epoch()[0]
    missing = set(range(60)) - set(counts)
    # Lost, 2 samples a batch: the healers' (rg1, rg2) batches of the first two steps (they wait for
    # the primary's snapshot, then heal), every batch of the failed step (a shard's position moves
    # on whether or not the step commits), rg1's three steps down and, back, its wait and heal steps.
    assert len(missing) == 2 * 2 * 2 + 3 * 2 + 3 * 2 + 2 * 2, sorted(missing)
    assert all(c == 1 for c in counts.values())
    with pytest.raises(ConfigurationError, match="replica_group_id must be in 0..2"):
        Job(length=60, shard=True).start("rg3")

    exact = Job(length=60, batch=2, epochs=1)
    for _ in range(2):
        exact.step()
    exact.kill("rg1")
    exact.step(fail=True)
    for _ in range(3):
        exact.step()
    exact.start("rg1")
    exact.start("rg3")
    exact.run(100)
    assert exact.per_epoch()[0] == Counter(range(60))


# ---------------------------------------------------------------------------------------- units
def sampler(n: int = 10, rid: str = "rg0", **kw: Any) -> tuple[ExactlyOnceSampler, FakeManager]:
    m = FakeManager(rid)
    return ExactlyOnceSampler(range(n), m, **kw), m


def commit(m: FakeManager, participants: tuple[str, ...] = ("rg0",)) -> None:
    m.start()
    m.plan = StepPlan(
        quorum_id=1, replica_rank=0, replica_world_size=len(participants), max_step=m.step, num_sources=1,
        source_rank=0, recover_src_rank=None, recover_src_id=None, recover_dst_ranks=(), store_address="",
        num_participants=len(participants), participant_rank=0, participant_ids=participants,
    )  # fmt: skip
    m.step += 1


def test_a_lone_group_walks_the_epoch_in_order_and_ends_it_at_a_step() -> None:
    s, m = sampler(7, shuffle=False)
    it = iter(s)
    got = []
    for _ in range(4):
        got.append([next(it), next(it)])
        commit(m)
    assert got == [[0, 1], [2, 3], [4, 5], [6, 0]]  # the last step reaches into epoch 1
    assert next(it, None) is None  # epoch 0 is trained: the pass ends at the step boundary
    assert (s.epoch, s.position) == (1, 1)
    assert list(s.epochs(1)) == []


def test_a_step_that_does_not_commit_is_drawn_again() -> None:
    s, m = sampler(10, shuffle=False)
    it = iter(s)
    assert [next(it), next(it)] == [0, 1]
    m.start()  # the step fails: no commit
    assert [next(it), next(it)] == [0, 1]
    commit(m)
    assert [next(it), next(it)] == [2, 3]


def test_participants_take_consecutive_slices_in_group_order() -> None:
    a, ma = sampler(20, "rg0", shuffle=False, num_replica_groups=2)
    b, mb = sampler(20, "rg1.2", shuffle=False, num_replica_groups=2)  # a spare holding replica group 1
    ia, ib = iter(a), iter(b)
    for _ in range(2):  # the first step deals rows; from then on slices
        [next(ia), next(ia)], [next(ib), next(ib)]
        for m in (ma, mb):
            commit(m, ("rg0", "rg1.2"))
    assert [next(ia), next(ia)] == [8, 9] and [next(ib), next(ib)] == [10, 11]
    assert a.drawn() == [(0, 8), (0, 9)]


def test_state_dict_is_small_versioned_and_json() -> None:
    s, m = sampler(10)
    it = iter(s)
    next(it)
    commit(m)
    sd = s.state_dict()
    assert tuple(sd) == STATE_DICT_KEYS and sd["version"] == 2
    assert json.loads(json.dumps(sd)) == sd
    assert (sd["epoch"], sd["position"], sd["step"], sd["per_step"]) == (0, 1, 1, 1)
    other, om = sampler(10, "rg1")
    other.load_state_dict(sd)
    om.step = 1  # as a heal sets it
    assert other.state_dict() == sd


def test_load_reads_the_fixed_shards_format() -> None:
    old = DistributedSampler(range(100), 1, 2, 0, 2, seed=5)  # 4 shards
    it = iter(old)
    for _ in range(7):
        next(it)
    s, _ = sampler(100, "rg0", seed=5)
    s.load_state_dict(old.state_dict())
    assert (s.epoch, s.position) == (0, 28)
    trained = set(DistributedSampler(range(100), 0, 1, seed=5).shard_indices(0)[:28])
    it2 = iter(s)
    assert not {next(it2) for _ in range(10)} & trained  # the first 28 of the order are done


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"dataset_len": 11}, ConfigurationError, "dataset_len: saved 11, here 10"),
        ({"workers": 2}, ConfigurationError, "workers: saved 2, here 1"),
        ({"version": 3}, ValueError, "versions 1 and 2"),
        ({"holes": [[5, 3]]}, ValueError, "sorted"),
        ({"holes": "x"}, ValueError, "pairs"),
        ({"step": True}, TypeError, "bool"),
        ({"per_step": -1}, ValueError, ">= 0"),
    ],
)
def test_load_refuses_a_bad_state_and_changes_nothing(change: dict, error: type, match: str) -> None:
    s, _ = sampler(10)
    sd = {**s.state_dict(), "cursor": 6, **change}
    before = s.state_dict()
    with pytest.raises(error, match=match):
        s.load_state_dict(sd)
    assert s.state_dict() == before


def test_a_heal_redirects_the_running_iterator_into_the_peers_epoch() -> None:
    src, ms = sampler(10, "rg0", shuffle=False)
    for _ in src.epochs(2):
        for _ in src:
            commit(ms)
            if src.epoch == 1 and src.position == 2:
                break
        else:
            continue
        break
    healer, mh = sampler(10, "rg1", shuffle=False)
    ih = iter(healer)
    next(ih)  # its stale first batch
    mh.start()
    healer.load_state_dict(src.state_dict())  # the step's heal (its commit below)
    mh.step = ms.step
    commit(mh, ("rg0",))
    assert (healer.epoch, healer.position) == (1, 3)
    assert next(ih) == 4  # replica group 1's slice: the second of the pool, in the peers' epoch
    assert healer.drawn() == [(1, 4)]


def test_a_healers_stale_draws_do_not_size_the_participants_slices() -> None:
    """A LocalSGD/DiLoCo step is a sync: several batches per worker. A group that joins inside its
    first training step drew one batch, with its stale position, before its heal; the step's
    slices are the participants' (``per_step`` each), so after it the healer is where they are."""
    src, ms = sampler(40, "rg0", shuffle=False)
    it = iter(src)
    for _ in range(3):
        next(it), next(it)  # two draws per step
        commit(ms)
    healer, mh = sampler(40, "rg1", shuffle=False)
    ih = iter(healer)
    next(ih)  # its stale first batch; its forward then joins
    next(it), next(it)  # the source's draws for the sync the join takes part in
    mh.start()
    healer.load_state_dict(src.state_dict())  # served at the quorum, loaded at the commit below
    mh.step = ms.step
    commit(ms)
    commit(mh, ("rg0",))
    assert (healer.epoch, healer.position) == (src.epoch, src.position) == (0, 8)
    assert [next(ih), next(ih)] == [10, 11]  # replica group 1's slice of the next step


def test_set_epoch_keeps_range_loops_working_and_skips_forward_only() -> None:
    s, m = sampler(10, shuffle=False)
    s.set_epoch(0)
    it = iter(s)
    next(it)
    commit(m)
    s.set_epoch(0)  # the current one: nothing changes
    assert (s.epoch, s.position) == (0, 1)
    s.set_epoch(2)
    assert (s.epoch, s.position) == (2, 0)
    s.set_epoch(1)  # back: ignored, logged
    assert s.epoch == 2


def test_drawing_after_the_step_began_is_refused_with_the_fix() -> None:
    s, m = sampler(10)
    it = iter(s)
    next(it)
    commit(m)
    m.start()  # optimizer.zero_grad() of the next step, then a micro-batch drawn inside it: the
    with pytest.raises(ConfigurationError, match="before the step begins"):  # previous commit's
        next(it)  # participants are gone


def test_more_draws_in_a_step_than_before_is_refused() -> None:
    s, m = sampler(20)
    it = iter(s)
    next(it)
    commit(m)
    next(it)
    with pytest.raises(ConfigurationError, match="more than the 1 of each step before"):
        next(it)


def test_fewer_draws_than_before_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    s, m = sampler(20)
    it = iter(s)
    next(it), next(it)
    commit(m)
    next(it)
    commit(m)
    with caplog.at_level(logging.WARNING):
        assert s.position == 3
    assert "fewer than the 2" in caplog.text and "worker processes" in caplog.text


def test_a_replica_id_without_a_group_number_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="mode='shard'"):
        sampler(10, "trainer")
    with pytest.raises(ValueError, match="at least one sample"):
        sampler(0)
    with pytest.raises(TypeError, match="sized"):
        ExactlyOnceSampler(iter(range(3)), FakeManager("rg0"))


def test_a_new_iterator_draws_the_steps_samples_again() -> None:
    s, m = sampler(10, shuffle=False)
    first = next(iter(s))  # peek
    it = iter(s)
    assert next(it) == first
    with pytest.raises(RuntimeError, match="superseded"):
        old = iter(s)
        next(iter(s))
        next(old)


def test_ft_sampler_is_exact_by_default_and_shards_on_request() -> None:
    from ftlaunch.timeouts import Timeouts
    from ftlaunch.worker.fault_tolerance import FaultTolerance

    manager = FakeManager("rg1.1")  # a spare holding replica group 1
    ft = FaultTolerance(
        manager=manager, pg=None, replica_group_id=1, num_replica_groups=2, rank=0, world_size=1,  # type: ignore[arg-type]
        device=torch.device("cpu"), backend="gloo", transport="pg", timeouts=Timeouts(60, 60, 60, 120, 60),
    )  # fmt: skip
    exact = ft.sampler(range(10))
    assert isinstance(exact, ExactlyOnceSampler) and exact.replica_group == 1
    assert manager.state_fns["sampler"][1]() == exact.state_dict()
    shard = ft.sampler(range(10), key="shard", mode="shard", drop_last=True)
    assert isinstance(shard, DistributedSampler) and (shard.replica_group_id, shard.num_shards) == (1, 2)
    with pytest.raises(ConfigurationError, match="mode is 'exact'"):
        ft.sampler(range(10), mode="global")
    model = torch.nn.Linear(2, 2)
    inner, outer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ConfigurationError, match="mode='shard'"):
        ft.diloco(model, inner, outer, 4, fragment_sync_delay=1)


def test_a_prefetching_dataloader_is_noticed(caplog: pytest.LogCaptureFixture) -> None:
    """With worker processes the DataLoader draws batches ahead of the steps that train them: the
    first step sees the draws of several batches, the next ones one batch each, and the sampler
    says it cannot keep count (docs/data.md)."""
    s, m = sampler(64)
    loader = DataLoader(
        TensorDataset(torch.arange(64)), batch_size=4, sampler=s, num_workers=1, prefetch_factor=2
    )
    it = iter(loader)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            next(it)
            commit(m)
        assert s.position > 0
    assert "worker processes" in caplog.text
    del it

"""LocalSGD and (Streaming) DiLoCo on one process: a Manager on a FakeProcessGroup and a scripted
lighthouse (tests/unit/test_manager_protocol.py's fakes), so each rule of a sync point is pinned down
exactly: when the quorum and the collectives happen, what a failed sync drops, what a join and a
heal load, and that the arithmetic equals a plain single-process reference of the algorithm.

tests/processes/test_diloco_mp.py runs the same algorithms with real processes, sockets and kills.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_manager_protocol import MemoryTransport, ScriptedLighthouse, in_step, peer, quorum
from torch import nn

from ftlaunch import env
from ftlaunch.errors import QuorumTimeoutError
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.worker.fragments import split_fragments
from ftlaunch.worker.local_sgd import LINEAGE_END, STATE_KEY, DiLoCo, LocalSGD
from ftlaunch.worker.manager import Manager
from ftlaunch.worker.recovery import MANAGER_STATE_KEY
from ftlaunch.worker.sync_point import Buckets

pytestmark = pytest.mark.timeout(60)

MAX, SUM, MIN = dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.MIN


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Manager, FakeProcessGroup]]]:
    for var in (
        env.RANK,
        env.WORLD_SIZE,
        env.MASTER_ADDR,
        env.MASTER_PORT,
        env.TORCHELASTIC_RESTART_COUNT,
        env.REPLICA_GROUP_ID,
        env.FTLAUNCH_LIGHTHOUSE,
        env.TORCHFT_LIGHTHOUSE,
    ):
        monkeypatch.delenv(var, raising=False)
    made: list[tuple[Manager, FakeProcessGroup]] = []

    def make(
        client: ScriptedLighthouse, replica_id: str = "rg0", **kwargs: Any
    ) -> tuple[Manager, FakeProcessGroup]:
        pg = FakeProcessGroup()
        m = Manager(
            pg=pg, load_state_dict=None, state_dict=None, replica_id=replica_id, rank=0, world_size=1,
            group_store=dist.HashStore(), store_addr="10.0.0.1", store_port=29500, quorum_client=client,
            checkpoint_transport=MemoryTransport(replica_id, pg), **{"timeout": 5.0, **kwargs},
        )  # fmt: skip
        made.append((m, pg))
        return m, pg

    yield make
    for m, pg in made:
        m.shutdown()
        if pg._is_registered():
            pg.unregister()


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def inner_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    opt.step()


def flat(params: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def reference_diloco(
    model: nn.Module,
    fragments: list[list[nn.Parameter]],
    inner: torch.optim.Optimizer,
    outer: torch.optim.Optimizer,
    data: list,
    sync_every: int,
    delay: int,
    alpha: float,
) -> int:
    """Streaming DiLoCo written out plainly for one group: no Manager, no buckets, no hooks."""
    interval = sync_every // len(fragments)
    global_ = [[p.detach().clone() for p in f] for f in fragments]
    pseudo: list[torch.Tensor] = []
    local_step, syncs = 0, 0
    for batch in data:
        inner_step(model, inner, batch)
        local_step += 1
        k = syncs % len(fragments)
        if local_step == interval - delay:
            pseudo = [g - p.detach() for g, p in zip(global_[k], fragments[k], strict=True)]
        if local_step == interval:
            with torch.no_grad():
                local = [p.detach().clone() for p in fragments[k]]
                for p, g in zip(fragments[k], global_[k], strict=True):
                    p.copy_(g)
                for p in model.parameters():
                    p.grad = None
                for p, d in zip(fragments[k], pseudo, strict=True):
                    p.grad = d
                outer.step()
                global_[k] = [p.detach().clone() for p in fragments[k]]
                for p, mine in zip(fragments[k], local, strict=True):
                    p.lerp_(mine, alpha)
            syncs += 1
            local_step = 0
    return syncs


# ------------------------------------------------------------------------------ the arithmetic


@pytest.mark.parametrize(
    "sync_every, n_fragments, delay, alpha", [(6, 1, 0, 0.0), (6, 2, 1, 0.0), (12, 3, 2, 0.5)]
)
def test_diloco_alone_equals_the_single_process_reference_bit_for_bit(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
    sync_every: int,
    n_fragments: int,
    delay: int,
    alpha: float,
) -> None:
    data = batches(37)
    ref = mlp()
    ref_frags = [list(f.parameters()) for f in split_fragments(ref, n_fragments)]
    ref_inner = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_outer = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    ref_syncs = reference_diloco(ref, ref_frags, ref_inner, ref_outer, data, sync_every, delay, alpha)

    m, _ = manager(ScriptedLighthouse(in_step(1)))
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(m, split_fragments(model, n_fragments), inner, outer, sync_every=sync_every,
                fragment_sync_delay=delay, fragment_update_alpha=alpha) as d:  # fmt: skip
        for batch in data:
            inner_step(model, inner, batch)
    assert d.syncs == ref_syncs == 37 // (sync_every // n_fragments)
    assert torch.equal(flat(model.parameters()), flat(ref.parameters()))
    assert m.current_step() == d.syncs + 1  # the join committed a step too


def test_diloco_with_outer_sgd_lr_1_is_local_sgd(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    """global - 1 x (global - local) = local: the outer step hands back the inner loop's result."""
    data = batches(20)
    m1, _ = manager(ScriptedLighthouse(in_step(1)))
    m2, _ = manager(ScriptedLighthouse(in_step(1, us="rg9")), replica_id="rg9")
    a, b = mlp(), mlp()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    with DiLoCo(m1, a, opt_a, torch.optim.SGD(a.parameters(), lr=1.0), sync_every=5), \
         LocalSGD(m2, b, opt_b, sync_every=5):  # fmt: skip
        for batch in data:
            inner_step(a, opt_a, batch)
            inner_step(b, opt_b, batch)
    torch.testing.assert_close(flat(a.parameters()), flat(b.parameters()), rtol=0, atol=1e-6)


def test_the_outer_step_touches_only_the_synced_fragment(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    """One outer optimizer over the whole model; the other fragments still hold inner gradients."""
    m, _ = manager(ScriptedLighthouse(in_step(1)))
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    frags = split_fragments(model, 2)
    with DiLoCo(m, frags, inner, outer, sync_every=4) as d:
        for batch in batches(2):
            inner_step(model, inner, batch)
        grads_before = [p.grad.clone() for p in model.parameters()]
        assert d.syncs == 1  # fragment 0 synced after 2 steps
    # Momentum state exists only for what the outer optimizer stepped: fragment 0.
    assert {id(p) for p in outer.state} == {id(p) for p in frags[0].parameters()}
    # and the inner gradients are back where the user left them
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads_before, strict=True))


# ------------------------------------------------------------------------------ the schedule


def test_each_sync_point_is_one_quorum_one_agreement_the_fragment_buckets_and_one_vote(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    m, pg = manager(lighthouse, init_sync=False)
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    d = DiLoCo(m, split_fragments(model, 2), inner, outer, sync_every=8, fragment_sync_delay=1,
               bucket_cap_mb=100 * 4 / 2**20)  # fmt: skip
    with d:
        d.join()
        # The join: a quorum, the agreement (nobody has anything yet) and the vote; no buckets.
        assert len(lighthouse.asked) == 1
        assert [op.reduce_op for op in pg.ops] == [MAX, MIN]
        pg.ops.clear()
        data = iter(batches(8))
        for _ in range(2):
            inner_step(model, inner, next(data))
        assert pg.ops == [] and len(lighthouse.asked) == 1  # inner steps never talk
        inner_step(model, inner, next(data))  # step 3 = 4 - delay: the sync of fragment 0 starts
        assert len(lighthouse.asked) == 2
        assert pg.ops[0].reduce_op == MAX and pg.ops[0].inputs[0].tolist()[:2] == [1, 0]  # SYNC, 0 syncs
        nbuckets = len(pg.ops) - 1
        assert nbuckets > 1 and all(op.reduce_op == SUM for op in pg.ops[1:])  # small buckets: several
        assert sum(op.inputs[0].numel() for op in pg.ops[1:]) == sum(
            p.numel() for p in d._fragments[0].params
        )
        assert d.syncs == 0
        inner_step(model, inner, next(data))  # step 4: the outer step, after the vote
        assert pg.ops[-1].reduce_op == MIN and d.syncs == 1
        pg.ops.clear()
        for _ in range(4):
            inner_step(model, inner, next(data))
        # fragment 1 (the agreement carries the sync count: 1)
        assert pg.ops[0].inputs[0].tolist()[:2] == [1, 1]
        assert sum(op.inputs[0].numel() for op in pg.ops[1:-1]) == sum(
            p.numel() for p in d._fragments[1].params
        )
        assert d.syncs == 2 and m.current_step() == 3 and len(lighthouse.asked) == 3


def test_a_failed_sync_drops_the_fragments_local_progress_and_retries_it(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(1, "rg1"), in_step(2, "rg1"))
    m, pg = manager(lighthouse, init_sync=False)
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    frags = split_fragments(model, 2)
    with DiLoCo(m, frags, inner, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=4) as d:
        start = [flat(f.parameters()) for f in frags]
        data = iter(batches(4))
        inner_step(model, inner, next(data))
        pg.fail_next("allreduce")  # the agreement of the first sync fails (a peer died)
        inner_step(model, inner, next(data))
        assert d.syncs == 0 and m.errored() is not None
        # Fragment 0 is back at its global parameters; fragment 1 keeps its inner progress.
        assert torch.equal(flat(frags[0].parameters()), start[0])
        assert not torch.equal(flat(frags[1].parameters()), start[1])
        pg.ops.clear()
        inner_step(model, inner, next(data))
        inner_step(model, inner, next(data))
        assert pg.ops[0].inputs[0].tolist()[:2] == [1, 0]  # fragment 0 again, on the new quorum
        assert d.syncs == 1 and m.errored() is None
    assert [c[0].rsplit("/", 1)[0][-2:] for c in pg.configure_calls] == ["q1", "q2"]


def test_local_sgd_averages_every_sync_every_steps_and_keeps_local_weights_when_a_sync_fails(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(1, "rg1"), in_step(2, "rg1"))
    m, pg = manager(lighthouse, init_sync=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(m, model, opt, sync_every=3) as algo:
        algo.join()
        assert [op.reduce_op for op in pg.ops] == [SUM, MIN]  # the join is a sync: one bucket
        pg.ops.clear()
        data = iter(batches(6))
        inner_step(model, opt, next(data))
        inner_step(model, opt, next(data))
        assert pg.ops == [] and algo.local_step == 2
        pg.fail_next("allreduce")
        inner_step(model, opt, next(data))
        before = flat(model.parameters())
        assert m.errored() is not None and algo.local_step == 0
        for _ in range(3):
            inner_step(model, opt, next(data))
        assert m.errored() is None and m.current_step() == 2
    assert not torch.equal(before, flat(model.parameters()))


def test_a_quorum_timeout_at_a_sync_point_is_asked_again(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    """Peers may still be in their inner loop for longer than the quorum timeout: not a failure."""
    lighthouse = ScriptedLighthouse(
        QuorumTimeoutError("no quorum in 1s"), QuorumTimeoutError("again"), in_step(1)
    )
    m, _ = manager(lighthouse)
    model = mlp()
    with LocalSGD(m, model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2) as algo:
        algo.join()
        assert len(lighthouse.asked) == 3 and m.current_step() == 1


# ------------------------------------------------------------------------------ join and heal


def test_a_joining_group_heals_the_global_parameters_outer_state_and_schedule_after_the_vote(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    # What the source serves: a DiLoCo two syncs in, at manager step 5.
    src_model = mlp(seed=3)
    src_inner = torch.optim.SGD(src_model.parameters(), lr=0.1)
    src_outer = torch.optim.SGD(src_model.parameters(), lr=0.7, momentum=0.9)
    m_src, _ = manager(ScriptedLighthouse(in_step(1, us="rg7")), replica_id="rg7")
    with DiLoCo(m_src, split_fragments(src_model, 2), src_inner, src_outer, sync_every=4) as src:
        for batch in batches(4):
            inner_step(src_model, src_inner, batch)
    assert src.syncs == 2 and src_outer.state
    served = {
        MANAGER_STATE_KEY: {"step": 5, "batches_committed": 5},
        **copy.deepcopy(src.heal_entries()),
    }

    lighthouse = ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1"))
    m, pg = manager(lighthouse, replica_id="rg1")
    m._transport.inbox[("mem://rg0", 5)] = served  # type: ignore[attr-defined]
    model = mlp(seed=4)  # different weights from the source's
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    d = DiLoCo(m, split_fragments(model, 2), inner, outer, sync_every=4)
    with d:
        d.join()
    assert pg.ops[0].reduce_op == MAX and pg.ops[0].inputs[0].tolist() == [
        0,
        0,
        0,
        0,
    ]  # a healer contributes zeros
    assert d.syncs == 2 and m.current_step() == 6
    # It starts its inner loop from the healed global parameters, with the source's outer state.
    assert torch.equal(flat(model.parameters()), flat(src.global_parameters().values()))
    assert torch.equal(flat(d.global_parameters().values()), flat(src.global_parameters().values()))
    for p_src, p in zip(src_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(src_outer.state[p_src]["momentum_buffer"], outer.state[p]["momentum_buffer"])


@pytest.mark.parametrize("inside_step", [True, False], ids=["join-in-first-step", "join-before-steps"])
@pytest.mark.parametrize("sync_every, n_fragments, delay", [(4, 2, 1), (6, 1, 2), (6, 2, 0), (2, 2, 0)])
def test_a_group_joining_running_peers_keeps_their_schedule_step_for_step(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
    sync_every: int,
    n_fragments: int,
    delay: int,
    inside_step: bool,
) -> None:
    """Running peers took the join's quorum at inner step ``interval - delay`` and vote on it at
    inner step ``interval``. A join in the first training step (its forward) is in the peers' step
    that ends with that vote; one before any step (``join()``) is after it. Either way, after every
    inner step the group has the peers' sync count, inner step, Manager step and quorums, so a
    training loop that stops at a Manager step stops in every group instead of leaving the joined
    one asking for a quorum nobody else asks for."""
    interval = sync_every // n_fragments
    prepare_at = interval - delay
    # What the peer serves: a Streaming DiLoCo of the same shape, some syncs in.
    src_model = mlp(seed=3)
    src_inner = torch.optim.SGD(src_model.parameters(), lr=0.1)
    m_src, _ = manager(ScriptedLighthouse(in_step(1, us="rg7")), replica_id="rg7")
    with DiLoCo(m_src, split_fragments(src_model, n_fragments), src_inner,
                torch.optim.SGD(src_model.parameters(), lr=0.7), sync_every=sync_every,
                fragment_sync_delay=delay) as src:  # fmt: skip
        for batch in batches(sync_every):
            inner_step(src_model, src_inner, batch)
    served = {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 5}, **copy.deepcopy(src.heal_entries())}
    peer_syncs, lineage = served[STATE_KEY]["syncs"], served[STATE_KEY]["lineage"]

    lighthouse = ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1"), in_step(4, "rg0", us="rg1"))
    m, _ = manager(lighthouse, replica_id="rg1")
    m._transport.inbox[("mem://rg0", 5)] = served  # type: ignore[attr-defined]
    model = mlp(seed=4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(m, split_fragments(model, n_fragments), inner, torch.optim.SGD(model.parameters(), lr=0.7),
               sync_every=sync_every, fragment_sync_delay=delay)  # fmt: skip
    real_allreduce = m.allreduce

    def allreduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The peer's part of each agreement: a sync, with the job's sync count and lineage."""
        out = real_allreduce(t, *args, **kwargs)
        if t.dtype == torch.int64 and kwargs.get("reduce_op") == MAX:
            out.wait()
            syncs = max(d.syncs, peer_syncs)  # ours is stale until the join heals it
            t.copy_(torch.maximum(t, torch.tensor([1, syncs, lineage, LINEAGE_END - lineage])))
        return out

    m.allreduce = allreduce  # type: ignore[method-assign]
    # The peer right after the inner step at which it voted on the joined sync: inner step, syncs,
    # Manager step, quorums taken since.
    theirs = [0, peer_syncs + 1, 6, 1]
    with d:
        if not inside_step:
            d.join()
            assert [d.local_step, d.syncs, m.current_step(), len(lighthouse.asked)] == theirs
        for i, batch in enumerate(batches(2 * interval + 1)):
            inner_step(model, inner, batch)  # the first one joins, if not joined yet
            if i > 0 or not inside_step:  # the peer's next inner step, by its schedule
                theirs[0] += 1
                theirs[3] += theirs[0] == prepare_at
                if theirs[0] == interval:
                    theirs[:3] = [0, theirs[1] + 1, theirs[2] + 1]
            assert [d.local_step, d.syncs, m.current_step(), len(lighthouse.asked)] == theirs


@pytest.mark.parametrize("peers", ["at-their-sync", "joining-too"])
@pytest.mark.parametrize("inside_step", [True, False], ids=["join-in-first-step", "join-before-steps"])
@pytest.mark.parametrize("sync_every", [1, 2, 3])
def test_a_local_sgd_group_joining_peers_keeps_their_schedule_step_for_step(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]], sync_every: int, inside_step: bool, peers: str
) -> None:
    """LocalSGD's peers take a quorum and vote in the inner step that reaches ``sync_every``. A
    join in the first training step (its forward) meets running peers in the step of theirs that
    ends with that sync, so its inner step counts as that one; one before any step (``join()``) is
    after it. Peers that are joining too (a resumed job; a group behind heals from them) bring no
    sync: everyone's step is a first step. In every case, after every inner step the group has the
    peers' inner step, Manager step and quorums, so a training loop that stops at a Manager step
    stops in every group instead of leaving the joined one asking for a quorum nobody else asks
    for. The peer's contributions are what a real LocalSGD sends at that point."""
    # What the peer sends: a real LocalSGD (alone), at its join and at its next sync.
    src_model = mlp(seed=3)
    src_opt = torch.optim.SGD(src_model.parameters(), lr=0.1)
    m_src, _ = manager(ScriptedLighthouse(in_step(1, us="rg7")), replica_id="rg7")
    sent: list[torch.Tensor] = []
    src_allreduce = m_src.allreduce

    def capture(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(t.detach().clone())
        return src_allreduce(t, *args, **kwargs)

    m_src.allreduce = capture  # type: ignore[method-assign]
    with LocalSGD(m_src, src_model, src_opt, sync_every=sync_every) as src:
        src.join()
        at_join = list(sent)
        sent.clear()
        for batch in batches(sync_every, seed=2):
            inner_step(src_model, src_opt, batch)
    peer_sends = at_join if peers == "joining-too" else sent
    assert peer_sends and m_src.current_step() == 2

    lighthouse = ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1"), in_step(4, "rg0", us="rg1"))
    m, _ = manager(lighthouse, replica_id="rg1")
    m._transport.inbox[("mem://rg0", 5)] = {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 5}}  # type: ignore[attr-defined]
    model = mlp(seed=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = LocalSGD(m, model, opt, sync_every=sync_every)
    real_allreduce = m.allreduce

    def allreduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The peer's part of each average (the fake group sums ours alone): what it sends, / n."""
        out = real_allreduce(t, *args, **kwargs)
        out.wait()
        theirs = next(b for b in peer_sends if b.shape == t.shape and b.dtype == t.dtype)
        t.add_(theirs / m.num_participants())
        return out

    m.allreduce = allreduce  # type: ignore[method-assign]
    # The peer right after the inner step at which it synced with the join (or after its own join):
    # inner step, Manager step, quorums taken since.
    theirs = [0, 6, 1]
    with algo:
        if not inside_step:
            algo.join()
            assert [algo.local_step, m.current_step(), len(lighthouse.asked)] == theirs
        for i, batch in enumerate(batches(2 * sync_every + 1)):
            inner_step(model, opt, batch)  # the first one joins, if not joined yet
            if i > 0 or not inside_step or peers == "joining-too":  # the peer's next inner step
                theirs[0] += 1
                if theirs[0] == sync_every:
                    theirs = [0, theirs[1] + 1, theirs[2] + 1]
            assert [algo.local_step, m.current_step(), len(lighthouse.asked)] == theirs, f"inner step {i}"


def test_the_join_runs_at_the_first_forward_after_entering_so_state_functions_see_the_bound_name(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    """``with DiLoCo(...) as d:`` binds ``d`` after entering; a healing join calls the state
    functions, which may read ``d``. The join waits for the first forward, and heals before it
    reads a parameter."""
    src_model = mlp(seed=3)
    src_inner = torch.optim.SGD(src_model.parameters(), lr=0.1)
    m_src, _ = manager(ScriptedLighthouse(in_step(1, us="rg7")), replica_id="rg7")
    with DiLoCo(
        m_src, src_model, src_inner, torch.optim.SGD(src_model.parameters(), lr=0.7), sync_every=2
    ) as src:
        for batch in batches(2):
            inner_step(src_model, src_inner, batch)
    served = {MANAGER_STATE_KEY: {"step": 3, "batches_committed": 3}, "mine": {"seen": 1},
              **copy.deepcopy(src.heal_entries())}  # fmt: skip

    lighthouse = ScriptedLighthouse(quorum(3, peer("rg0", 3), us="rg1"))
    m, _ = manager(lighthouse, replica_id="rg1")
    m._transport.inbox[("mem://rg0", 3)] = served  # type: ignore[attr-defined]
    model = mlp(seed=4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    holder: dict[str, DiLoCo | None] = {"d": None}
    loaded = []

    def load(sd: dict[str, Any]) -> None:
        assert holder["d"] is not None, "the state function ran before the with statement bound its name"
        loaded.append(sd)

    m.register_state_dict_fn("mine", load, lambda: {"seen": 0})
    x = torch.randn(3, 8)
    with DiLoCo(m, model, inner, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=2) as d:
        holder["d"] = d
        assert lighthouse.asked == [] and not d.joined
        out = model(x)
        assert d.joined and len(lighthouse.asked) == 1 and loaded == [{"seen": 1}]
    # The forward already ran on the healed parameters.
    healed = mlp(seed=4)
    torch.nn.utils.vector_to_parameters(flat(src.global_parameters().values()), healed.parameters())
    assert torch.equal(out, healed(x))


def test_a_group_needed_for_min_replica_size_heals_at_a_sync_that_has_too_few_and_commits_the_next(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    """Two groups, min_replica_size=2, one restarted: the survivor alone is too few to commit, and
    a live healer loads only after a clean vote. The clean sync with too few still lets it load,
    so the next sync has both groups up to date and commits (else neither ever commits again)."""
    src_model = mlp(seed=3)
    src_inner = torch.optim.SGD(src_model.parameters(), lr=0.1)
    m_src, _ = manager(ScriptedLighthouse(in_step(1, us="rg7")), replica_id="rg7")
    with DiLoCo(
        m_src, src_model, src_inner, torch.optim.SGD(src_model.parameters(), lr=0.7), sync_every=2
    ) as src:
        for batch in batches(2):
            inner_step(src_model, src_inner, batch)
    served = {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 5}, **copy.deepcopy(src.heal_entries())}

    lighthouse = ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1"), in_step(4, "rg0", us="rg1"))
    m, pg = manager(lighthouse, replica_id="rg1", min_replica_size=2)
    m._transport.inbox[("mem://rg0", 5)] = served  # type: ignore[attr-defined]
    model = mlp(seed=4)
    inner, outer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.7)
    d = DiLoCo(m, model, inner, outer, sync_every=2)
    with d:
        d.join()
    assert len(lighthouse.asked) == 2 and [a.step for a in lighthouse.asked] == [0, 5]
    assert m.current_step() == 6 and d.syncs == src.syncs
    assert torch.equal(flat(model.parameters()), flat(src.global_parameters().values()))


def test_the_join_runs_at_the_first_inner_step_when_no_forward_came_first(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    m, _ = manager(lighthouse, init_sync=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(m, model, opt, sync_every=5) as algo:
        assert not algo.joined
        opt.step()  # no gradients: a no-op step, after the join
        assert algo.joined and len(lighthouse.asked) == 1 and algo.local_step == 1


def test_split_histories_are_never_committed_and_the_older_lineage_heals_at_the_next_sync(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    """Two sets of groups that each formed their first quorum alone meet at the same step with
    different global parameters: the agreement sees two lineages, nobody commits, and the groups
    of the older one fall back to step 0 so that the next quorum heals them."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg0", us="rg1"))
    m, pg = manager(lighthouse, replica_id="rg1", init_sync=False)
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(m, model, inner, torch.optim.SGD(model.parameters(), lr=0.7), sync_every=2)
    real_allreduce = m.allreduce
    newer_peer = [True]

    def allreduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real_allreduce(t, *args, **kwargs)
        if t.dtype == torch.int64 and newer_peer[0]:  # a peer of another lineage, newer than ours
            out.wait()
            t[2] = LINEAGE_END - 1
        return out

    with d:
        d.join()
        assert m.current_step() == 1
        m.allreduce = allreduce  # type: ignore[method-assign]
        pg.ops.clear()
        for batch in batches(2):
            inner_step(model, inner, batch)
        assert [op.reduce_op for op in pg.ops] == [MAX, MIN]  # no pseudo-gradients exchanged
        assert d.syncs == 0 and m.current_step() == 0  # behind now: the next quorum heals us
        newer_peer[0] = False
        served = copy.deepcopy(d.heal_entries())
        served[STATE_KEY]["lineage"], served[STATE_KEY]["syncs"] = 12345, 7
        m._transport.inbox[("mem://rg0", 1)] = {  # type: ignore[attr-defined]
            MANAGER_STATE_KEY: {"step": 1, "batches_committed": 1}, **served,
        }  # fmt: skip
        lighthouse.answers = [quorum(9, peer("rg0", 1), us="rg1")]
        for batch in batches(2):
            inner_step(model, inner, batch)
        assert d.state_dict()["lineage"] == 12345 and m.current_step() == 2


def test_a_join_that_does_not_commit_is_asked_again(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1"))
    m, pg = manager(lighthouse, init_sync=False)
    pg.fail_next("allreduce")
    model = mlp()
    with DiLoCo(m, model, torch.optim.SGD(model.parameters(), lr=0.1),
                torch.optim.SGD(model.parameters(), lr=0.7), sync_every=2) as d:  # fmt: skip
        d.join()
        assert len(lighthouse.asked) == 2 and m.current_step() == 1


def test_state_dict_round_trip_restarts_the_model_from_the_global_parameters(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]],
) -> None:
    m, _ = manager(ScriptedLighthouse(in_step(1)))
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(m, split_fragments(model, 2), inner, torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9),
               sync_every=4)  # fmt: skip
    with d:
        for batch in batches(5):
            inner_step(model, inner, batch)
    sd = copy.deepcopy(d.state_dict())
    assert not torch.equal(flat(model.parameters()), flat(d.global_parameters().values()))  # 1 local step
    d.load_state_dict(sd)
    assert torch.equal(flat(model.parameters()), flat(d.global_parameters().values())) and d.syncs == 2


# ------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sync_every": 5, "fragments": 2}, "multiple of the number of fragments"),
        ({"sync_every": 1, "fragments": 2}, "multiple of the number of fragments"),
        ({"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, "less than sync_every / fragments"),
        ({"sync_every": 4, "fragment_update_alpha": 1.5}, r"in \[0, 1\]"),
        ({"sync_every": 4, "should_quantize": 3}, "True, 8 or 4"),
        ({"sync_every": 4, "same_optimizer": True}, "must not be the inner optimizer"),
        ({"sync_every": 4, "shared": True}, "share a parameter"),
    ],
)
def test_diloco_rejects_what_cannot_work(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]], kwargs: dict, match: str
) -> None:
    m, _ = manager(ScriptedLighthouse(in_step(1)))
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = inner if kwargs.pop("same_optimizer", False) else torch.optim.SGD(model.parameters(), lr=0.7)
    frags: list[nn.Module] = split_fragments(model, kwargs.pop("fragments", 1))
    if kwargs.pop("shared", False):
        frags = [model, model[0]]
        kwargs["sync_every"] = 4
    with pytest.raises(ValueError, match=match):
        DiLoCo(m, frags, inner, outer, **kwargs)


def test_split_fragments_is_contiguous_balanced_and_never_empty() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    params = list(model.parameters())
    for n in range(1, len(params) + 1):
        frags = [list(f.parameters()) for f in split_fragments(model, n)]
        assert [p for f in frags for p in f] == params and all(frags)
    sizes = [sum(p.numel() for p in f.parameters()) for f in split_fragments(model, 2)]
    assert sizes == [64 * 256 + 256, 256 * 256 + 256 + 256 * 8 + 8]
    with pytest.raises(ValueError):
        split_fragments(model, len(params) + 1)


def test_buckets_pack_by_dtype_and_cap_and_views_alias_the_buffers() -> None:
    ts = [torch.zeros(10), torch.zeros(3, 4), torch.zeros(5, dtype=torch.float64), torch.zeros(100)]
    b = Buckets(ts, cap_mb=(10 + 12 + 20) * 4 / 2**20)
    assert [buf.numel() for buf in b.buffers] == [22, 5, 100]
    assert [v.shape for v in b.views] == [t.shape for t in ts]
    b.views[1].fill_(7.0)
    assert b.buffers[0][10:22].eq(7.0).all() and b.views[1].data_ptr() == b.buffers[0][10:].data_ptr()
    assert [buf.numel() for buf in Buckets(ts, cap_mb=None).buffers] == [10, 12, 5, 100]


# ------------------------------------------------------------------------------ the two-line form


def test_ft_diloco_takes_what_is_not_passed_from_the_environment(
    manager: Callable[..., tuple[Manager, FakeProcessGroup]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ftlaunch.worker.entry import FaultTolerance

    m, pg = manager(ScriptedLighthouse(in_step(1)))
    ft = FaultTolerance(manager=m, pg=pg, replica_group_id=0, num_replica_groups=1, rank=0, world_size=1,
                        device=torch.device("cpu"), backend="gloo", transport="pg",
                        timeouts=m.timeouts)  # fmt: skip
    for var, value in ((env.FTLAUNCH_SYNC_EVERY, "12"), (env.FTLAUNCH_FRAGMENTS, "3"),
                       (env.FTLAUNCH_FRAGMENT_SYNC_DELAY, "1"), (env.FTLAUNCH_FRAGMENT_UPDATE_ALPHA, "0.25"),
                       (env.FTLAUNCH_QUANTIZE, "4")):  # fmt: skip
        monkeypatch.setenv(var, value)
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = ft.diloco(model, inner, torch.optim.SGD(model.parameters(), lr=0.7))
    assert (d.sync_interval, len(d._fragments), d._prepare_at, d._alpha, d._should_quantize) == (
        4,
        3,
        3,
        0.25,
        4,
    )
    assert m.current_step() == 1  # entered: it has joined
    d2 = ft.local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=5)  # an argument wins
    assert d2._sync_every == 5 and m.current_step() == 2
    monkeypatch.setenv(env.FTLAUNCH_FRAGMENT_UPDATE_ALPHA, "half")
    with pytest.raises(ValueError, match="FTLAUNCH_FRAGMENT_UPDATE_ALPHA='half' is not a number"):
        ft.diloco(model, inner, torch.optim.SGD(model.parameters(), lr=0.7))

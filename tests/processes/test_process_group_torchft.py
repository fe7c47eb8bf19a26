"""torchft's process-group API as torchft ships it today, on ftlaunch's groups.

- set-up: the documented ``configure(store_addr, rank, world_size)``, the 2025 form with a
  ``replica_id``, and the current reconfigure family (handles, ``ReconfigureOptions``,
  ``pg.reconfigure(opts)``, ``reconfigure_with_store``), checked like torchft's own tests: a
  3 -> 2 -> 3 resize across real processes, then an abort and a recovery;
- small semantics: ``ProcessGroupDummy`` fills gather outputs (torch's DDP and
  ``all_gather_object`` over it work), ``WORK_CLASS``, ``ProcessGroupNCCL(pg=...)``,
  ``ProcessGroupBabyNCCL`` constructible without CUDA, ``reduce``/``gather``/``scatter`` on the
  groups that tests/processes/test_process_group.py does not run against torch's gloo.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pg_scenarios as sc
import pytest
import torch
import torch.distributed as dist
from pg_helpers import WorkerPool, start_unmarked_resource_tracker
from torch import nn
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    ReconfigureOptions,
    reconfigure_with_store,
)
from ftlaunch.process_group.baby import BabyWork, BabyWorkNCCL
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.process_group.reconfigure import NativeReconfigureOptions, decode_handle, rendezvous_of

start_unmarked_resource_tracker()

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store() -> Any:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield server
    del server
    gc.collect()


def addr(server: dist.TCPStore, prefix: str) -> str:
    return f"127.0.0.1:{server.port}/{prefix}"


def options(uuid: int, handles: list[str], timeout: timedelta | None = None) -> Any:
    opts = ReconfigureOptions()
    opts.uuid = uuid
    opts.handles = handles
    opts.timeout = timeout
    return opts


# ------------------------------------------------------------------------------------------------
# the reconfigure family
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["gloo", "baby"])
def test_reconfigure_with_store_resizes_and_recovers_across_processes(
    kind: str, store: dist.TCPStore
) -> None:
    """torchft's resize test: members [0,1,2] -> [2,0] -> [1,2,0], then abort and recover."""
    with WorkerPool(3) as pool:
        children = pool.run([0, 1, 2], sc.make_pg, [(kind,)] * 3)
        for generation, members in enumerate(([0, 1, 2], [2, 0], [1, 2, 0])):
            world = len(members)
            results = pool.run(
                members,
                sc.reconfigure_via_store,
                [(addr(store, f"resize/{generation}"), k, world, 10 + w) for k, w in enumerate(members)],
                timeout=120,
            )
            for k, res in enumerate(results):
                assert (res["rank"], res["size"]) == (k, world), (generation, res)
                assert res["sum"] == world * (world + 1) / 2, (generation, res)
                assert res["global_ranks"] == [10 + w for w in members]
                assert not res["errored"]
            if kind == "baby":  # reconfigured in place: the same healthy child every time
                assert [r["child"] for r in results] == [children[w] for w in members]
        # An abort does not lose the group or its handle: the next reconfigure rebuilds it.
        pool.run([0, 1, 2], sc.abort_pg, [()] * 3)
        results = pool.run(
            [0, 1, 2],
            sc.reconfigure_via_store,
            [(addr(store, "recovery"), k, 3, k) for k in range(3)],
            timeout=120,
        )
        assert [r["sum"] for r in results] == [6.0] * 3
        pool.run([0, 1, 2], sc.shutdown_pg, [()] * 3)


def test_reconfigure_between_threads_of_one_process(store: dist.TCPStore) -> None:
    """torchft's in-process check: two groups, two generations, an all-reduce each time."""
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=20)) for _ in range(2)]

    def run(rank: int) -> float:
        value = 0.0
        for generation in range(2):
            reconfigure_with_store(
                pgs[rank], addr(store, f"threads/{generation}"), rank, 2, timedelta(seconds=20)
            )
            t = torch.tensor([float(rank + 1)])
            pgs[rank].allreduce([t], dist.ReduceOp.SUM).wait()
            value = t.item()
        return value

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            assert list(pool.map(run, range(2))) == [3.0, 3.0]
        assert [pg.size() for pg in pgs] == [2, 2] and sorted(pg.rank() for pg in pgs) == [0, 1]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_options_type_is_torchs_when_it_has_one() -> None:
    if NativeReconfigureOptions is not None:
        assert ReconfigureOptions is NativeReconfigureOptions
    opts = options(7, ["a"], timedelta(seconds=3))
    assert (opts.uuid, list(opts.handles), opts.timeout) == (7, ["a"], timedelta(seconds=3))


def test_handles_identify_groups_and_fix_the_rendezvous() -> None:
    pgs = [ProcessGroupDummy(0, 1) for _ in range(2)]
    try:
        assert all(pg.supports_reconfigure for pg in pgs)
        pgs[0].set_rank_info("0", 1, 2, 3)
        pgs[1].set_rank_info("1", 1, 2, 5)
        handles = [pg.get_reconfigure_handle() for pg in pgs]
        assert handles[0] != handles[1]
        store = json.loads(handles[0])["store"]
        assert decode_handle(handles[0]).store == store

        rdv = rendezvous_of(options(7, handles), pgs[1]._reconfigure_id)
        assert (rdv.store_addr, rdv.rank, rdv.world_size, rdv.global_ranks) == (
            f"{store}/ftlaunch/reconfigure/7",
            1,
            2,
            [3, 5],
        )

        # A handle names the group whatever its rank info; the order of the handles is the ranks.
        pgs[0].set_rank_info("0", 1, 2, None)
        swapped = [pgs[1].get_reconfigure_handle(), pgs[0].get_reconfigure_handle()]
        rdv = rendezvous_of(options(8, swapped), pgs[0]._reconfigure_id)
        assert rdv.rank == 1 and rdv.global_ranks is None
        assert rdv.store_addr.startswith(json.loads(swapped[0])["store"])

        # reconfigure() = configure() with that rank and size (the Dummy records it).
        pgs[0].reconfigure(options(9, swapped)).wait()
        assert (pgs[0].rank(), pgs[0].size(), pgs[0].configure_count) == (1, 2, 1)

        # Misuse is a ValueError at the call, before anything changes.
        with pytest.raises(ValueError, match="handles is empty"):
            pgs[0].reconfigure(options(1, []))
        with pytest.raises(ValueError, match="appears 0 times"):
            pgs[0].reconfigure(options(1, [handles[1]]))
        with pytest.raises(ValueError, match="appears 2 times"):
            pgs[1].reconfigure(options(1, [handles[1], handles[1]]))
        with pytest.raises(ValueError, match="not an ftlaunch reconfigure handle"):
            pgs[0].reconfigure(options(1, ["{}", handles[0]]))
        with pytest.raises(ValueError, match="uuid"):
            pgs[0].reconfigure(options("x", handles))  # type: ignore[arg-type]
        assert pgs[0].configure_count == 1
    finally:
        for pg in pgs:
            pg.shutdown()


def test_every_group_kind_reconfigures_like_it_configures() -> None:
    """The fake and the wrappers get the reconfigure API from the base class too."""
    fake = FakeProcessGroup(0, 1)
    swallow = ErrorSwallowingProcessGroupWrapper(FakeProcessGroup(0, 1))
    other = ProcessGroupDummy(0, 1)
    try:
        for pg in (fake, swallow):
            handles = [other.get_reconfigure_handle(), pg.get_reconfigure_handle()]
            assert pg.reconfigure(options(5, handles)).wait()
            assert (pg.rank(), pg.size()) == (1, 2)
        store = json.loads(other.get_reconfigure_handle())["store"]
        assert fake.configure_calls == [(f"{store}/ftlaunch/reconfigure/5", 1, 2)]
        fake.fail_next("configure")
        work = fake.reconfigure(options(6, [fake.get_reconfigure_handle()]))
        with pytest.raises(CommunicationError, match="configure failed"):
            work.wait()
        assert isinstance(fake.errored(), CommunicationError)
    finally:
        for pg in (fake, swallow, other):
            pg.shutdown()


def test_reconfigure_with_store_fails_fast_when_a_peer_never_comes(store: dist.TCPStore) -> None:
    pg = ProcessGroupDummy(0, 1)
    t0 = time.monotonic()
    with pytest.raises(CommunicationError, match="not every one of 2 members") as info:
        reconfigure_with_store(pg, addr(store, "missing"), 0, 2, timedelta(milliseconds=300))
    assert time.monotonic() - t0 < 10
    assert isinstance(info.value.__cause__, dist.DistStoreError)
    assert pg.configure_count == 0  # never reconfigured on half the members
    # Each reconfiguration gets a uuid of its own (rank 0 draws it).
    reconfigure_with_store(pg, addr(store, "one/a"), 0, 1, timedelta(seconds=5))
    reconfigure_with_store(pg, addr(store, "one/b"), 0, 1, timedelta(seconds=5))
    assert store.get("one/a/uuid") != store.get("one/b/uuid")
    assert pg.configure_count == 2 and pg.size() == 1
    pg.shutdown()


def test_reconfigure_work_gives_up_after_the_options_timeout(store: dist.TCPStore) -> None:
    """A peer that never arrives: wait() raises after opts.timeout, the group is errored and aborted."""
    pg = ProcessGroupGloo(timeout=timedelta(seconds=4))
    peer = ProcessGroupDummy(0, 1)  # its handle is listed, but it never reconfigures
    handles = [pg.get_reconfigure_handle(), peer.get_reconfigure_handle()]
    work = pg.reconfigure(options(11, handles, timeout=timedelta(milliseconds=500)))
    t0 = time.monotonic()
    with pytest.raises(CommunicationError, match="did not complete within"):
        work.wait()
    assert time.monotonic() - t0 < 3
    assert isinstance(pg.errored(), CommunicationError)
    with pytest.raises(CommunicationError):  # the configure itself fails within the group's timeout
        work.get_future().wait()
    assert work.is_completed() and not work.is_success()
    pg.shutdown()
    peer.shutdown()


def test_configure_accepts_torchfts_forms() -> None:
    pg = ProcessGroupDummy(0, 1)
    pg.configure("127.0.0.1:1/a", 0, 2)  # documented
    pg.configure("127.0.0.1:1/b", "replica_7", 1, 2)  # 2025: with replica_id
    pg.configure("127.0.0.1:1/c", replica_id="0", rank=0, world_size=3)  # parameter_server style
    pg.configure("127.0.0.1:1/d", rank=1, world_size=2)
    assert (pg.configure_count, pg.rank(), pg.size(), pg._replica_id) == (4, 1, 2, "0")
    for bad_args, bad_kwargs in [
        ((0,), {}),
        ((0, 1, 2), {}),
        (("r", "s", 1, 2), {}),
        ((0, 1), {"rank": 0}),
        ((0, 1), {"quorum_id": 3}),
        (("r", 0, 1), {"replica_id": "r"}),
    ]:
        with pytest.raises(TypeError):
            pg.configure("127.0.0.1:1/e", *bad_args, **bad_kwargs)
    with pytest.raises(ValueError):
        pg.configure("127.0.0.1:1/f", 2, 2)
    assert pg.configure_count == 4


# ------------------------------------------------------------------------------------------------
# ProcessGroupDummy
# ------------------------------------------------------------------------------------------------


def test_torch_ddp_over_a_dummy_group_trains_like_a_local_model() -> None:
    """torch's DDP checks parameter shapes with an allgather at construction: the outputs must be
    filled. Over a Dummy group DDP then equals the plain module (nothing to average)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    local = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    local.load_state_dict(base.state_dict())
    pg = ProcessGroupDummy(0, 1)
    ddp = nn.parallel.DistributedDataParallel(base, process_group=pg)
    x = torch.randn(5, 6)
    for model in (ddp, local):
        model(x).square().sum().backward()
    for p, q in zip(base.parameters(), local.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_all_gather_object_and_gathers_on_a_dummy_group() -> None:
    pg = ProcessGroupDummy(0, 1)
    objs: list[Any] = [None]
    dist.all_gather_object(objs, {"step": 3, "name": "rg0"}, group=pg)
    assert objs == [{"step": 3, "name": "rg0"}]
    out = [torch.zeros(2)]
    pg.allgather([out], [torch.tensor([1.0, 2.0])]).wait()
    assert out[0].tolist() == [1.0, 2.0]

    # Bigger worlds: every slot gets this rank's own data, reductions change nothing.
    pg3 = ProcessGroupDummy(1, 3)
    x = torch.tensor([4.0, 5.0])
    outs = [torch.zeros(2) for _ in range(3)]
    dist.all_gather(outs, x, group=pg3)
    assert [o.tolist() for o in outs] == [[4.0, 5.0]] * 3
    flat = torch.zeros(6)
    dist.all_gather_single(flat, x, group=pg3)
    assert flat.tolist() == [4.0, 5.0] * 3
    rs = torch.zeros(2)
    dist.reduce_scatter_single(rs, torch.arange(6.0), group=pg3)
    assert rs.tolist() == [2.0, 3.0]  # our own share, unreduced
    a2a = torch.zeros(3)
    dist.all_to_all_single(a2a, torch.tensor([7.0, 8.0, 9.0]), group=pg3)
    assert a2a.tolist() == [8.0, 8.0, 8.0]
    r = torch.ones(2)
    dist.reduce(r, group=pg3, group_dst=0)
    assert r.tolist() == [1.0, 1.0]
    g = [torch.zeros(2) for _ in range(3)]
    dist.gather(x, g, group=pg3, group_dst=1)
    assert [t.tolist() for t in g] == [[4.0, 5.0]] * 3
    s = torch.zeros(1)
    dist.scatter(s, [torch.tensor([float(k)]) for k in range(3)], group=pg3, group_src=1)
    assert s.tolist() == [1.0]
    with pytest.raises(ValueError, match="root rank 3"):
        pg3.reduce([r], 3)


# ------------------------------------------------------------------------------------------------
# rooted ops elsewhere, construction forms
# ------------------------------------------------------------------------------------------------


def test_rooted_ops_on_fake_wrapper_and_error_swallowing_groups() -> None:
    fake = FakeProcessGroup(0, 3)
    t = torch.full((2,), 2.0)
    dist.reduce(t, group=fake, group_dst=0)  # SUM of three identical peers
    assert t.tolist() == [6.0, 6.0]
    outs = [torch.zeros(2) for _ in range(3)]
    dist.gather(torch.ones(2), outs, group=fake, group_dst=0)
    assert [o.tolist() for o in outs] == [[1.0, 1.0]] * 3
    s = torch.zeros(1)
    dist.scatter(s, [torch.tensor([float(k)]) for k in range(3)], group=fake, group_src=0)
    assert s.tolist() == [0.0]
    with pytest.raises(NotImplementedError, match="non-root"):
        dist.scatter(s, None, group=fake, group_src=1)

    wrapped = ProcessGroupWrapper(ProcessGroupDummy(0, 1))
    g = [torch.zeros(1)]
    dist.gather(torch.tensor([3.0]), g, group=wrapped, group_dst=0)
    assert g[0].tolist() == [3.0]

    swallowing = ErrorSwallowingProcessGroupWrapper(FakeProcessGroup(0, 2))
    swallowing.configure("127.0.0.1:1/sw", 0, 2)
    r = torch.ones(1)
    swallowing.reduce([r], 0).wait()
    assert r.tolist() == [2.0]


def test_torchft_construction_forms() -> None:
    inner = ProcessGroupDummy(0, 1)
    nccl = ProcessGroupNCCL(pg=inner)  # documented torchft: wraps an existing group
    nccl.configure("127.0.0.1:1/n", 0, 2)
    assert inner.configure_count == 1 and nccl.size() == 2
    gloo = ProcessGroupGloo(timedelta(seconds=5), pg=ProcessGroupDummy(0, 1))
    gloo.configure("127.0.0.1:1/g", 0, 1)
    assert gloo.allreduce([torch.ones(1)]).wait()
    w = ProcessGroupWrapper(timedelta(seconds=7))  # torchft today: the timeout comes first
    assert w._timeout == timedelta(seconds=7) and w.parent is None
    assert ProcessGroupBaby.WORK_CLASS is BabyWork
    assert ProcessGroupBabyGloo.WORK_CLASS is BabyWork
    assert ProcessGroupBabyNCCL.WORK_CLASS is BabyWorkNCCL
    assert issubclass(ProcessGroupBabyNCCL.WORK_CLASS, dist.Work)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_baby_nccl_is_constructible_without_cuda_until_used() -> None:
    pg = ProcessGroupBabyNCCL(timeout=5.0)
    try:
        assert pg.child_pid is None  # no child started for a group that cannot run here
        with pytest.raises(NotImplementedError, match="needs CUDA"):
            pg.configure("127.0.0.1:1/nccl", 0, 1)
        assert pg.child_pid is None and pg.errored() is None
    finally:
        pg.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("ftlaunch-baby-reader")]


# ------------------------------------------------------------------------------------------------
# what torchft's own process-group tests rely on
# ------------------------------------------------------------------------------------------------


def test_a_peer_that_never_publishes_is_torchs_store_error_as_well(store: dist.TCPStore) -> None:
    # Code written for torch catches DistStoreError; ftlaunch code catches CommunicationError.
    pg = ProcessGroupDummy(0, 1)
    with pytest.raises(dist.DistStoreError) as info:
        reconfigure_with_store(pg, addr(store, "alone"), 1, 3, timedelta(milliseconds=200))
    assert isinstance(info.value, CommunicationError) and pg.reconfigure_count == 0
    pg.shutdown()


def test_a_wrapper_names_its_group_and_a_reconfigure_reaches_it() -> None:
    inner = ProcessGroupDummy(0, 1)
    wrapper = ProcessGroupWrapper(pg=inner)
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"
    assert repr(ProcessGroupDummy(2, 3)) == "ProcessGroupDummy(rank=2, size=3)"
    wrapper.reconfigure(options(11, [wrapper.get_reconfigure_handle()])).wait()
    assert (inner.reconfigure_count, inner.configure_count, wrapper.size()) == (1, 1, 1)
    wrapper.shutdown()


def test_the_dummy_pairs_outputs_with_inputs_as_far_as_both_go() -> None:
    # A wrapper reporting a larger world (ManagedProcessGroup: the quorum's) hands the dummy lists
    # sized for that world; the dummy has no peer to disagree with and fills what it can.
    pg = ProcessGroupDummy(0, 1)
    x = torch.arange(6.0).view(2, 3)
    outs = [torch.zeros(2, 3) for _ in range(4)]
    assert pg.allgather_into_tensor_coalesced(outs, [x], AllgatherOptions()).wait()
    assert torch.equal(outs[0], x) and not outs[1].any()
    assert pg.reduce_scatter(outs, [[x]], ReduceScatterOptions()).wait()
    assert pg.reduce_scatter_tensor_coalesced(outs, [x], ReduceScatterOptions()).wait()


def test_gloo_reduce_scatter_has_a_future(store: dist.TCPStore) -> None:
    # torch's gloo gives reduce_scatter no future of its own; ftlaunch's Work still returns one.
    pg = ProcessGroupGloo(timedelta(seconds=30))
    pg.configure(addr(store, "rs"), 0, 1)
    out = torch.zeros(3)
    work = pg.reduce_scatter([out], [[torch.tensor([1.0, 2.0, 3.0])]], ReduceScatterOptions())
    work.get_future().wait()
    work.wait()
    assert out.tolist() == [1.0, 2.0, 3.0]
    pg.shutdown()


class _ManagerStandIn:
    """What ManagedProcessGroup uses of a Manager, as a torchft test's ``Mock(spec=Manager)`` has it."""

    def __init__(self) -> None:
        self._pg = ProcessGroupDummy(0, 1)
        self.calls: list[Any] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = "avg") -> Any:
        self.calls.append(reduce_op)
        return ("the manager's work", tensor)

    def num_participants(self) -> int:
        return 5


def test_managed_group_hands_back_the_managers_work_for_one_tensor() -> None:
    from ftlaunch.process_group import ManagedProcessGroup

    manager = _ManagerStandIn()
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    t = torch.ones(2)
    assert pg.allreduce([t], dist.ReduceOp.SUM) == ("the manager's work", t)
    assert pg.size() == 5 and manager.calls == [dist.ReduceOp.SUM]
    assert pg.barrier().wait()  # everything else goes to the Manager's group


def test_a_baby_group_counts_its_ops_in_flight_and_is_a_closed_handle_after_shutdown(
    store: dist.TCPStore,
) -> None:
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    try:
        pg.configure(addr(store, "baby-closed"), 0, 1)
        works = [pg.allreduce([torch.ones(3)], dist.ReduceOp.SUM) for _ in range(3)]
        assert 0 <= pg.num_active_work() <= 3
        for w in works:
            w.wait()
        assert pg.num_active_work() == 0
    finally:
        pg.shutdown()
    assert pg.num_active_work() == 0
    # Misuse, and a closed handle as Python's own I/O has it: both except clauses catch it.
    with pytest.raises(ValueError, match="shut down"):
        pg.allreduce([torch.ones(1)], dist.ReduceOp.SUM)
    with pytest.raises(OSError, match="handle is closed"):
        pg.allreduce([torch.ones(1)], dist.ReduceOp.SUM)

"""Tests of ftlaunch.process_group with real processes, real sockets and real kills."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pg_scenarios as sc
import psutil
import pytest
import torch
import torch.distributed as dist
from pg_helpers import WorkerPool, start_unmarked_resource_tracker
from torch.distributed import distributed_c10d as c10d

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
    create_store_client,
    parse_store_addr,
)
from ftlaunch.process_group.work import DoneWork

start_unmarked_resource_tracker()

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (this machine has none)")


@pytest.fixture
def store() -> Any:
    """A TCPStore server in the test process; workers connect to it with unique prefixes."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield server
    del server
    gc.collect()


def addr(server: dist.TCPStore, prefix: str) -> str:
    return f"127.0.0.1:{server.port}/{prefix}"


def configure_all(pool: WorkerPool, server: dist.TCPStore, prefix: str, ranks: list[int]) -> list[dict]:
    world = len(ranks)
    return pool.run(ranks, sc.configure, [(addr(server, prefix), k, world) for k in range(world)], timeout=90)


# ------------------------------------------------------------------------------------------------
# collectives on 3 and 2 processes, reconfiguration 3 -> 2 -> 3
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["gloo", "baby"])
def test_collectives_match_torch_and_reconfigure_3_2_3(kind: str, store: dist.TCPStore) -> None:
    with WorkerPool(3) as pool:
        children = pool.run([0, 1, 2], sc.make_pg, [(kind,)] * 3)
        pids = [pool.pid(i) for i in range(3)]

        # torch's own gloo over the same workers is the reference.
        pool.run([0, 1, 2], sc.init_reference, [(addr(store, "ref"), k, 3) for k in range(3)])

        first = configure_all(pool, store, "q1", [0, 1, 2])
        checks = pool.run([0, 1, 2], sc.check_collectives, [(k, 3) for k in range(3)], timeout=120)
        assert all(c == checks[0] and c >= 20 for c in checks), checks

        # 3 -> 2: worker 2 drops out, the others rebuild in place on a new prefix.
        second = configure_all(pool, store, "q2", [0, 1])
        assert [s["size"] for s in second] == [2, 2]
        pool.run([0, 1, 2], sc.reference_subgroup, [([0, 1],)] * 3)
        pool.run([0, 1], sc.check_collectives, [(k, 2) for k in range(2)], timeout=120)

        # 2 -> 3, with worker 2 back under a different rank order.
        third = pool.run([2, 0, 1], sc.configure, [(addr(store, "q3"), k, 3) for k in range(3)], timeout=90)
        sums = pool.run([2, 0, 1], sc.allreduce_sum, [(k,) for k in range(3)])
        assert sums == [[3.0, 3.0]] * 3

        # Nobody restarted: same worker processes, and (Baby) the same healthy child reused.
        assert [pool.pid(i) for i in range(3)] == pids
        assert all(r["pid"] == p for r, p in zip(first, pids, strict=True))
        if kind == "baby":
            assert [r["child"] for r in first] == children
            assert [r["child"] for r in second] == children[:2]
            assert [third[1]["child"], third[2]["child"], third[0]["child"]] == children


# ------------------------------------------------------------------------------------------------
# a peer SIGKILLed mid-collective
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["gloo", "baby", "swallow"])
def test_peer_sigkill_mid_collective(kind: str, store: dist.TCPStore) -> None:
    op_timeout = 20.0
    with WorkerPool(3) as pool:
        children = pool.run([0, 1, 2], sc.make_pg, [(kind, op_timeout)] * 3)
        # Like torchrun workers, each has its own (replica-local) default group: torch's error
        # logging then looks our group up, which must not mask the CommunicationError.
        pool.run([0, 1, 2], sc.init_local_default, [(addr(store, f"local{k}"),) for k in range(3)])
        configure_all(pool, store, "k1", [0, 1, 2])
        for i in range(3):
            pool.submit(i, sc.allreduce_until_error, i, 60.0)
        time.sleep(1.0)  # all three are now looping over all-reduces
        pool.kill(2)
        survivors = [pool.result(i, 60.0) for i in (0, 1)]
        for res in survivors:
            assert res["ops"] > 0, res
            if kind == "swallow":
                assert res["type"] == "swallowed", res
                assert res["comm"] and res["untouched"] and res["future_is_tensors"], res
            else:
                assert res["type"] == "CommunicationError" and res["comm"], res
                assert "allreduce" in res["msg"] and "k1" in res["msg"], res["msg"]
            # Failure surfaced within the op timeout (a dead peer must not hang anyone).
            assert res["op_seconds"] < op_timeout, res
            assert res["errored_is_comm"], res

        # The survivors carry on as a world of 2 on a new prefix.
        configure_all(pool, store, "k2", [0, 1])
        assert pool.run([0, 1], sc.allreduce_sum, [(0,), (1,)]) == [[1.0, 2.0]] * 2
        if kind == "swallow":
            assert pool.run([0, 1], sc.swallow_error_cleared, [(), ()]) == [True, True]
        if kind == "baby":
            # A peer's death does not make our child unhealthy: it is reused.
            states = pool.run([0, 1], sc.child_state, [(), ()])
            assert [s["pid"] for s in states] == children[:2] and all(s["alive"] for s in states)
        # The killed worker's Baby child must die with it (leak check of conftest covers it too).
        if kind == "baby":
            _wait_gone(children[2], 15.0)


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still alive after {timeout}s")


# ------------------------------------------------------------------------------------------------
# Baby: child killed, child wedged, parent killed, child reuse
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_baby_child_killed_fails_fast_and_is_replaced(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=30.0)
    try:
        pg.configure(addr(store, "c1"), 0, 1)
        first = pg.child_pid
        t = torch.ones(8)
        pg.allreduce([t])  # never waited for: its reply is collected, the child stays reusable
        time.sleep(0.5)
        pg.configure(addr(store, "c2"), 0, 1)
        assert pg.child_pid == first, "a healthy child must be reused"
        pg.allreduce([t]).wait()
        os.kill(first, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(CommunicationError, match="allreduce"):
            for _ in range(1000):  # the first op after the kill may already be in the socket buffer
                pg.allreduce([t]).wait()
        assert time.monotonic() - start < 10.0  # fails fast, long before the 30 s op timeout
        assert isinstance(pg.errored(), CommunicationError)
        pg.configure(addr(store, "c3"), 0, 1)
        assert pg.child_pid != first and pg.errored() is None
        t = torch.full((4,), 2.0)
        pg.allreduce([t]).wait()
        assert t.tolist() == [2.0] * 4
    finally:
        pg.shutdown()


def _child_shm_maps(pid: int) -> int:
    return sum(1 for m in psutil.Process(pid).memory_maps() if m.path.startswith("/dev/shm/"))


@pytest.mark.timeout(120)
def test_baby_shares_tensors_once_and_releases_them(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=30.0)
    try:
        pg.configure(addr(store, "s1"), 0, 1)
        child = pg.child_pid
        base = _child_shm_maps(child)
        tensors = [torch.full((1000,), float(i)) for i in range(20)]
        for _ in range(3):  # repeated use maps each storage once
            for x in tensors:
                pg.allreduce([x]).wait()
        assert all(x.is_shared() for x in tensors)  # moved to shared memory in place, values kept
        assert [x[0].item() for x in tensors] == [float(i) for i in range(20)]
        assert _child_shm_maps(child) == base + 20
        del tensors, x
        gc.collect()
        pg.allreduce([torch.ones(2)]).wait()  # the next op tells the child to unmap the dead ones
        pg.barrier().wait()
        assert _child_shm_maps(child) <= base + 1
    finally:
        pg.shutdown()


@pytest.mark.timeout(120)
def test_baby_wedged_child_times_out_in_parent(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=60.0)
    try:
        pg.configure(addr(store, "w1"), 0, 1)
        pg.set_timeout(timedelta(seconds=2))  # applies to the following ops
        wedged = pg.child_pid
        os.kill(wedged, signal.SIGSTOP)
        t = torch.ones(4)
        work = pg.allreduce([t])
        fut = pg.allreduce([t]).get_future()
        start = time.monotonic()
        with pytest.raises(CommunicationError, match="timed out"):
            work.wait()
        assert time.monotonic() - start < 30.0
        with pytest.raises(CommunicationError):
            fut.wait()  # futures are failed by the deadline too, nobody waits forever
        _wait_gone(wedged, 10.0)  # the wedged child was killed
        pg.configure(addr(store, "w2"), 0, 1)
        assert pg.child_pid != wedged
        pg.allreduce([t]).wait()
    finally:
        pg.shutdown()


@pytest.mark.timeout(120)
def test_baby_abort_interrupts_blocked_configure(store: dist.TCPStore) -> None:
    pg = ProcessGroupBabyGloo(timeout=60.0)
    errors: list[BaseException] = []

    def _configure() -> None:  # world 2 but rank 1 never comes: blocks in the child
        try:
            pg.configure(addr(store, "a1"), 0, 2)
        except BaseException as e:
            errors.append(e)

    try:
        th = threading.Thread(target=_configure)
        th.start()
        time.sleep(2.0)
        start = time.monotonic()
        pg.abort()
        assert time.monotonic() - start < 5.0  # abort = kill the child: immediate
        th.join(15.0)
        assert not th.is_alive(), "configure still blocked after abort"
        assert len(errors) == 1 and isinstance(errors[0], CommunicationError), errors
        pg.configure(addr(store, "a2"), 0, 1)
        t = torch.ones(2)
        pg.allreduce([t]).wait()
    finally:
        pg.shutdown()


@pytest.mark.timeout(120)
def test_baby_abort_while_the_child_starts_keeps_the_child(store: dist.TCPStore) -> None:
    """An abort while a configure still waits for its (replacement) child to import torch kills
    nothing: the configure fails before its rendezvous and the next one uses the same child. The soak
    saw such aborts (a peer lost during the configure) kill child after child on a loaded machine."""
    pg = ProcessGroupBabyGloo(timeout=30.0)
    child = pg._child
    assert child is not None
    gate = threading.Event()
    real_wait = child.wait_ready

    def slow_start(timeout: float) -> None:  # the child is still importing torch
        gate.wait(30)
        real_wait(timeout)

    child.wait_ready = slow_start  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def _configure() -> None:
        try:
            pg.configure(addr(store, "s1"), 0, 1)
        except BaseException as e:
            errors.append(e)

    try:
        th = threading.Thread(target=_configure)
        th.start()
        deadline = time.monotonic() + 10
        while pg._configuring is not child and time.monotonic() < deadline:
            time.sleep(0.01)
        pg.abort()
        gate.set()
        th.join(60)
        assert not th.is_alive()
        assert len(errors) == 1 and "aborted while its child started" in str(errors[0]), errors
        assert pg.child_pid == child.pid and child.healthy and pg._spare is None  # kept, nothing spawned
        pg.configure(addr(store, "s2"), 0, 1)
        t = torch.ones(2)
        pg.allreduce([t]).wait()
        assert pg.child_pid == child.pid
    finally:
        gate.set()
        pg.shutdown()


@pytest.mark.slow  # ~15-50 s (two Baby children import torch); the abort decision has fast tests on the fake
@pytest.mark.timeout(120)
def test_baby_prepare_abort_starts_the_replacement_child_that_the_abort_then_uses(
    store: dist.TCPStore,
) -> None:
    """`prepare_abort` (a step has waited long: worker/hang_abort.py) starts the replacement child
    at once; a healthy child keeps being used, and after an abort the next configure takes the
    child started then, not a fresh spawn."""
    pg = ProcessGroupBabyGloo(timeout=30.0)
    try:
        pg.configure(addr(store, "p1"), 0, 1)
        first = pg.child_pid
        pg.prepare_abort()
        pg.prepare_abort()  # at most one waits
        spare = pg._spare
        assert spare is not None
        pg.configure(addr(store, "p2"), 0, 1)
        assert pg.child_pid == first and pg._spare is spare  # healthy: no replacement
        pg.abort()
        pg.configure(addr(store, "p3"), 0, 1)
        assert pg.child_pid == spare.pid and pg.errored() is None
        t = torch.full((4,), 2.0)
        pg.allreduce([t]).wait()
        assert t.tolist() == [2.0] * 4
    finally:
        pg.shutdown()
    _wait_gone(first, 10)
    _wait_gone(spare.pid, 10)


@pytest.mark.timeout(120)
def test_baby_child_exits_when_parent_is_sigkilled() -> None:
    with WorkerPool(1) as pool:
        pids = pool.run([0], sc.start_babies_and_report, [()], timeout=90)[0]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        pool.kill(0)
        for pid in pids:  # one relies on PR_SET_PDEATHSIG, the other (spawned off-thread) on the watchdog
            _wait_gone(pid, 15.0)


# ------------------------------------------------------------------------------------------------
# teardown leaves nothing behind
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_teardown_releases_threads_sockets_children(store: dist.TCPStore) -> None:
    with WorkerPool(2) as pool:
        pool.run([0, 1], sc.warm_up, [(), ()])
        n = 0
        for kind in ("gloo", "baby"):
            # A first cycle lets one-time lazy state (thread pools, imports) settle.
            n += 1
            pool.run([0, 1], sc.teardown_cycle, [(kind, addr(store, f"t{n}"), k, 2, False) for k in range(2)])
            before = pool.run([0, 1], sc.resources, [(), ()])
            for destroy in (False, True):
                n += 1
                after = pool.run(
                    [0, 1], sc.teardown_cycle, [(kind, addr(store, f"t{n}"), k, 2, destroy) for k in range(2)]
                )
                for b, a in zip(before, after, strict=True):
                    how = f"{kind} {'destroy_process_group' if destroy else 'shutdown'}"
                    assert not a["child_alive"], how
                    assert a["children"] == [], (how, a["children"])
                    assert a["threads"] == b["threads"], (how, b["threads"], a["threads"])
                    assert a["os_threads"] == b["os_threads"], (how, b["os_threads"], a["os_threads"])
                    assert a["inet"] == b["inet"], (how, b["inet"], a["inet"])
                    assert a["fds"] == b["fds"], (how, b["fds"], a["fds"])


# ------------------------------------------------------------------------------------------------
# DeviceMesh
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_extend_device_mesh_runs_collective_through_new_dim(store: dist.TCPStore) -> None:
    with WorkerPool(2) as pool:
        out = pool.run(
            [0, 1],
            sc.mesh_collective,
            [(addr(store, f"local{k}"), addr(store, "dp1"), k, 2) for k in range(2)],
            timeout=120,
        )
        for res in out:
            assert res["names"] == ["dp", "shard"] and res["shape"] == [1, 1], res
            assert res["dp_is_pg"], res
            assert res["fc"] == [3.0] and res["dist"] == [3.0], res  # 1 + 2 across the two groups
            assert res["shard"] == [float(out.index(res) + 1)], res  # the local dim is untouched
        # FSDP2 hybrid sharding replicates over our group: gradients are averaged across workers.
        mean = [(a + b) / 2 for a, b in zip(out[0]["local_grad"], out[1]["local_grad"], strict=True)]
        assert out[0]["local_grad"] != out[1]["local_grad"]
        assert out[0]["fsdp_grad"] == out[1]["fsdp_grad"] == pytest.approx(mean)


# ------------------------------------------------------------------------------------------------
# NCCL (needs CUDA)
# ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["nccl", "baby_nccl"])
def test_nccl_allreduce(kind: str, store: dist.TCPStore) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with WorkerPool(2) as pool:
        pool.run([0, 1], sc.make_pg, [(kind,)] * 2)
        configure_all(pool, store, "n1", [0, 1])
        assert pool.run([0, 1], sc.allreduce_sum, [(0,), (1,)]) == [[1.0, 2.0]] * 2


# ------------------------------------------------------------------------------------------------
# in-process: API surface, registry, wrappers, dummy, store addresses
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_torch_apis_and_registry(store: dist.TCPStore) -> None:
    import torch.distributed._functional_collectives as fc

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    assert isinstance(pg, dist.ProcessGroup)
    with pytest.raises(ValueError, match="configure"):
        pg.allreduce([torch.ones(1)])
    pg.configure(addr(store, "r1"), 0, 1)
    assert (pg.rank(), pg.size(), pg.getBackendName()) == (0, 1, "ftlaunch-gloo")
    assert dist.get_world_size(pg) == 1
    t = torch.arange(3.0)
    dist.all_reduce(t, group=pg)
    assert t.tolist() == [0.0, 1.0, 2.0]
    # Registered from the first configure on, under a generated name, like torch's own groups.
    auto = pg.group_name
    assert c10d._resolve_process_group(auto) is pg and c10d._world.pg_names[pg] == auto
    pg.register("ftlaunch-test-r1")  # renames
    with pytest.raises(ValueError, match="already registered"):
        pg.register("other")
    assert pg.group_name == "ftlaunch-test-r1"
    assert c10d._resolve_process_group("ftlaunch-test-r1") is pg
    assert dist.get_backend(pg) == "ftlaunch-gloo"
    assert (fc.all_reduce(t, "sum", "ftlaunch-test-r1") * 1).tolist() == [0.0, 1.0, 2.0]
    assert (fc.all_gather_tensor(t, 0, "ftlaunch-test-r1") * 1).tolist() == [0.0, 1.0, 2.0]
    assert (fc.reduce_scatter_tensor(t, "sum", 0, "ftlaunch-test-r1") * 1).tolist() == [0.0, 1.0, 2.0]
    pg.unregister()
    assert pg not in c10d._world.pg_map
    with pytest.raises(ValueError, match="not registered"):
        pg.unregister()
    pg.register("ftlaunch-test-r1")
    dist.destroy_process_group(pg)
    assert pg not in c10d._world.pg_map and pg.parent is None
    with pytest.raises(ValueError, match="shut down"):
        pg.allreduce([t])
    # As in torchft, a shut-down group can be configured again; it is registered again too.
    pg.configure(addr(store, "r2"), 0, 1)
    assert c10d._resolve_process_group(pg.group_name) is pg
    pg.allreduce([t]).wait()
    pg.shutdown()
    pg.unregister()


@pytest.mark.timeout(60)
def test_misuse_raises_value_error(store: dist.TCPStore) -> None:
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    with pytest.raises(ValueError):
        pg.configure(addr(store, "m1"), 2, 2)
    with pytest.raises(ValueError):
        pg.configure("no-port/prefix", 0, 1)
    with pytest.raises(ValueError):
        ProcessGroupGloo(timeout=0)
    pg.configure(addr(store, "m2"), 0, 1)
    with pytest.raises(ValueError, match="all_gather_single"):
        pg.all_gather_single(torch.zeros(3), torch.zeros(2)).wait()
    with pytest.raises(TypeError):
        pg.allreduce("not a tensor")
    assert pg.errored() is None  # misuse is not a communication failure
    pg.shutdown()


@pytest.mark.timeout(60)
def test_configure_against_dead_store_is_communication_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pg = ProcessGroupGloo(timeout=timedelta(seconds=1))
    with pytest.raises(CommunicationError, match="store"):
        pg.configure(f"127.0.0.1:{port}/x", 0, 1)
    assert isinstance(pg.errored(), CommunicationError)
    with pytest.raises(CommunicationError):
        pg.allreduce([torch.ones(1)])
    pg.shutdown()


class _Failing(ProcessGroupDummy):
    """Every all-reduce fails the way a dead peer makes gloo fail (at wait / in the future)."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.calls = 0

    def _do_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        self.calls += 1
        return _FailingWork(self)


class _FailingWork(dist.Work):
    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__()
        self._pg = pg

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        raise self._pg._failures.record("allreduce", RuntimeError("Connection closed by peer"))

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(self._pg._failures.record("allreduce", RuntimeError("Connection closed by peer")))
        return fut


def test_error_swallowing_wrapper() -> None:
    inner = _Failing()
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    pg.configure("127.0.0.1:1/s1", 0, 1)
    assert pg.error() is None
    t = torch.ones(3)
    assert pg.allreduce([t]).wait() is True  # the failure is swallowed...
    assert isinstance(pg.error(), CommunicationError) and pg.errored() is pg.error()
    calls = inner.calls
    fut = pg.allreduce([t]).get_future()  # ...and later ops do not even reach the inner group
    assert fut.wait()[0] is t and inner.calls == calls
    assert torch.equal(t, torch.ones(3))
    pg.configure("127.0.0.1:1/s2", 0, 1)
    assert pg.error() is None
    # A future-based failure is swallowed too and reported.
    assert pg.allreduce([t]).get_future().wait()[0] is t
    assert isinstance(pg.error(), CommunicationError)
    pg.report_error(ValueError("ignored, first error wins"))
    assert isinstance(pg.error(), CommunicationError)


def test_dummy() -> None:
    pg = ProcessGroupDummy(0, 1)
    t = torch.arange(3.0)
    work = pg.allreduce([t])
    assert work.wait() and work.is_completed() and torch.equal(t, torch.arange(3.0))
    assert work.get_future().wait() == [t]
    assert dist.all_reduce(t, group=pg) is None
    out = [torch.zeros(3)]
    pg.allgather([out], [t]).wait()
    pg.broadcast(t, 0).wait()
    pg.barrier().wait()
    pg.reduce_scatter_single(torch.zeros(3), t).wait()
    pg.configure("127.0.0.1:1234/d1", 0, 1)
    pg.configure("127.0.0.1:1234/d2", 1, 3)
    assert (pg.configure_count, pg.rank(), pg.size(), pg.errored()) == (2, 1, 3, None)
    with pytest.raises(ValueError):
        ProcessGroupDummy(2, 2)


def test_wrapper_of_static_group_is_not_reconfigurable() -> None:
    pg = ProcessGroupWrapper(ProcessGroupDummy(0, 1))
    assert pg.allreduce([torch.ones(1)]).wait()
    pg.configure("127.0.0.1:1/w1", 0, 2)  # forwarded to the wrapped ftlaunch group
    assert pg.size() == 2
    assert isinstance(DoneWork(), dist.Work)


def test_parse_store_addr() -> None:
    a = parse_store_addr("localhost:1234/my/prefix/1")
    assert (a.host, a.port, a.prefix) == ("localhost", 1234, "my/prefix/1")
    b = parse_store_addr("[::1]:29500/q/7")
    assert (b.host, b.port, b.prefix, str(b)) == ("::1", 29500, "q/7", "[::1]:29500/q/7")
    assert parse_store_addr("10.0.0.1:80").prefix == ""
    for bad in [
        "",
        "localhost",
        "localhost:",
        "localhost:abc/p",
        ":1234/p",
        "[::1/p",
        "[::1]1234/p",
        "host:0/p",
        "host:70000/p",
        "host:12/",
        "a:b:c/p",
    ]:
        with pytest.raises(ValueError, match="bad store address"):
            parse_store_addr(bad)


@pytest.mark.timeout(60)
def test_create_store_client_prefix(store: dist.TCPStore) -> None:
    client = create_store_client(addr(store, "pfx/a"), timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("pfx/a/k") == b"v"
    other = create_store_client(addr(store, "pfx/b"), 10.0)
    assert not other.check(["k"])


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_create_store_client_ipv6() -> None:
    server = dist.TCPStore("::1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = create_store_client(f"[::1]:{server.port}/v6", timedelta(seconds=10))
    client.set("k", "v6")
    assert server.get("v6/k") == b"v6"


@pytest.mark.timeout(30)
def test_create_store_client_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CommunicationError, match=f"127.0.0.1:{port}"):
        create_store_client(f"127.0.0.1:{port}/x", timedelta(seconds=1))


def test_thread_is_not_leaked_by_in_process_groups() -> None:
    assert not [t for t in threading.enumerate() if t.name.startswith("ftlaunch-baby-reader")]

"""Functions the process-group tests run inside worker processes (see pg_helpers.WorkerPool).

Each check compares an ftlaunch group against torch's own gloo default group
(``init_process_group("gloo")``) fed with identical inputs.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
from pg_helpers import STATE

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    create_store_client,
    extend_device_mesh,
)


def make_pg(kind: str, timeout: float = 30.0) -> int | None:
    """Create this worker's group: gloo, baby (BabyGloo), swallow (ErrorSwallowing(Gloo)), nccl..."""
    if kind == "gloo":
        pg: Any = ProcessGroupGloo(timeout=timedelta(seconds=timeout))
    elif kind == "baby":
        pg = ProcessGroupBabyGloo(timeout=timeout)
    elif kind == "swallow":
        pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=timeout)))
    elif kind == "nccl":
        pg = ProcessGroupNCCL(timeout=timedelta(seconds=timeout))
    elif kind == "baby_nccl":
        pg = ProcessGroupBabyNCCL(timeout=timeout)
    else:
        raise ValueError(kind)
    STATE["pg"] = pg
    return getattr(pg, "child_pid", None)


def configure(store_addr: str, rank: int, world_size: int) -> dict[str, Any]:
    pg = STATE["pg"]
    start = time.monotonic()
    pg.configure(store_addr, rank, world_size)
    return {
        "pid": os.getpid(),
        "child": getattr(pg, "child_pid", None),
        "seconds": time.monotonic() - start,
        "size": pg.size(),
        "rank": pg.rank(),
    }


def allreduce_sum(rank: int) -> list[float]:
    """All-reduce [rank, 1] (so the result is [sum of ranks, world size])."""
    t = torch.tensor([float(rank), 1.0])
    dist.all_reduce(t, group=STATE["pg"])
    return t.tolist()


# ------------------------------------------------------------------------------------------------
# every collective, compared with torch's own gloo
# ------------------------------------------------------------------------------------------------


def _inp(shape: tuple[int, ...], rank: int, salt: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = int(np.prod(shape))
    return (
        ((torch.arange(n, dtype=torch.float64) * (rank + 1) + salt * 7 + rank * 3) % 97)
        .to(dtype)
        .reshape(shape)
    )


def _same(ours: Any, ref: Any, what: str) -> None:
    if isinstance(ours, (list, tuple)):
        assert len(ours) == len(ref), what
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            _same(a, b, f"{what}[{i}]")
        return
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
        f"{what}: {ours.dtype}{tuple(ours.shape)} vs {ref.dtype}{tuple(ref.shape)}"
    )
    assert torch.equal(ours, ref), (
        f"{what}: ftlaunch {ours.flatten()[:8].tolist()} != torch {ref.flatten()[:8].tolist()}"
    )


def init_reference(ref_addr: str, rank: int, world: int) -> None:
    """torch's own gloo default group over all workers: the reference for every check."""
    dist.init_process_group("gloo", store=create_store_client(ref_addr), rank=rank, world_size=world)
    STATE["ref"] = None  # None = the default group


def init_local_default(local_addr: str) -> None:
    """A one-process default group, as each replica group's torchrun would create."""
    dist.init_process_group("gloo", store=create_store_client(local_addr), rank=0, world_size=1)


def reference_subgroup(ranks: list[int]) -> None:
    """A torch subgroup of the default group (every worker must call this)."""
    STATE["ref"] = dist.new_group(ranks)


def check_collectives(rank: int, world: int) -> int:
    """Run every collective on STATE['pg'] and on torch's gloo (STATE['ref']); raise on any difference."""
    pg = STATE["pg"]
    ref = STATE["ref"]
    assert pg.size() == world and pg.rank() == rank, (pg.size(), pg.rank(), world, rank)
    assert dist.get_world_size(ref) == world and dist.get_rank(ref) == rank
    assert dist.get_rank(pg) == rank and dist.get_world_size(pg) == world
    assert dist.get_backend(pg) == pg.getBackendName()
    checks = 0
    W, r = world, rank
    # all_reduce: sum/max, float/int, async + future, views, numpy-backed memory
    for salt, (dtype, op) in enumerate(
        [
            (torch.float32, dist.ReduceOp.SUM),
            (torch.int64, dist.ReduceOp.MAX),
            (torch.float64, dist.ReduceOp.MIN),
        ]
    ):
        a, b = _inp((5, 3), r, salt, dtype), _inp((5, 3), r, salt, dtype)
        dist.all_reduce(a, op=op, group=pg)
        dist.all_reduce(b, op=op, group=ref)
        _same(a, b, f"all_reduce {dtype} {op}")
        checks += 1
    a, b = _inp((1000,), r, 3), _inp((1000,), r, 3)
    fut = dist.all_reduce(a, group=pg, async_op=True).get_future()
    value = fut.wait()
    dist.all_reduce(b, group=ref)
    _same(a, b, "async all_reduce")
    _same(value[0], b, "async all_reduce future value")
    big_a, big_b = _inp((10,), r, 4), _inp((10,), r, 4)
    dist.all_reduce(big_a[2:6], group=pg)
    dist.all_reduce(big_b[2:6], group=ref)
    _same(big_a, big_b, "all_reduce of a view (rest untouched)")
    arr = _inp((6,), r, 5).numpy().copy()
    a, b = torch.from_numpy(arr), _inp((6,), r, 5)
    pg.allreduce([a]).wait()
    dist.all_reduce(b, group=ref)
    _same(a, b, "all_reduce of numpy memory")
    assert np.array_equal(arr, b.numpy()), "numpy array no longer aliases the tensor"
    checks += 3
    # allreduce_coalesced
    xs = [_inp((4,), r, 6), _inp((3, 2), r, 7)]
    ys = [x.clone() for x in xs]
    pg.allreduce_coalesced(xs).wait()
    for y in ys:
        dist.all_reduce(y, group=ref)
    _same(xs, ys, "allreduce_coalesced")
    checks += 1
    # all_gather (list), into tensor, coalesced
    x = _inp((2, 3), r, 8)
    outs_a = [torch.zeros(2, 3) for _ in range(W)]
    outs_b = [torch.zeros(2, 3) for _ in range(W)]
    dist.all_gather(outs_a, x, group=pg)
    dist.all_gather(outs_b, x, group=ref)
    _same(outs_a, outs_b, "all_gather")
    out_a, out_b = torch.zeros(W * 2, 3), torch.zeros(W * 2, 3)
    dist.all_gather_single(out_a, x, group=pg)
    dist.all_gather_single(out_b, x, group=ref)
    _same(out_a, out_b, "all_gather_single")
    ins = [_inp((4,), r, 9), _inp((2,), r, 10)]
    oa = [torch.zeros(W * 4), torch.zeros(W * 2)]
    ob = [torch.zeros(W * 4), torch.zeros(W * 2)]
    pg.allgather_into_tensor_coalesced(oa, ins).wait()
    for o, i in zip(ob, ins, strict=True):
        dist.all_gather_single(o, i, group=ref)
    _same(oa, ob, "allgather_into_tensor_coalesced")
    checks += 3
    # broadcast (+ broadcast_one)
    a, b = _inp((7,), r, 11), _inp((7,), r, 11)
    dist.broadcast(a, group=pg, group_src=W - 1)
    dist.broadcast(b, group=ref, group_src=W - 1)
    _same(a, b, "broadcast")
    a, b = _inp((3,), r, 12), _inp((3,), r, 12)
    pg.broadcast_one(a, 0).wait()
    dist.broadcast(b, group=ref, group_src=0)
    _same(a, b, "broadcast_one")
    checks += 2
    # reduce_scatter (list), tensor, coalesced
    ins_a = [_inp((3,), r, 13 + k) for k in range(W)]
    oa, ob = torch.zeros(3), torch.zeros(3)
    dist.reduce_scatter(oa, ins_a, group=pg)
    dist.reduce_scatter(ob, [t.clone() for t in ins_a], group=ref)
    _same(oa, ob, "reduce_scatter")
    x = _inp((W * 4,), r, 20)
    oa, ob = torch.zeros(4), torch.zeros(4)
    dist.reduce_scatter_single(oa, x, group=pg)
    dist.reduce_scatter_single(ob, x.clone(), group=ref)
    _same(oa, ob, "reduce_scatter_single")
    xs = [_inp((W * 2,), r, 21), _inp((W * 5,), r, 22)]
    oa = [torch.zeros(2), torch.zeros(5)]
    ob = [torch.zeros(2), torch.zeros(5)]
    pg.reduce_scatter_tensor_coalesced(oa, xs).wait()
    for o, i in zip(ob, xs, strict=True):
        dist.reduce_scatter_single(o, i.clone(), group=ref)
    _same(oa, ob, "reduce_scatter_tensor_coalesced")
    checks += 3
    # all_to_all_single (even and uneven splits), all_to_all (lists)
    x = _inp((W * 2,), r, 23)
    oa, ob = torch.zeros(W * 2), torch.zeros(W * 2)
    dist.all_to_all_single(oa, x, group=pg)
    dist.all_to_all_single(ob, x, group=ref)
    _same(oa, ob, "all_to_all_single")
    in_splits = [(r + k) % 3 + 1 for k in range(W)]  # what I send to rank k
    out_splits = [(k + r) % 3 + 1 for k in range(W)]  # what rank k sends me
    x = _inp((sum(in_splits),), r, 24)
    oa, ob = torch.zeros(sum(out_splits)), torch.zeros(sum(out_splits))
    dist.all_to_all_single(oa, x, out_splits, in_splits, group=pg)
    dist.all_to_all_single(ob, x, out_splits, in_splits, group=ref)
    _same(oa, ob, "all_to_all_single uneven")
    ins = [_inp((2,), r, 25 + k) for k in range(W)]
    oa = [torch.zeros(2) for _ in range(W)]
    ob = [torch.zeros(2) for _ in range(W)]
    dist.all_to_all(oa, ins, group=pg)
    dist.all_to_all(ob, [t.clone() for t in ins], group=ref)
    _same(oa, ob, "all_to_all")
    checks += 3
    # send/recv around the ring
    nxt, prv = (r + 1) % W, (r - 1) % W
    mine = _inp((5,), r, 30)
    got_a, got_b = torch.zeros(5), torch.zeros(5)
    ws = [pg.send([mine], nxt, 3), pg.recv([got_a], prv, 3)]
    for w in ws:
        w.wait()
    reqs = [dist.isend(mine, group=ref, group_dst=nxt), dist.irecv(got_b, group=ref, group_src=prv)]
    for q in reqs:
        q.wait()
    _same(got_a, got_b, "send/recv")
    _same(got_a, _inp((5,), prv, 30), "recv got the previous rank's tensor")
    checks += 1
    # barrier
    pg.barrier().wait()
    dist.barrier(group=pg)
    checks += 1
    # reduce, gather, scatter (rooted): native through dist.*, and the base class's composites
    checks += _check_rooted(pg, ref, r, W)
    # DDP with our group as its process group: gradients equal torch's
    checks += _check_ddp(pg, ref, r)
    return checks


def _check_rooted(pg: Any, ref: Any, r: int, W: int) -> int:
    """reduce/gather/scatter on ``pg`` equal torch's at the root; the composites too."""
    from torch._C._distributed_c10d import GatherOptions, ReduceOptions, ScatterOptions

    from ftlaunch.process_group import ProcessGroup

    checks = 0
    for root in (0, W - 1):
        a, b = _inp((4,), r, 50 + root), _inp((4,), r, 50 + root)
        dist.reduce(a, group=pg, group_dst=root, op=dist.ReduceOp.MAX)
        dist.reduce(b, group=ref, group_dst=root, op=dist.ReduceOp.MAX)
        if r == root:
            _same(a, b, f"reduce to {root}")
        x = _inp((2, 2), r, 60 + root)
        ga = [torch.zeros(2, 2) for _ in range(W)] if r == root else None
        gb = [torch.zeros(2, 2) for _ in range(W)] if r == root else None
        dist.gather(x, ga, group=pg, group_dst=root)
        dist.gather(x, gb, group=ref, group_dst=root)
        if r == root:
            _same(ga, gb, f"gather to {root}")
        parts = [_inp((3,), root, 70 + k) for k in range(W)] if r == root else None
        sa, sb = torch.zeros(3), torch.zeros(3)
        dist.scatter(sa, parts, group=pg, group_src=root)
        dist.scatter(sb, parts, group=ref, group_src=root)
        _same(sa, sb, f"scatter from {root}")
        checks += 3
    # The composites over allreduce / allgather / broadcast (what a group without native rooted
    # ops runs), called directly on this group.
    root = W - 1
    a, b = _inp((5,), r, 80), _inp((5,), r, 80)
    opts = ReduceOptions()
    opts.rootRank, opts.reduceOp = root, dist.ReduceOp.SUM
    ProcessGroup._do_reduce(pg, [a], opts).wait()
    dist.reduce(b, group=ref, group_dst=root)
    if r == root:
        _same(a, b, "composite reduce")
    x = _inp((3,), r, 81)
    ga = [[torch.zeros(3) for _ in range(W)]] if r == root else []
    gb = [torch.zeros(3) for _ in range(W)] if r == root else None
    gopts = GatherOptions()
    gopts.rootRank = root
    ProcessGroup._do_gather(pg, ga, [x], gopts).wait()
    dist.gather(x, gb, group=ref, group_dst=root)
    if r == root:
        _same(ga[0], gb, "composite gather")
    parts = [_inp((2,), root, 82 + k) for k in range(W)]
    sa, sb = torch.zeros(2), torch.zeros(2)
    sopts = ScatterOptions()
    sopts.rootRank = root
    ProcessGroup._do_scatter(pg, [sa], [parts] if r == root else [], sopts).wait()
    dist.scatter(sb, parts if r == root else None, group=ref, group_src=root)
    _same(sa, sb, "composite scatter")
    return checks + 3


def _check_ddp(pg: Any, ref: Any, rank: int) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ours = DDP(_clone_module(base), process_group=pg)
    ref = DDP(_clone_module(base), process_group=ref)
    x = _inp((6, 8), rank, 40) / 97
    for model in (ours, ref):
        model(x).square().sum().backward()
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters(), strict=True):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), f"DDP grad {name} differs"
    return 1


def _clone_module(m: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(m)


# ------------------------------------------------------------------------------------------------
# failures
# ------------------------------------------------------------------------------------------------


def allreduce_until_error(rank: int, max_seconds: float) -> dict[str, Any]:
    """Loop all-reduces until one fails (a peer was killed); report how the failure surfaced."""
    pg = STATE["pg"]
    t = torch.ones(256 * 1024)
    deadline = time.monotonic() + max_seconds
    n = 0
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            dist.all_reduce(t, group=pg)
        except Exception as e:
            return {
                "type": type(e).__name__,
                "comm": isinstance(e, CommunicationError),
                "msg": str(e),
                "op_seconds": time.monotonic() - start,
                "ops": n,
                "errored": repr(pg.errored()),
                "errored_is_comm": isinstance(pg.errored(), CommunicationError),
            }
        n += 1
        if isinstance(pg, ErrorSwallowingProcessGroupWrapper) and pg.error() is not None:
            # Swallowed: the op "succeeded"; later ops must complete at once without touching data.
            before = t.clone()
            w = pg.allreduce([t])
            w.wait()
            fut_val = pg.allreduce([t]).get_future().wait()
            return {
                "type": "swallowed",
                "comm": isinstance(pg.error(), CommunicationError),
                "msg": str(pg.error()),
                "ops": n,
                "op_seconds": time.monotonic() - start,
                "untouched": bool(torch.equal(before, t)),
                "future_is_tensors": fut_val[0] is t,
                "errored": repr(pg.errored()),
                "errored_is_comm": isinstance(pg.errored(), CommunicationError),
            }
    return {"type": None, "ops": n}


def swallow_error_cleared() -> bool:
    return STATE["pg"].error() is None


def child_state() -> dict[str, Any]:
    """The Baby child's pid and liveness as this worker sees it."""
    pg = STATE["pg"]
    pid = pg.child_pid
    return {"pid": pid, "alive": pid is not None and psutil.pid_exists(pid)}


def start_babies_and_report() -> list[int]:
    """Create Baby groups from the main thread and from another thread; return their child pids."""
    pgs = [ProcessGroupBabyGloo(timeout=10.0)]
    holder: list[Any] = []
    th = threading.Thread(target=lambda: holder.append(ProcessGroupBabyGloo(timeout=10.0)))
    th.start()
    th.join()
    pgs += holder
    STATE["babies"] = pgs
    # Wait until both children have fully started (they watch their parent from then on).
    for pg in pgs:
        pg._child.wait_ready(60.0)
    return [pg.child_pid for pg in pgs]


# ------------------------------------------------------------------------------------------------
# teardown
# ------------------------------------------------------------------------------------------------


def _resources() -> dict[str, Any]:
    gc.collect()
    me = psutil.Process()
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "os_threads": me.num_threads(),
        "children": [c.pid for c in me.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE],
        "inet": len(me.net_connections(kind="inet")),
        "fds": me.num_fds(),
    }


def teardown_cycle(kind: str, store: str, rank: int, world: int, destroy: bool) -> dict[str, Any]:
    """Create, configure, use and tear down a group (shutdown or destroy_process_group)."""
    make_pg(kind, 20.0)
    pg = STATE.pop("pg")
    pg.configure(store, rank, world)
    t = torch.ones(1 << 16)
    pg.allreduce([t]).wait()
    dist.all_reduce(t, group=pg)
    out = torch.zeros(world * 4)
    pg.all_gather_single(out, torch.ones(4)).wait()
    child = getattr(pg, "child_pid", None)
    if destroy:
        dist.destroy_process_group(pg)
        from torch.distributed import distributed_c10d as c10d

        assert pg not in c10d._world.pg_map, "destroy_process_group left the group registered"
    else:
        pg.shutdown()
    del pg, t, out
    res = _resources()
    res["child_alive"] = (
        child is not None
        and psutil.pid_exists(child)
        and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
    )
    return res


def resources() -> dict[str, Any]:
    return _resources()


def warm_up() -> None:
    """Touch torch's lazily started thread pools so they do not count as leaks later."""
    x = torch.randn(1 << 20)
    (x * 2).sum()
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))


# ------------------------------------------------------------------------------------------------
# DeviceMesh
# ------------------------------------------------------------------------------------------------


def mesh_collective(local_addr: str, ft_addr: str, rank: int, world: int) -> dict[str, Any]:
    """Each worker is its own one-process 'replica group'; the ftlaunch group spans them."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=create_store_client(local_addr), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
        pg.configure(ft_addr, rank, world)
        ext = extend_device_mesh(mesh, pg, name="dp", dim=0)
        t = torch.tensor([float(rank + 1)])
        summed = fc.all_reduce(t, "sum", (ext, 0))  # (mesh, dim index)
        summed = torch.as_tensor(summed) * 1
        t2 = torch.tensor([float(rank + 1)])
        dist.all_reduce(t2, group=ext.get_group("dp"))
        shard = torch.tensor([float(rank + 1)])
        dist.all_reduce(shard, group=ext.get_group("shard"))
        out = {
            "names": list(ext.mesh_dim_names),
            "shape": list(ext.mesh.shape),
            "fc": summed.tolist(),
            "dist": t2.tolist(),
            "shard": shard.tolist(),
            "dp_is_pg": ext.get_group("dp") is pg,
        }
        out["fsdp_grad"], out["local_grad"] = _fsdp2_hsdp_grads(ext, rank)
        pg.shutdown()
        return out
    finally:
        dist.destroy_process_group()


def _fsdp2_hsdp_grads(mesh: Any, rank: int) -> tuple[list[float], list[float]]:
    """FSDP2 hybrid sharding over the extended mesh: replicate over "dp" (ours), shard over "shard"."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    local = torch.nn.Linear(4, 2)
    local.load_state_dict(model.state_dict())
    fully_shard(model, mesh=mesh)
    x = torch.full((3, 4), float(rank + 1))
    model(x).sum().backward()
    local(x).sum().backward()
    grad = model.weight.grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grad.flatten().tolist(), local.weight.grad.flatten().tolist()


# ------------------------------------------------------------------------------------------------
# torchft's current reconfigure API
# ------------------------------------------------------------------------------------------------


def reconfigure_via_store(store_addr: str, rank: int, world: int, global_rank: int) -> dict[str, Any]:
    """torchft's ``reconfigure_with_store`` on this worker's group, then an all-reduce of rank + 1."""
    from ftlaunch.process_group import reconfigure_with_store

    pg = STATE["pg"]
    pg.set_rank_info("rg", 0, 1, global_rank)
    reconfigure_with_store(pg, store_addr, rank, world, timedelta(seconds=30))
    t = torch.tensor([float(pg.rank() + 1)])
    dist.all_reduce(t, group=pg)
    return {
        "rank": pg.rank(),
        "size": pg.size(),
        "sum": t.item(),
        "global_ranks": pg.global_ranks,
        "child": getattr(pg, "child_pid", None),
        "errored": pg.errored() is not None,
    }


def abort_pg() -> None:
    STATE["pg"].abort()


def shutdown_pg() -> None:
    STATE["pg"].shutdown()


# ------------------------------------------------------------------------------------------------
# parameter server (torchft's): the server lives in the test process, clients in workers
# ------------------------------------------------------------------------------------------------


from ftlaunch.process_group import ProcessGroup  # noqa: E402
from ftlaunch.process_group.parameter_server import ParameterServer  # noqa: E402


class AddServer(ParameterServer):
    """Holds one number; each exchange adds the client's contribution and returns the new total.

    A session is a loop of: client broadcasts its value (root 1), server adds it and broadcasts
    the total (root 0); a negative value ends the session. As torchft's test, but many rounds,
    several concurrent clients, and a total shared between sessions."""

    def __init__(self) -> None:
        super().__init__(port=0)
        self.total = 0.0
        self.total_lock = threading.Lock()
        self.ended: list[str] = []

    session_timeout = 20.0

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupGloo(timeout=timedelta(seconds=cls.session_timeout))

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        data = torch.zeros(1)
        while True:
            pg.broadcast_one(data, root=1).wait()
            if data.item() < 0:
                break
            with self.total_lock:
                self.total += data.item()
                data.fill_(self.total)
            pg.broadcast_one(data, root=0).wait()
        self.ended.append(session_id)


def ps_client(address: str, rounds: int, value: float) -> list[float]:
    """One session of ``rounds`` exchanges; the totals the server returned."""
    pg = AddServer.new_session(address)
    assert (pg.rank(), pg.size()) == (1, 2)
    seen = []
    for _ in range(rounds):
        data = torch.tensor([value])
        pg.broadcast_one(data, root=1).wait()
        pg.broadcast_one(data, root=0).wait()
        seen.append(data.item())
    pg.broadcast_one(torch.tensor([-1.0]), root=1).wait()
    pg.shutdown()
    return seen


def ps_client_then_hang(address: str) -> float:
    """One exchange, then the session stays open (the test kills this worker)."""
    pg = AddServer.new_session(address)
    data = torch.tensor([1000.0])
    pg.broadcast_one(data, root=1).wait()
    pg.broadcast_one(data, root=0).wait()
    STATE["ps_pg"] = pg
    return data.item()

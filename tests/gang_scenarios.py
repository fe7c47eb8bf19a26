"""One table of gang expectations, run against `FakeGang` in the test process and against
`ProcessGroupGang` over gloo in real worker processes (tests/processes/test_gang.py, via
pg_helpers.WorkerPool).

Every case gives each process the same inputs - the world a `FakeGang` simulates - so a real gang
must produce, rank by rank, exactly what the fake produces; `expected` pins both to the documented
semantics. Outcomes are plain data (tensors as ``[dtype, values]``, errors as ``"raises X"``) so
they cross process boundaries and compare with ``==``.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import torch
from pg_helpers import STATE

from ftlaunch.errors import GangError, OperationalError
from ftlaunch.gang import (
    Gang,
    Gangs,
    ProcessGroupGang,
    ProductGang,
    ReduceOperation,
    all_sum,
    broadcast_flag,
    create_fsdp_gangs,
    create_parallel_gangs,
    raise_operational_gang_error,
)

R = ReduceOperation
F = [1.5, -2.0, 3.0]  # exact in binary: sums, products and means of copies are exact too
INTS = [3, -4]


def out(t: torch.Tensor) -> list[Any]:
    return [str(t.dtype).removeprefix("torch."), t.tolist()]


def _reduce(
    values: list[float] | list[int], dtype: torch.dtype, op: ReduceOperation
) -> Callable[[Gang], Any]:
    def case(g: Gang) -> Any:
        t = torch.tensor(values, dtype=dtype)
        g.all_reduce(t, op)
        return out(t)

    return case


def _gather(g: Gang) -> Any:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5
    o = torch.full((g.size, 2, 3), -1.0)
    g.all_gather(o, x)
    return out(o)


def _gather_scalar(g: Gang) -> Any:
    o = torch.zeros(g.size, dtype=torch.int32)
    g.all_gather(o, torch.tensor(-7, dtype=torch.int32))
    return out(o)


def _gather_bad(kind: str) -> Callable[[Gang], Any]:
    def case(g: Gang) -> Any:
        x = torch.ones(2, 3)
        if kind == "shape":
            o = torch.empty(g.size + 1, 2, 3)
        elif kind == "noncontiguous":
            o = torch.empty(g.size, 3, 2).transpose(1, 2)
        else:
            o = torch.empty(g.size, 2, 3, dtype=torch.float64)
        g.all_gather(o, x)
        return "no error"

    return case


def _gather_list(n_extra: int) -> Callable[[Gang], Any]:
    def case(g: Gang) -> Any:
        x = torch.tensor([7, 8], dtype=torch.int64)
        outs = [torch.zeros(2, dtype=torch.int64) for _ in range(g.size + n_extra)]
        g.all_gather_to_list(outs, x)
        return [out(o) for o in outs]

    return case


def _broadcast(src: Callable[[int], int]) -> Callable[[Gang], Any]:
    def case(g: Gang) -> Any:
        t = torch.tensor(F)
        g.broadcast(t, src(g.size))
        return out(t)

    return case


def _broadcast_objects(src: Callable[[int], int]) -> Callable[[Gang], Any]:
    def case(g: Gang) -> Any:
        first = {"a": [1, 2]}
        objects: list[object] = [first, "x", 3]
        s = src(g.size)
        g.broadcast_objects(objects, s)
        return [objects, objects[0] is first]  # a receiver holds copies, the source its own

    return case


def _unpicklable(g: Gang) -> Any:
    g.broadcast_objects([threading.Lock()], g.size - 1)
    return "no error"


def _barrier(g: Gang) -> Any:
    g.barrier()
    return None


def _create(ranks: list[int]) -> Callable[[Gang], Any]:
    def case(g: Gang) -> Any:
        g.create_gang(ranks)
        return "no error"

    return case


#: name -> (case, expected outcome as a function of (rank, size)).
CASES: dict[str, tuple[Callable[[Gang], Any], Callable[[int, int], Any]]] = {
    "identity": (lambda g: [g.rank, g.size, str(g.device)], lambda r, n: [r, n, "cpu"]),
    "sum_float": (_reduce(F, torch.float32, R.SUM), lambda r, n: ["float32", [x * n for x in F]]),
    "sum_int": (_reduce(INTS, torch.int64, R.SUM), lambda r, n: ["int64", [x * n for x in INTS]]),
    "mean_float": (_reduce(F, torch.float32, R.MEAN), lambda r, n: ["float32", F]),
    "mean_int": (_reduce(INTS, torch.int64, R.MEAN), lambda r, n: ["int64", INTS]),
    "product": (_reduce(F[:2], torch.float64, R.PRODUCT), lambda r, n: ["float64", [x**n for x in F[:2]]]),
    "min": (_reduce(F, torch.float32, R.MIN), lambda r, n: ["float32", F]),
    "max": (_reduce(INTS, torch.int32, R.MAX), lambda r, n: ["int32", INTS]),
    "op_not_an_enum": (lambda g: g.all_reduce(torch.ones(1), "sum"), lambda r, n: "raises TypeError"),  # type: ignore[arg-type]
    "all_gather": (_gather, lambda r, n: ["float32", [[[-2.5, -1.5, -0.5], [0.5, 1.5, 2.5]]] * n]),
    "all_gather_scalar": (_gather_scalar, lambda r, n: ["int32", [-7] * n]),
    "all_gather_bad_shape": (_gather_bad("shape"), lambda r, n: "raises ValueError"),
    "all_gather_noncontiguous": (_gather_bad("noncontiguous"), lambda r, n: "raises ValueError"),
    "all_gather_bad_dtype": (_gather_bad("dtype"), lambda r, n: "raises ValueError"),
    "all_gather_to_list": (_gather_list(0), lambda r, n: [["int64", [7, 8]]] * n),
    "all_gather_to_list_bad_length": (_gather_list(1), lambda r, n: "raises ValueError"),
    "broadcast_first": (_broadcast(lambda n: 0), lambda r, n: ["float32", F]),
    "broadcast_last": (_broadcast(lambda n: n - 1), lambda r, n: ["float32", F]),
    "broadcast_out_of_range": (_broadcast(lambda n: n), lambda r, n: "raises ValueError"),
    "broadcast_negative": (_broadcast(lambda n: -1), lambda r, n: "raises ValueError"),
    "broadcast_objects": (
        _broadcast_objects(lambda n: n - 1),
        lambda r, n: [[{"a": [1, 2]}, "x", 3], r == n - 1],
    ),
    "broadcast_objects_out_of_range": (_broadcast_objects(lambda n: n), lambda r, n: "raises ValueError"),
    "broadcast_objects_unpicklable": (_unpicklable, lambda r, n: "raises TypeError"),
    "barrier": (_barrier, lambda r, n: None),
    "all_sum_float": (lambda g: out(all_sum(g, 2.5)), lambda r, n: ["float32", 2.5 * n]),
    "all_sum_int": (lambda g: out(all_sum(g, 3)), lambda r, n: ["int64", 3 * n]),
    "broadcast_flag_true": (lambda g: broadcast_flag(g, True, g.size - 1), lambda r, n: True),
    "broadcast_flag_false": (lambda g: broadcast_flag(g, False), lambda r, n: False),
    "create_gang_empty": (_create([]), lambda r, n: "raises ValueError"),
    "create_gang_duplicates": (_create([0, 0]), lambda r, n: "raises ValueError"),
    "create_gang_out_of_range": (_create([0, 99]), lambda r, n: "raises ValueError"),
    "create_gang_negative": (_create([-1]), lambda r, n: "raises ValueError"),
}


def attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the outcome of a case
        return f"raises {type(e).__name__}"


def run_table(g: Gang) -> dict[str, Any]:
    return {name: attempt(lambda case=case: case(g)) for name, (case, _) in CASES.items()}


def expected_table(rank: int, size: int) -> dict[str, Any]:
    return {name: expect(rank, size) for name, (_, expect) in CASES.items()}


# ------------------------------------------------------------------------------------------------
# sub-gangs and layouts: everything a root gang of 4 can be split into
# ------------------------------------------------------------------------------------------------

#: (tp_size, intra_node_size) layouts of 4 processes: dp x tp = 4 x 1, 2 x 2, 1 x 4, each with FSDP.
LAYOUTS = [(1, None), (1, 2), (1, 4), (2, None), (2, 2), (4, None)]
SUB_GANGS = [[0, 2], [3, 1], [0, 1, 2, 3], [2]]


def shape(g: Gang) -> list[Any]:
    return [type(g).__name__ == "FakeGang" and g.size == 1, g.rank, g.size]


def sub_gangs(root: Gang) -> dict[str, Any]:
    """create_gang's results, each member's table on its sub-gang, and the rules for sub-gangs."""
    found: dict[str, Any] = {}
    for ranks in SUB_GANGS:
        sub = root.create_gang(ranks)
        key = ",".join(map(str, ranks))
        if sub is None:
            found[key] = None
            continue
        found[key] = {
            "rank_size": [sub.rank, sub.size],
            "table": run_table(sub),
            "nested": attempt(lambda sub=sub: sub.create_gang([0])),
        }
        sub.close()
        found[key]["after_close"] = attempt(lambda sub=sub: sub.all_reduce(torch.ones(1), R.SUM))
        sub.close()  # idempotent
    return found


def layouts(root: Gang) -> dict[str, Any]:
    """For each layout, every gang's (is a size-1 fake, rank, size) and a few collectives on it,
    including on dp = rdp x sdp as a `ProductGang`; invalid layouts' errors."""
    found: dict[str, Any] = {}
    for tp_size, intra in LAYOUTS:
        gangs = create_parallel_gangs(root, tp_size=tp_size)
        gangs = create_fsdp_gangs(gangs, intra)
        entry: dict[str, Any] = {}
        for field in ("dp", "rdp", "sdp", "tp", "pp"):
            g = getattr(gangs, field)
            table = run_table(g)
            entry[field] = shape(g)
            entry[field + "_ops"] = [table[k] for k in ("sum_float", "all_gather", "broadcast_objects")]
        product = ProductGang(gangs.rdp, gangs.sdp)
        entry["rdp_x_sdp"] = [product.rank, product.size, run_table(product)]
        found[f"tp{tp_size}_fsdp{intra}"] = entry
    found["tp3"] = attempt(lambda: create_parallel_gangs(root, tp_size=3))
    found["tp0"] = attempt(lambda: create_parallel_gangs(root, tp_size=0))
    found["fsdp1"] = attempt(lambda: create_fsdp_gangs(create_parallel_gangs(root), 1))
    found["fsdp3"] = attempt(lambda: create_fsdp_gangs(create_parallel_gangs(root), 3))
    found["fsdp4_tp2"] = attempt(lambda: create_fsdp_gangs(create_parallel_gangs(root, tp_size=2), 4))
    return found


def everything(root: Gang) -> dict[str, Any]:
    return {"table": run_table(root), "sub_gangs": sub_gangs(root), "layouts": layouts(root)}


# ------------------------------------------------------------------------------------------------
# real-only: what a fake cannot show (who is in which gang), failures, teardown
# ------------------------------------------------------------------------------------------------


def members(g: Gang, root_rank: int) -> list[int]:
    """The root ranks of ``g``'s members in ``g``'s rank order (an all_gather of each one's rank)."""
    o = torch.empty(g.size, dtype=torch.int64)
    g.all_gather(o, torch.tensor(root_rank))
    return o.tolist()


def resources() -> dict[str, Any]:
    """What this process holds that a gang may leak: threads (OS and Python), sockets, children."""
    gc.collect()
    me = psutil.Process()
    return {
        "threads": me.num_threads(),
        "py_threads": sorted(t.name for t in threading.enumerate()),
        "sockets": len(me.net_connections(kind="inet")),
        "children": [c.pid for c in me.children(recursive=True)],
    }


def init_default(rank: int, size: int, port: int) -> dict[str, Any]:
    """This worker's root gang: torch's default group from torchrun-style environment variables."""
    before = resources()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})  # fmt: skip
    STATE["root"] = ProcessGroupGang.create_default_process_group(
        torch.device("cpu"), timeout=timedelta(seconds=30)
    )
    again = attempt(lambda: ProcessGroupGang.create_default_process_group(torch.device("cpu")))
    bad_device = attempt(lambda: ProcessGroupGang.create_default_process_group(torch.device("meta")))
    return {"before": before, "again": again, "bad_device": bad_device}


def real_everything() -> dict[str, Any]:
    root: ProcessGroupGang = STATE["root"]
    return {**everything(root), "supports_process_group": root.supports_process_group,
            "is_world": root.as_process_group() is torch.distributed.group.WORLD}  # fmt: skip


def real_members() -> dict[str, Any]:
    """Who is in each gang of each layout, as root ranks (what rank/size alone cannot show)."""
    root: Gang = STATE["root"]
    found = {}
    for tp_size, intra in LAYOUTS:
        gangs: Gangs = create_fsdp_gangs(create_parallel_gangs(root, tp_size=tp_size), intra)
        found[f"tp{tp_size}_fsdp{intra}"] = {
            f: members(getattr(gangs, f), root.rank) for f in ("dp", "rdp", "sdp", "tp")
        }
        found[f"tp{tp_size}_fsdp{intra}"]["sum_of_ranks"] = all_sum(gangs.tp, root.rank).item()
    STATE["gangs"] = gangs  # the last layout, closed by close_all
    STATE["pair"] = root.create_gang([2, 3])  # for after_a_peer_died
    return found


def after_a_peer_died() -> dict[str, Any]:
    """A collective with a dead peer (rank 3 of the pair [2, 3]): a GangError, and fairseq2's
    OperationalError made from it."""
    pair: Gang = STATE["pair"]
    try:
        pair.all_reduce(torch.ones(4), R.SUM)
    except GangError as e:
        try:
            raise_operational_gang_error(e)
        except OperationalError as op:
            return {"raised": type(e).__name__, "cause_kept": op.__cause__ is e}
    return {"raised": None}


def close_all() -> dict[str, Any]:
    gangs: Gangs = STATE.pop("gangs")
    root: Gang = STATE.pop("root")
    gangs.close()
    gangs.close()
    root.close()
    return {
        "initialized": torch.distributed.is_initialized(),
        "after_close": attempt(lambda: root.barrier()),
        "as_pg_after_close": attempt(lambda: root.as_process_group()),
        "resources": resources(),
    }


def cuda_default_group(port: int) -> dict[str, Any]:
    """NCCL on one GPU (a gang of one): the collectives on CUDA tensors, high-priority streams."""
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    gang = ProcessGroupGang.create_default_process_group(torch.device("cuda"), high_priority=True)
    t = torch.tensor(F, device=gang.device)
    gang.all_reduce(t, R.MEAN)
    o = torch.empty(1, 3, device=gang.device)
    gang.all_gather(o, t)
    objects: list[object] = [{"a": 1}]
    gang.broadcast_objects(objects)
    gang.barrier()
    found = {"device": gang.device.type, "mean": t.tolist(), "gather": o.tolist(), "objects": objects,
             "flag": broadcast_flag(gang, True), "sum": all_sum(gang, 2).item()}  # fmt: skip
    gang.close()
    found["initialized"] = torch.distributed.is_initialized()
    return found

"""ftlaunch.gang: one table of expectations (tests/gang_scenarios.py) met by `FakeGang` in this
process and by `ProcessGroupGang` over gloo in four real processes - rank by rank the same outcomes,
so the fake is provably what it simulates - plus what only real processes show: who is in which
sub-gang, a dead peer's `GangError`, and a teardown that leaves no thread, socket or child.
"""

from __future__ import annotations

import warnings
from typing import Any

import gang_scenarios as sc
import pytest
import torch
from pg_helpers import WorkerPool, start_unmarked_resource_tracker
from workers.helpers import free_port

from ftlaunch.errors import CommunicationError, FtlaunchError, GangError, NotSupportedError
from ftlaunch.gang import (
    FakeGang,
    GangContext,
    Gangs,
    ProductGang,
    ReduceOperation,
    StandardGangContext,
    create_fake_gangs,
    create_fsdp_gangs,
    create_parallel_gangs,
    get_current_gangs,
    get_default_gangs,
    maybe_get_current_gangs,
    set_default_gangs,
    set_gangs,
)

start_unmarked_resource_tracker()

CPU = torch.device("cpu")
N = 4
T, F = True, False

#: For each layout of 4 processes, each gang's members as blocks of root ranks (from the documented
#: layout: tp gangs of adjacent ranks, dp gangs of every tp_size-th rank; sdp N adjacent dp ranks,
#: rdp every N-th dp rank).
SINGLE = [[0], [1], [2], [3]]
ALL = [[0, 1, 2, 3]]
MEMBERS: dict[str, dict[str, list[list[int]]]] = {
    "tp1_fsdpNone": {"dp": ALL, "rdp": SINGLE, "sdp": ALL, "tp": SINGLE},
    "tp1_fsdp2": {"dp": ALL, "rdp": [[0, 2], [1, 3]], "sdp": [[0, 1], [2, 3]], "tp": SINGLE},
    "tp1_fsdp4": {"dp": ALL, "rdp": SINGLE, "sdp": ALL, "tp": SINGLE},
    "tp2_fsdpNone": {"dp": [[0, 2], [1, 3]], "rdp": SINGLE, "sdp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
    "tp2_fsdp2": {"dp": [[0, 2], [1, 3]], "rdp": SINGLE, "sdp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
    "tp4_fsdpNone": {"dp": SINGLE, "rdp": SINGLE, "sdp": SINGLE, "tp": ALL},
}


def block(blocks: list[list[int]], rank: int) -> list[int]:
    return next(b for b in blocks if rank in b)


def expected_shapes(layout: str, rank: int) -> dict[str, list[Any]]:
    """[is a size-1 placeholder, rank, size] of each gang of ``layout`` at root rank ``rank``."""
    found = {}
    for field, blocks in MEMBERS[layout].items():
        b = block(blocks, rank)
        found[field] = [len(b) == 1, b.index(rank), len(b)]
    found["pp"] = [True, 0, 1]
    return found


# ------------------------------------------------------------------------------------------------
# FakeGang, in this process
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_fake_gang_meets_the_whole_table(size: int) -> None:
    for rank in range(size):
        assert sc.run_table(FakeGang(CPU, rank=rank, size=size)) == sc.expected_table(rank, size)


def test_fake_sub_gangs_number_members_in_rank_order_and_none_outside() -> None:
    expected = {
        "0,2": {0: [0, 2], 2: [1, 2]},
        "3,1": {1: [0, 2], 3: [1, 2]},
        "0,1,2,3": {r: [r, 4] for r in range(N)},
        "2": {2: [0, 1]},
    }
    for rank in range(N):
        found = sc.sub_gangs(FakeGang(CPU, rank=rank, size=N))
        for key, members in expected.items():
            if rank not in members:
                assert found[key] is None, (key, rank)
                continue
            sub = found[key]
            assert sub["rank_size"] == members[rank]
            assert sub["table"] == sc.expected_table(*members[rank])
            assert sub["nested"] == "raises InvalidOperationError"  # as torch: only from the root
            assert sub["after_close"] == "raises InvalidOperationError"


@pytest.mark.parametrize("layout", list(MEMBERS))
def test_fake_layouts_1x4_2x2_4x1_with_fsdp(layout: str) -> None:
    for rank in range(N):
        found = sc.layouts(FakeGang(CPU, rank=rank, size=N))[layout]
        assert {f: found[f] for f in ("dp", "rdp", "sdp", "tp", "pp")} == expected_shapes(layout, rank)
        for field in ("dp", "rdp", "sdp", "tp", "pp"):
            size = found[field][2]
            assert found[field + "_ops"][0] == ["float32", [x * size for x in sc.F]]
        product_rank, product_size, table = found["rdp_x_sdp"]
        assert product_size == found["dp"][2] and table == sc.expected_table(product_rank, product_size)


def test_invalid_layouts_raise_value_errors() -> None:
    found = sc.layouts(FakeGang(CPU, rank=1, size=N))
    assert {k: found[k] for k in ("tp3", "tp0", "fsdp1", "fsdp3", "fsdp4_tp2")} == dict.fromkeys(
        ("tp3", "tp0", "fsdp1", "fsdp3", "fsdp4_tp2"), "raises ValueError"
    )


def test_fake_gang_arguments_and_process_group() -> None:
    for bad in ({"size": 0}, {"rank": 4, "size": 4}, {"rank": -1, "size": 2}):
        with pytest.raises(ValueError):
            FakeGang(CPU, **bad)
    with pytest.raises(ValueError, match="meta"):
        FakeGang(torch.device("meta"))
    g = FakeGang(CPU, rank=2, size=3)
    assert not g.supports_process_group
    with pytest.raises(NotSupportedError):
        g.as_process_group()
    assert issubclass(NotSupportedError, NotImplementedError) and issubclass(NotSupportedError, FtlaunchError)


def _params(fn: Any) -> str:
    """A callable's parameters as fairseq2's reference writes them: names, keyword-only marker, defaults."""
    import inspect

    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind is p.VAR_KEYWORD:
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def test_names_and_signatures_are_fairseq2s() -> None:
    import ftlaunch.gang as g

    assert set(g.__all__) >= {
        "Gang", "ProcessGroupGang", "FakeGang", "Gangs", "ReduceOperation", "create_parallel_gangs",
        "create_fsdp_gangs", "create_fake_gangs", "maybe_get_current_gangs", "broadcast_flag", "all_sum",
        "GangError", "raise_operational_gang_error", "GangContext", "get_current_gangs", "set_gangs",
        "get_default_gangs", "set_default_gangs",
    }  # fmt: skip
    assert [(op.name, op.value) for op in g.ReduceOperation] == [
        ("SUM", 1), ("MEAN", 2), ("PRODUCT", 3), ("MIN", 4), ("MAX", 5)]  # fmt: skip
    expected = {
        g.Gang.create_gang: "ranks",
        g.Gang.all_reduce: "tensor, op",
        g.Gang.all_gather: "output_tensor, input_tensor",
        g.Gang.all_gather_to_list: "output_tensors, input_tensor",
        g.Gang.broadcast: "tensor, source_rank=0",
        g.Gang.broadcast_objects: "objects, source_rank=0",
        g.ProcessGroupGang.create_default_process_group: "device, *, timeout=None, high_priority=False",
        g.FakeGang: "device, *, rank=0, size=1",
        g.Gangs: "*, root, dp, rdp, sdp, tp, pp",
        g.create_parallel_gangs: "root_gang, *, tp_size=1",
        g.create_fsdp_gangs: "gangs, intra_node_size=None",
        g.create_fake_gangs: "device",
        g.maybe_get_current_gangs: "",
        g.get_current_gangs: "device=None",
        g.set_gangs: "gangs, *, meta=False",
        g.get_default_gangs: "device=None",
        g.set_default_gangs: "gangs, *, meta=False",
        g.GangContext.get_current_gangs: "device=None",
        g.GangContext.set_gangs: "gangs, *, meta=False",
        g.broadcast_flag: "gang, flag, source_rank=0",
        g.all_sum: "gang, value",
        g.raise_operational_gang_error: "cause",
    }
    assert {fn.__qualname__: _params(fn) for fn in expected} == {
        fn.__qualname__: v for fn, v in expected.items()
    }
    for name in ("rank", "size", "device", "supports_process_group"):
        assert isinstance(getattr(g.Gang, name), property)


def test_current_gangs_per_thread_per_device_over_process_defaults() -> None:
    """fairseq2's current-gang context: a thread's `set_gangs` (or ``with gangs:``) for the gangs'
    device, else the process's defaults for that device, else one set of fake gangs of size 1."""
    import threading

    import ftlaunch.gang.gangs as gangs_module

    meta = torch.device("meta")
    fallback = get_default_gangs(CPU)
    assert get_current_gangs(CPU) is fallback and get_default_gangs(CPU) is fallback  # one fake set
    assert fallback.root.size == 1 and isinstance(fallback.dp, FakeGang)
    assert get_default_gangs(meta) is fallback  # the meta device falls back to CPU's fakes
    defaults, mine, inner = create_fake_gangs(CPU), create_fake_gangs(CPU), create_fake_gangs(CPU)
    context: GangContext = StandardGangContext()
    try:
        set_default_gangs(defaults)
        assert get_default_gangs(CPU) is defaults and get_current_gangs(CPU) is defaults
        assert get_default_gangs(meta) is fallback  # not filed under meta without meta=True
        with set_gangs(mine, meta=True):
            assert get_current_gangs(CPU) is mine and context.get_current_gangs(meta) is mine
            with context.set_gangs(inner):
                assert get_current_gangs(CPU) is inner and get_current_gangs(meta) is mine
            assert get_current_gangs(CPU) is mine
            seen: list[Gangs] = []
            t = threading.Thread(target=lambda: seen.append(get_current_gangs(CPU)))
            t.start()
            t.join()
            assert seen == [defaults]  # another thread sees the process's defaults
        assert get_current_gangs(CPU) is defaults and get_current_gangs(meta) is fallback
        with pytest.raises(RuntimeError):  # the stack pops even when the body fails
            with set_gangs(mine):
                raise RuntimeError("boom")
        assert get_current_gangs(CPU) is defaults
        set_default_gangs(mine, meta=True)
        assert get_default_gangs(meta) is mine
    finally:
        with gangs_module._defaults_lock:
            gangs_module._defaults.clear()


def test_gang_error_is_one_communication_error_type() -> None:
    assert issubclass(GangError, CommunicationError)
    assert not issubclass(CommunicationError, GangError)


def test_gangs_check_the_coordinator_and_track_the_current_gangs() -> None:
    lead, other = FakeGang(CPU, rank=0, size=2), FakeGang(CPU, rank=1, size=2)
    with pytest.raises(ValueError, match="coordinator"):
        Gangs(root=lead, dp=other, rdp=lead, sdp=lead, tp=lead, pp=lead)
    gangs, inner = create_fake_gangs(CPU), create_fake_gangs(CPU)
    with pytest.deprecated_call():
        assert maybe_get_current_gangs() is None
    with gangs:
        with pytest.deprecated_call():
            assert maybe_get_current_gangs() is gangs
        with inner:
            with pytest.deprecated_call():
                assert maybe_get_current_gangs() is inner
        with pytest.deprecated_call():
            assert maybe_get_current_gangs() is gangs

        import threading

        seen: list[Gangs | None] = []

        def look() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                seen.append(maybe_get_current_gangs())

        t = threading.Thread(target=look)
        t.start()
        t.join()
        assert seen == [None]  # per thread
    with pytest.deprecated_call():
        assert maybe_get_current_gangs() is None
    t = torch.tensor([2.0])
    gangs.dp.all_reduce(t, ReduceOperation.SUM)
    assert t.item() == 2.0 and gangs.device == CPU


def test_fsdp_without_intra_node_size_is_fully_sharded() -> None:
    gangs = create_fsdp_gangs(create_parallel_gangs(FakeGang(CPU, rank=3, size=8), tp_size=2))
    assert gangs.sdp is gangs.dp and (gangs.dp.rank, gangs.dp.size) == (1, 4)
    assert (gangs.rdp.rank, gangs.rdp.size) == (0, 1) and (gangs.tp.rank, gangs.tp.size) == (1, 2)


def test_a_product_of_fakes_is_the_fake_of_the_product() -> None:
    """dp = rdp x sdp is rank o * inner.size + i of outer.size * inner.size (fairseq2's HSDP order)."""
    for o in range(3):
        for i in range(2):
            g = ProductGang(FakeGang(CPU, rank=o, size=3), FakeGang(CPU, rank=i, size=2))
            assert (g.rank, g.size) == (o * 2 + i, 6)
            assert sc.run_table(g) == sc.expected_table(o * 2 + i, 6)
    with pytest.raises(ValueError, match="devices"):
        ProductGang(FakeGang(CPU), FakeGang(torch.device("cuda")))  # a device name only: no CUDA needed


# ------------------------------------------------------------------------------------------------
# ProcessGroupGang over gloo, four real processes
# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_process_group_gangs_do_what_the_fake_simulates() -> None:
    fake = [sc.everything(FakeGang(CPU, rank=r, size=N)) for r in range(N)]
    with WorkerPool(N) as pool:
        port = free_port()
        inits = pool.run(range(N), sc.init_default, [(r, N, port) for r in range(N)], timeout=120)
        real = pool.run(range(N), sc.real_everything, [()] * N, timeout=240)
        members = pool.run(range(N), sc.real_members, [()] * N, timeout=120)
        pool.kill(3)
        died = pool.run([2], sc.after_a_peer_died, [()], timeout=60)
        closed = pool.run([0, 1, 2], sc.close_all, [()] * 3, timeout=60)

    for r in range(N):
        assert inits[r]["again"] == "raises InvalidOperationError"
        assert inits[r]["bad_device"] == "raises ValueError"
        assert real[r]["supports_process_group"] and real[r]["is_world"]
        # Rank by rank, the real gangs did what the fake says - and that is what the table expects.
        assert real[r]["table"] == fake[r]["table"] == sc.expected_table(r, N)
        assert real[r]["sub_gangs"] == fake[r]["sub_gangs"]
        assert real[r]["layouts"] == fake[r]["layouts"]
        # What a fake cannot show: the members of each gang, by root rank.
        for layout, blocks in MEMBERS.items():
            for field in ("dp", "rdp", "sdp", "tp"):
                assert members[r][layout][field] == block(blocks[field], r), (r, layout, field)
            assert members[r][layout]["sum_of_ranks"] == sum(block(blocks["tp"], r))

    assert died == [{"raised": "GangError", "cause_kept": True}]
    for r, c in zip([0, 1, 2], closed, strict=True):
        before = inits[r]["before"]
        assert not c["initialized"]
        assert c["after_close"] == c["as_pg_after_close"] == "raises InvalidOperationError"
        # Nothing left: gloo's threads, the store's and peers' sockets, all gone with the groups.
        assert c["resources"] == before, (r, before, c["resources"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL's default group on a GPU)")
@pytest.mark.timeout(180)
def test_nccl_default_group_on_one_gpu() -> None:
    with WorkerPool(1) as pool:
        found = pool.run([0], sc.cuda_default_group, [(free_port(),)], timeout=150)[0]
    assert found == {"device": "cuda", "mean": sc.F, "gather": [sc.F], "objects": [{"a": 1}], "flag": True,
                     "sum": 2, "initialized": False}  # fmt: skip

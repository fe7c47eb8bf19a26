"""`ManagedGang` (the fault-tolerant replica gang) and ``ft.gangs()``'s layout, in one process: the
Manager on a FakeProcessGroup (a world of identical peers) with a scripted lighthouse, as in
tests/unit/test_manager_protocol.py. tests/processes/test_gang_ft.py runs them under the real launcher with
kills.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gang_scenarios as sc
import pytest
import test_manager_protocol as protocol
import torch
import torch.distributed as dist
from test_manager_protocol import Group, ScriptedLighthouse, in_step, peer, quorum

from ftlaunch.errors import FtlaunchError, GangError, InvalidOperationError, NotSupportedError
from ftlaunch.gang import FakeGang, ProductGang, ReduceOperation, all_sum
from ftlaunch.worker.managed_gang import ManagedGang, fault_tolerant_gangs
from ftlaunch.worker.managed_pg import ManagedProcessGroup
from ftlaunch.worker.recovery import MANAGER_STATE_KEY

pytestmark = pytest.mark.timeout(60)

#: The Manager-on-fakes factory fixture of tests/unit/test_manager_protocol.py, registered here by this name.
make_group = protocol.make

CPU = torch.device("cpu")
R = ReduceOperation

#: The table cases a FakeProcessGroup can simulate: its broadcast keeps every rank's own tensor
#: (identical peers), which a pickled broadcast - length, then bytes - is not. Those run for real
#: in tests/processes/test_gang_ft.py.
SIMULATED = [name for name in sc.CASES if not name.startswith("broadcast_objects")]


def test_membership_is_the_quorums_and_changes_from_step_to_step(make_group: Callable[..., Group]) -> None:
    lighthouse = ScriptedLighthouse(
        in_step(1, "rg0", us="rg1"), in_step(2, "rg0", "rg2", us="rg1"), in_step(3, us="rg1")
    )
    g = make_group(lighthouse, replica_id="rg1", init_sync=False)
    gang = ManagedGang(g.m, CPU)
    with pytest.raises(InvalidOperationError, match="begin_step"):
        gang.size  # noqa: B018 - no quorum yet, so no membership
    seen = []
    for _ in range(3):
        gang.begin_step()
        gang.begin_step()  # idempotent within a step
        t = torch.tensor([1.0, 2.0])
        gang.all_reduce(t, R.SUM)
        seen.append((gang.rank, gang.size, t.tolist()))
        assert gang.should_commit()
    assert seen == [(1, 2, [2.0, 4.0]), (1, 3, [3.0, 6.0]), (0, 1, [1.0, 2.0])]
    assert (gang.rank, gang.size) == (0, 1)  # between steps: the last quorum's
    assert len(lighthouse.asked) == 3 and g.m.current_step() == 3


def test_the_table_in_a_quorum_of_identical_peers(make_group: Callable[..., Group]) -> None:
    g = make_group(ScriptedLighthouse(in_step(1, "rg1", "rg2")), init_sync=False)
    gang = ManagedGang(g.m, CPU)
    gang.begin_step()
    found = sc.run_table(gang)
    expected = sc.expected_table(0, 3)
    assert {k: found[k] for k in SIMULATED} == {k: expected[k] for k in SIMULATED}
    assert gang.should_commit()  # misuse raised ValueError/TypeError but failed nothing


def test_a_healing_group_contributes_nothing_to_any_reduction(make_group: Callable[..., Group]) -> None:
    g = make_group(ScriptedLighthouse(quorum(3, peer("rg0", 5), peer("rg2", 5), us="rg1")), replica_id="rg1")
    g.transport.inbox[("mem://rg0", 5)] = {
        MANAGER_STATE_KEY: {"step": 5, "batches_committed": 5},
        "default": {"w": 1},
    }
    gang = ManagedGang(g.m, CPU)
    gang.begin_step()
    contributed = {}
    for op in R:
        gang.all_reduce(torch.tensor([4.0, -4.0]), op)
        contributed[op.name] = g.pg.ops[-1].inputs[0].tolist()
    assert contributed == {
        "SUM": [0.0, 0.0], "MEAN": [0.0, 0.0],  # zeros, and MEAN divides by the 2 up-to-date groups
        "PRODUCT": [1.0, 1.0], "MIN": [math.inf, math.inf], "MAX": [-math.inf, -math.inf],
    }  # fmt: skip
    i = torch.tensor([7], dtype=torch.int32)
    gang.all_reduce(i, R.MIN)
    assert g.pg.ops[-1].inputs[0].tolist() == [2**31 - 1]
    assert gang.should_commit() and g.user.value == {"w": 1}  # healed at the commit


def test_mean_divides_by_the_up_to_date_groups(make_group: Callable[..., Group]) -> None:
    g = make_group(ScriptedLighthouse(quorum(2, peer("rg1", 3), peer("rg2", 1))))
    g.m.load_state_dict({"step": 3, "batches_committed": 3})
    gang = ManagedGang(g.m, CPU)
    gang.begin_step()
    t, i = torch.tensor([6.0]), torch.tensor([7], dtype=torch.int64)
    gang.all_reduce(t, R.MEAN)
    gang.all_reduce(i, R.MEAN)
    # identical peers: 3 x (6 / 2 sources); integers: 3 x 7 summed, floor-divided by 2 sources
    assert t.tolist() == [9.0] and i.tolist() == [10]
    assert gang.size == 3 and gang.should_commit()


@pytest.mark.parametrize("op", ["allreduce", "allgather", "broadcast", "barrier"])
def test_a_failed_collective_is_reported_not_raised_and_the_step_committed_nowhere(
    make_group: Callable[..., Group], op: str
) -> None:
    g = make_group(ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1")), init_sync=False)
    gang = ManagedGang(g.m, CPU)
    gang.begin_step()
    g.pg.fail_next(op, RuntimeError("connection reset by peer"))
    t = torch.tensor([1.0, 2.0])
    calls = {
        "allreduce": lambda: gang.all_reduce(t, R.MAX),
        "allgather": lambda: gang.all_gather(torch.empty(2, 2), t),
        "broadcast": lambda: gang.broadcast(t, 1),
        "barrier": gang.barrier,
    }
    calls[op]()  # no GangError: the Manager has it
    assert "connection reset" in str(g.m.errored())
    assert not gang.should_commit()
    gang.begin_step()  # the failure changed the quorum id: a fresh group
    calls[op]()
    assert gang.should_commit()


def test_a_failed_object_broadcast_leaves_the_objects_and_fails_the_step(
    make_group: Callable[..., Group],
) -> None:
    g = make_group(ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1")), init_sync=False)
    gang = ManagedGang(g.m, CPU)
    gang.begin_step()
    g.pg.fail_next("broadcast", RuntimeError("peer gone"))
    objects: list[object] = ["mine"]
    gang.broadcast_objects(objects, 1)  # from the other group: the length never arrives
    assert objects == ["mine"] and [op.name for op in g.pg.ops] == ["broadcast"]
    assert not gang.should_commit()
    gang.begin_step()
    gang.broadcast_objects(objects, 0)  # as the source: length, then the pickle
    assert [op.name for op in g.pg.ops[-3:-1]] == ["broadcast", "broadcast"] and gang.should_commit()


def test_misuse_raises_and_collectives_need_a_step(make_group: Callable[..., Group]) -> None:
    g = make_group(ScriptedLighthouse(in_step(1, "rg1")), init_sync=False)
    gang = ManagedGang(g.m, CPU)
    with pytest.raises(InvalidOperationError, match="outside a step"):
        gang.all_reduce(torch.ones(1), R.SUM)
    with pytest.raises(InvalidOperationError, match="begin_step"):
        gang.should_commit()
    gang.begin_step()
    with pytest.raises(ValueError, match="source_rank"):
        gang.broadcast(torch.ones(1), 2)
    with pytest.raises(ValueError, match="ranks"):
        gang.create_gang([5])
    with pytest.raises(NotSupportedError, match="changes at every step"):
        gang.create_gang([0])
    assert gang.supports_process_group and isinstance(gang.as_process_group(), ManagedProcessGroup)
    assert gang.as_process_group() is gang.as_process_group()
    assert gang.should_commit()
    with pytest.raises(InvalidOperationError, match="outside a step"):
        gang.barrier()


def test_close_shuts_the_manager_down(make_group: Callable[..., Group]) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    g = make_group(lighthouse, init_sync=False)
    gang = ManagedGang(g.m, CPU)
    gang.begin_step()
    assert gang.should_commit()
    gang.close()
    gang.close()  # idempotent
    assert lighthouse.left == ["rg0"] and lighthouse.closed
    for call in (gang.begin_step, lambda: gang.rank, gang.as_process_group):
        with pytest.raises(InvalidOperationError, match="closed"):
            call()
    with pytest.raises(FtlaunchError, match="shut down"):
        g.m.start_quorum()


def test_fault_tolerant_gangs_span_the_replica_groups(make_group: Callable[..., Group]) -> None:
    """Replica group rg1 of 3 (all up to date), 4 workers inside it as a fake, tensor parallel 2."""
    g = make_group(ScriptedLighthouse(in_step(1, "rg0", "rg2", us="rg1")), replica_id="rg1", init_sync=False)
    group_root = FakeGang(CPU, rank=3, size=4)
    released = []
    gangs = fault_tolerant_gangs(g.m, group_root, tp_size=2, release=lambda: released.append(True))
    assert isinstance(gangs.rdp, ManagedGang) and gangs.rdp.in_step  # the first step has begun
    ranks = {
        f: (getattr(gangs, f).rank, getattr(gangs, f).size) for f in ("root", "dp", "rdp", "sdp", "tp", "pp")
    }
    # group rank 3 = dp 1 x tp 1 inside the group; replica rank 1 of 3 across groups
    assert ranks == {"root": (1 * 4 + 3, 12), "dp": (1 * 2 + 1, 6), "rdp": (1, 3), "sdp": (1, 2), "tp": (1,
                                                                                                         2),
                     "pp": (0, 1)}  # fmt: skip
    assert isinstance(gangs.dp, ProductGang) and gangs.dp.inner is gangs.sdp
    assert all_sum(gangs.dp, 1.0).item() == 6.0  # identical peers everywhere: the product's size
    gangs.rdp.begin_step()  # a no-op: the loop's first call, after ft.gangs() began the step
    assert gangs.rdp.should_commit()
    gangs.close()
    assert released == [True]  # ft.gangs() passes ft.shutdown: ft lets go of the group's process group
    gangs.close()
    assert g.m._shutdown
    with pytest.raises(InvalidOperationError):
        gangs.tp.barrier()  # the group's sub-gangs are closed too


def test_gang_errors_from_inside_the_group_still_raise(make_group: Callable[..., Group]) -> None:
    """A product's inner gang is a plain gang: a peer lost inside the replica group raises GangError
    (torchelastic restarts the group); only the replica dimension reports instead of raising."""

    class Broken(FakeGang):
        def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
            raise GangError("peer rank 1 of the replica group is gone")

    g = make_group(ScriptedLighthouse(in_step(1, "rg1")), init_sync=False)
    rdp = ManagedGang(g.m, CPU)
    rdp.begin_step()
    with pytest.raises(GangError):
        ProductGang(rdp, Broken(CPU, rank=0, size=2)).all_reduce(torch.ones(1), R.SUM)
    assert g.m.errored() is None and rdp.should_commit()
    assert dist.is_available()


class _Wire:
    """Two ends of a broadcast in one process: the source's tensors are copied to the receiver's."""

    def __init__(self, payload: list[torch.Tensor] | None = None) -> None:
        self.sent: list[torch.Tensor] = [] if payload is None else payload

    def source(self, t: torch.Tensor, src: int) -> bool:
        self.sent.append(t.clone())
        return True

    def receiver(self, t: torch.Tensor, src: int) -> bool:
        t.copy_(self.sent.pop(0))
        return True


class _NotAWeight:
    pass


class _Exploit:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("code from the network ran",))


def test_objects_crossing_replica_groups_are_decoded_without_running_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ftlaunch.gang.base import broadcast_pickled

    wire = _Wire()
    sent: list[object] = [{"step": 3, "loss": 0.25, "name": "rg0"}, torch.arange(3), [1, (2, 3)]]
    broadcast_pickled(wire.source, list(sent), 0, True, CPU, safe=True)
    got: list[object] = [None, None, None]
    broadcast_pickled(wire.receiver, got, 0, False, CPU, safe=True)
    assert got[0] == sent[0] and torch.equal(got[1], sent[1]) and got[2] == sent[2]  # type: ignore[arg-type]

    # A source refuses what the receivers would refuse, and they all raise the same TypeError.
    with pytest.raises(TypeError, match="cross replica groups"):
        broadcast_pickled(_Wire().source, [_NotAWeight()], 0, True, CPU, safe=True)

    # A hostile peer sending a pickle that calls a function: refused, nothing runs.
    import io
    import pickle

    data = pickle.dumps([_Exploit()])
    wire = _Wire([torch.tensor([len(data)]), torch.frombuffer(bytearray(data), dtype=torch.uint8)])
    with pytest.raises(GangError, match="refused"):
        broadcast_pickled(wire.receiver, [None], 0, False, CPU, safe=True)
    buf = io.BytesIO()
    torch.save([_Exploit()], buf)
    data = buf.getvalue()
    wire = _Wire([torch.tensor([len(data)]), torch.frombuffer(bytearray(data), dtype=torch.uint8)])
    with pytest.raises(GangError, match="refused"):
        broadcast_pickled(wire.receiver, [None], 0, False, CPU, safe=True)
    assert "code from the network ran" not in capsys.readouterr().out

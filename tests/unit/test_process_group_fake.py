"""FakeProcessGroup: a world of identical peers in one process, checked against real Gloo groups."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftlaunch.errors import CommunicationError
from ftlaunch.process_group import ProcessGroup
from ftlaunch.process_group.fake import FakeProcessGroup

R = dist.ReduceOp


def _allreduce(op: Any) -> Callable[[Any], torch.Tensor]:
    def run(pg: Any) -> torch.Tensor:
        t = torch.arange(1.0, 7.0)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([t], opts).wait()
        return t

    return run


def _allgather(pg: Any) -> torch.Tensor:
    outs = [torch.empty(3) for _ in range(pg.size())]
    pg.allgather([outs], [torch.tensor([1.0, 2.0, 3.0])]).wait()
    return torch.stack(outs)


def _broadcast(pg: Any) -> torch.Tensor:
    t = torch.tensor([5.0, 6.0])
    opts = dist.BroadcastOptions()
    opts.rootRank = pg.size() - 1
    pg.broadcast([t], opts).wait()
    return t


def _reduce_scatter(pg: Any) -> torch.Tensor:
    out = torch.empty(2)
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = R.SUM
    pg.reduce_scatter([out], [[torch.full((2,), float(i + 1)) for i in range(pg.size())]], opts).wait()
    return out


def _reduce_scatter_single(pg: Any) -> torch.Tensor:
    out = torch.empty(2)
    pg._reduce_scatter_base(out, torch.arange(2.0 * pg.size()), dist.ReduceScatterOptions()).wait()
    return out


def _all_to_all_single(pg: Any) -> torch.Tensor:
    out = torch.empty(2 * pg.size())
    pg.alltoall_base(out, torch.arange(2.0 * pg.size()), [], [], dist.AllToAllOptions()).wait()
    return out


COLLECTIVES: dict[str, Callable[[Any], torch.Tensor]] = {
    "allreduce-sum": _allreduce(R.SUM),
    "allreduce-min": _allreduce(R.MIN),
    "allreduce-max": _allreduce(R.MAX),
    "allreduce-product": _allreduce(R.PRODUCT),
    "allgather": _allgather,
    "broadcast": _broadcast,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_single": _reduce_scatter_single,
    "all_to_all_single": _all_to_all_single,
}


def _real_gloo(world: int, run: Callable[[Any], torch.Tensor]) -> list[torch.Tensor]:
    """``run`` on every rank of a real Gloo group (threads of this process, a HashStore)."""
    store = dist.HashStore()
    results: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, world, timedelta(seconds=20))
        results[r] = run(pg)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == world, "a real gloo rank did not finish"
    return [results[r] for r in range(world)]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_every_rank_sees_what_real_gloo_gives_identical_peers(name: str, world: int) -> None:
    run = COLLECTIVES[name]
    real = _real_gloo(world, run)
    fake = [run(FakeProcessGroup(r, world)) for r in range(world)]
    for r in range(world):
        torch.testing.assert_close(fake[r], real[r], msg=f"{name}: rank {r} of {world}")


def test_reduce_ops_of_identical_peers() -> None:
    pg = FakeProcessGroup(0, 4)
    assert isinstance(pg, ProcessGroup) and pg.getBackendName() == "ftlaunch-fake"
    for op, expected in [(R.SUM, 12.0), (R.AVG, 3.0), (R.MIN, 3.0), (R.MAX, 3.0), (R.PRODUCT, 81.0)]:
        t = torch.full((2,), 3.0)
        pg.allreduce([t], op).wait()
        assert t.tolist() == [expected] * 2, op
    x = torch.tensor([5, 3])
    pg.allreduce([x], R.BXOR).wait()  # an even number of equal values xors to zero
    assert x.tolist() == [0, 0]
    with pytest.raises(ValueError, match="does not simulate"):
        pg.allreduce([torch.ones(1)], dist._make_nccl_premul_sum(2.0))


def test_torch_collectives_reach_it_as_a_group() -> None:
    pg = FakeProcessGroup(1, 3)
    pg.configure("127.0.0.1:1/fake", 1, 3)  # registers it with torch, as the real groups
    t = torch.ones(2)
    dist.all_reduce(t, group=pg)
    assert t.tolist() == [3.0, 3.0]
    gathered = [torch.empty(2) for _ in range(3)]
    dist.all_gather(gathered, torch.tensor([1.0, 2.0]), group=pg)
    assert [g.tolist() for g in gathered] == [[1.0, 2.0]] * 3
    dist.barrier(group=pg)
    assert [op.name for op in pg.ops] == ["allreduce", "allgather", "barrier"]
    pg.unregister()


def test_configure_takes_effect_and_is_recorded() -> None:
    pg = FakeProcessGroup()
    assert (pg.rank(), pg.size()) == (0, 1)
    pg.configure("host:1234/ftlaunch/q7/r0", 2, 3)
    assert (pg.rank(), pg.size()) == (2, 3)
    assert pg.configure_calls == [("host:1234/ftlaunch/q7/r0", 2, 3)]
    t = torch.ones(1)
    pg.allreduce([t], R.SUM).wait()
    assert t.item() == 3.0 and pg.ops[-1].inputs[0].item() == 1.0  # inputs are recorded as issued
    with pytest.raises(ValueError):
        pg.configure("no port here", 0, 1)
    with pytest.raises(ValueError, match="out of range"):
        pg.configure("host:1/p", 3, 3)
    pg.unregister()


def test_an_injected_failure_surfaces_as_the_real_groups_do() -> None:
    pg = FakeProcessGroup(0, 2)
    pg.fail_next("allreduce", RuntimeError("connection reset by peer"))
    t = torch.ones(1)
    pg.broadcast([t], 0).wait()  # another op is not affected
    work = pg.allreduce([t], R.SUM)
    with pytest.raises(CommunicationError, match="allreduce failed .*connection reset by peer"):
        work.wait()
    with pytest.raises(CommunicationError):
        work.get_future().wait()
    assert t.item() == 1.0  # a failed op writes nothing
    assert isinstance(pg.errored(), CommunicationError)
    with pytest.raises(CommunicationError):  # errored: every op fails fast until configure
        pg.allreduce([t], R.SUM)
    pg.configure("h:1/q2", 0, 2)
    assert pg.errored() is None
    pg.allreduce([t], R.SUM).wait()
    assert t.item() == 2.0
    pg.fail_next(on_issue=True)
    with pytest.raises(CommunicationError, match="injected failure"):
        pg.allgather([[torch.empty(1), torch.empty(1)]], [t])
    pg.unregister()


def test_an_injected_configure_failure_errors_the_group() -> None:
    pg = FakeProcessGroup()
    pg.fail_next("configure")
    with pytest.raises(CommunicationError, match="configure failed"):
        pg.configure("h:1/q1", 0, 2)
    assert isinstance(pg.errored(), CommunicationError)
    pg.configure("h:1/q2", 1, 2)
    assert pg.errored() is None and pg.rank() == 1
    assert [c[0] for c in pg.configure_calls] == ["h:1/q1", "h:1/q2"]
    pg.unregister()


def test_a_hung_op_waits_times_out_and_is_released_by_abort() -> None:
    pg = FakeProcessGroup(0, 2)
    pg.hang_next("allreduce")
    t = torch.ones(1)
    work = pg.allreduce([t], R.SUM)
    fut = work.get_future()
    assert not work.is_completed() and not fut.done()
    t0 = time.monotonic()
    with pytest.raises(CommunicationError, match="not completed within"):
        work.wait(timedelta(seconds=0.1))
    assert 0.05 < time.monotonic() - t0 < 5
    assert pg.aborts == 0
    pg.abort()
    assert work.is_completed() and not work.is_success()
    with pytest.raises(CommunicationError, match="aborted"):
        fut.wait()
    assert t.item() == 1.0
    assert pg.errored() is not None  # the wait timeout was recorded first; abort keeps the group errored
    pg.configure("h:1/q2", 0, 2)
    assert pg.errored() is None


def test_abort_errors_the_group_and_resume_completes_a_hung_op() -> None:
    pg = FakeProcessGroup(0, 2)
    pg.hang_next()
    t = torch.ones(1)
    work = pg.allreduce([t], R.SUM)
    pg.resume()
    assert work.wait() and t.item() == 2.0 and work.get_future().value() == [t]
    pg.abort()
    assert "aborted" in str(pg.errored()) and pg.aborts == 1


def test_shutdown_and_point_to_point() -> None:
    pg = FakeProcessGroup(0, 2)
    with pytest.raises(NotImplementedError, match="send is not supported by the ftlaunch-fake backend"):
        pg.send([torch.ones(1)], 1, 0)
    pg.hang_next()
    hung = pg.allreduce([torch.ones(1)], R.SUM)
    pg.shutdown()
    with pytest.raises(CommunicationError):
        hung.wait()
    with pytest.raises(ValueError, match="shut down"):
        pg.allreduce([torch.ones(1)], R.SUM)
    pg.configure("h:1/q1", 0, 2)  # a configure after shutdown rebuilds it, as with the real groups
    pg.allreduce([torch.ones(1)], R.SUM).wait()
    pg.unregister()

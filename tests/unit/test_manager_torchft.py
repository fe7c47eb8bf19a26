"""torchft's Manager options and helpers, on the single-process protocol harness of
tests/unit/test_manager_protocol.py (scripted lighthouse, FakeProcessGroup, in-memory transport):
``world_size_mode``/``WorldSizeMode``, ``port``, ``allreduce`` returning a Work, ``wrap_future``,
``allow_state_dict_read``/``disallow_state_dict_read`` and ``set_state_dict_fns``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import test_manager_protocol
import torch
import torch.distributed as dist
from test_manager_protocol import Group, ScriptedLighthouse, in_step, quorum
from test_manager_protocol import peer as member

from ftlaunch.errors import CommunicationError
from ftlaunch.manager import WorldSizeMode as ShimWorldSizeMode
from ftlaunch.worker.managed_work import ManagedWork
from ftlaunch.worker.manager import WorldSizeMode

pytestmark = pytest.mark.timeout(60)

#: tests/unit/test_manager_protocol.py's fixture: a Manager on fakes, shut down after the test.
make = test_manager_protocol.make


# ------------------------------------------------------------------------------ world_size_mode


def test_world_size_mode_is_torchfts_enum_at_torchfts_path() -> None:
    import ftlaunch

    assert ShimWorldSizeMode is WorldSizeMode is ftlaunch.WorldSizeMode
    assert [m.name for m in WorldSizeMode] == ["DYNAMIC", "FIXED_WITH_SPARES"]


@pytest.mark.parametrize(
    ("us", "mode", "sent", "received", "rank", "participants"),
    [
        # DYNAMIC: all three up-to-date groups count, each sends grad / 3 (the fake sums 3 copies).
        ("rg2", WorldSizeMode.DYNAMIC, 2.0, 6.0, 2, 3),
        # FIXED_WITH_SPARES with min_replica_size=2: rg0, rg1 count (grad / 2); rg2 is a spare
        # and sends zeros, but still takes part and steps.
        ("rg0", WorldSizeMode.FIXED_WITH_SPARES, 3.0, 9.0, 0, 2),
        ("rg2", WorldSizeMode.FIXED_WITH_SPARES, 0.0, 0.0, None, 2),
    ],
)
def test_world_size_mode_decides_who_counts_and_the_divisor(
    make: Callable[..., Group],
    us: str,
    mode: WorldSizeMode,
    sent: float,
    received: float,
    rank: int | None,
    participants: int,
) -> None:
    others = [r for r in ("rg0", "rg1", "rg2") if r != us]
    g = make(
        ScriptedLighthouse(in_step(1, *others, us=us)),
        replica_id=us,
        init_sync=False,
        min_replica_size=2,
        world_size_mode=mode,
    )
    g.m.start_quorum()
    assert g.m.num_participants() == participants and g.m.participating_rank() == rank
    assert g.m.is_participating() is (rank is not None)
    out = g.m.allreduce(torch.full((4,), 6.0)).get_future().wait()
    assert g.pg.ops[-1].inputs[0].tolist() == [sent] * 4
    assert out.tolist() == [received] * 4
    assert g.m.should_commit()  # a spare commits too: it applies the participants' average
    assert g.m.batches_committed() == participants


def test_fixed_with_spares_still_needs_min_replica_size_up_to_date_groups(make: Callable[..., Group]) -> None:
    g = make(
        ScriptedLighthouse(in_step(1, "rg1")),
        min_replica_size=3,
        init_sync=False,
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES,
    )
    assert g.step()[0] is False and g.m.num_participants() == 2


def test_init_sync_step_zero_commits_with_min_replica_size_groups(make: Callable[..., Group]) -> None:
    """At step 0 with init_sync only the primary's gradients count, but every group at step 0 is
    up to date for min_replica_size (torchft's rule): the step commits (it used to never commit)."""
    g = make(ScriptedLighthouse(in_step(1, "rg1")), min_replica_size=2)  # init_sync: rg0 is the primary
    committed, out = g.step()
    assert committed and g.m.num_participants() == 1 and g.m.current_step() == 1
    assert out.tolist() == [12.0] * 4  # only the primary's 6 counts (divisor 1), the fake sums 2 peers
    assert g.step()[0] and g.m.num_participants() == 2


def test_constructor_checks_world_size_mode_and_port(make: Callable[..., Group]) -> None:
    with pytest.raises(TypeError, match="world_size_mode"):
        make(ScriptedLighthouse(in_step(1)), world_size_mode="fixed")
    with pytest.raises(ValueError, match="port"):
        make(ScriptedLighthouse(in_step(1)), port=70000)
    g = make(ScriptedLighthouse(in_step(1)), port=29512, init_sync=False)  # accepted, unused
    assert g.step()[0]


# ------------------------------------------------------------------------------ allreduce's Work


def test_allreduce_returns_a_work(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1, "rg1")), init_sync=False)
    g.m.start_quorum()
    work = g.m.allreduce(torch.full((2,), 4.0))
    assert isinstance(work, dist.Work) and isinstance(work, ManagedWork)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert work.get_future().wait().tolist() == [4.0, 4.0]  # 4 / 2 groups, x 2 identical peers
    work.synchronize()
    g.m.report_error(RuntimeError("bad batch"))
    assert g.m.allreduce(torch.ones(1)).wait() is False  # the step failed: do not use the result
    assert not g.m.should_commit()


def test_a_timed_wait_on_a_hung_allreduce_reports_instead_of_raising(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1")), init_sync=False)
    g.m.start_quorum()
    g.pg.hang_next("allreduce")
    work = g.m.allreduce(torch.ones(3))
    t0 = time.monotonic()
    assert work.wait(timedelta(milliseconds=200)) is False
    assert 0.15 < time.monotonic() - t0 < 5
    assert "did not complete within wait(timeout=" in str(g.m.errored())
    g.pg.resume()
    assert not g.m.should_commit()
    assert g.step()[0]


# ------------------------------------------------------------------------------ wrap_future


def test_wrap_future_passes_values_and_turns_failures_and_timeouts_into_the_default(
    make: Callable[..., Group],
) -> None:
    g = make(ScriptedLighthouse(in_step(1)), init_sync=False)
    g.m.start_quorum()
    ok: torch.futures.Future[int] = torch.futures.Future()
    wrapped = g.m.wrap_future(ok, default=-1)
    ok.set_result(7)
    assert wrapped.wait() == 7 and g.m.errored() is None

    failing: torch.futures.Future[int] = torch.futures.Future()
    wrapped = g.m.wrap_future(failing, default=-1)
    failing.set_exception(RuntimeError("peer gone"))
    assert wrapped.wait() == -1 and "peer gone" in str(g.m.errored())

    g.m.start_quorum()  # a new step: errors are forgotten
    never: torch.futures.Future[int] = torch.futures.Future()
    t0 = time.monotonic()
    assert g.m.wrap_future(never, default=-2, timeout=0.2).wait() == -2
    assert 0.15 < time.monotonic() - t0 < 5
    assert isinstance(g.m.errored(), CommunicationError) and not g.m.should_commit()
    never.set_result(1)  # completing late changes nothing


# ------------------------------------------------------------------------------ state dict access


def test_set_state_dict_fns_registers_state_that_travels(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(quorum(4, member("rg1", 0))), init_sync=True)  # we are the primary
    with pytest.warns(DeprecationWarning, match="register_state_dict_fn"):
        g.m.set_state_dict_fns(lambda sd: None, lambda: {"lr": 0.1})
    assert g.step()[0]  # rg1 waits for the snapshot of this step's end
    g.m.start_quorum()
    g.m.wait_quorum()
    assert g.transport.serving is not None and g.transport.serving["set_state_dict_fns"] == {"lr": 0.1}
    assert g.m.should_commit()


def test_disallowed_state_reads_wait_for_allow(make: Callable[..., Group]) -> None:
    """A source group whose training loop disallowed reads serves the state only once allowed,
    and then the state as it is at that moment (live state: `serve_live_state`)."""
    g = make(ScriptedLighthouse(quorum(4, member("rg1", 2), member("rg2", 5))))
    g.m.serve_live_state()
    g.m.load_state_dict({"step": 5, "batches_committed": 7})
    g.m.disallow_state_dict_read()
    g.m.disallow_state_dict_read()  # idempotent, as torchft's
    g.m.start_quorum()
    time.sleep(0.3)
    assert g.transport.events == []  # the quorum thread waits at the gate
    g.user.value = {"w": 99}  # changed while reads were disallowed
    g.m.allow_state_dict_read()
    g.m.wait_quorum()
    assert g.transport.serving is not None and g.transport.serving["default"] == {"w": 99}
    assert g.m.should_commit()


def test_reads_disallowed_past_the_heal_timeout_fail_the_step(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(quorum(4, member("rg1", 2), member("rg2", 5))), heal_timeout=0.3)
    g.m.serve_live_state()
    g.m.load_state_dict({"step": 5, "batches_committed": 7})
    g.m.disallow_state_dict_read()
    t0 = time.monotonic()
    committed, _ = g.step()
    assert not committed and "reads stayed disallowed" in str(g.m.errored())
    assert time.monotonic() - t0 < 5
    g.m.allow_state_dict_read()


def test_reads_disallowed_at_the_commit_boundary_mean_no_snapshot_and_the_healer_waits(
    make: Callable[..., Group],
) -> None:
    """A snapshot is taken at the boundary, on the training thread: reads it closed itself are not
    waited for (that would wait for itself). No snapshot, no serving; the healer waits; once
    allowed, the next boundary takes one and the healer heals from it."""
    step_of = {"rg2": 5}

    def answer(m: object) -> object:  # rg1 behind; rg2 keeps up, never serving
        step_of["rg2"] = m.step  # type: ignore[attr-defined]
        return quorum(4, member("rg1", 2), member("rg2", step_of["rg2"], staged=False))(m)  # type: ignore[arg-type]

    g = make(ScriptedLighthouse(answer))  # type: ignore[arg-type]
    g.m.load_state_dict({"step": 5, "batches_committed": 7})
    assert g.step()[0]  # rg1 waits: nobody took a snapshot at this boundary
    g.m.disallow_state_dict_read()
    assert g.step()[0] and g.transport.sent == []  # closed at the boundary: no snapshot, rg1 waits again
    g.m.allow_state_dict_read()
    assert g.step()[0] and [e[0] for e in g.transport.events] == ["send", "disallow"]


def test_disallow_waits_for_a_read_in_progress(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(quorum(4, member("rg1", 2), member("rg2", 5))))
    g.m.serve_live_state()
    g.m.load_state_dict({"step": 5, "batches_committed": 7})
    reading, release = threading.Event(), threading.Event()

    def slow_state() -> dict:
        reading.set()
        release.wait(10)
        return {"slow": 1}

    g.m.register_state_dict_fn("slow", lambda sd: None, slow_state)
    g.m.start_quorum()
    assert reading.wait(10)
    disallowed = threading.Event()
    t = threading.Thread(target=lambda: (g.m.disallow_state_dict_read(), disallowed.set()))
    t.start()
    assert not disallowed.wait(0.3)  # the snapshot in progress finishes first
    release.set()
    assert disallowed.wait(10)
    t.join(10)
    g.m.allow_state_dict_read()
    assert g.m.should_commit()
    assert g.transport.events[0] == ("send", [1], 5) and g.transport.serving is None

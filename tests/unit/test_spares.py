"""Hot spares in one process: the pure slot rule (ftlaunch.lighthouse.slots) and the slot table inside
the membership (claims, promotion on a failure, fencing, a spare killed while idle, the job's end),
with a hand-driven clock. The real processes: tests/processes/test_spares_mp.py."""

from __future__ import annotations

import pytest

from ftlaunch.lighthouse.membership import Evicted, Membership
from ftlaunch.lighthouse.quorum import QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.slots import Claimant, Holder, SlotView, assign, claimable, replica_id_for
from ftlaunch.lighthouse.spares import ClaimError, ClaimTicket
from ftlaunch.lighthouse.status import LighthouseStatus

# ---- the pure rule ------------------------------------------------------------------------------


def _assign(slots: list[SlotView], claimants: list[Claimant], now: float = 10.0) -> dict[str, int]:
    return assign(slots, claimants, now=now, started=0.0, arrival_grace=5.0, unclaimed_grace=60.0)


def test_names_of_a_slots_holders() -> None:
    assert [replica_id_for(1, g) for g in range(3)] == ["rg1", "rg1.1", "rg1.2"]


def test_a_group_gets_the_slot_it_was_started_for_and_a_spare_waits() -> None:
    slots = [SlotView(0), SlotView(1)]
    out = _assign(slots, [Claimant("g2.0", None, 1.0), Claimant("g1.0", 1, 2.0), Claimant("g0.0", 0, 3.0)])
    assert out == {"g0.0": 0, "g1.0": 1}  # the spare (no preference) came first and still waits


def test_a_spare_takes_a_failed_slot_longest_waiting_first() -> None:
    slots = [SlotView(0, "g0.0", Holder.LIVE), SlotView(1, "g1.0", Holder.DOWN)]
    out = _assign(slots, [Claimant("g3.0", None, 2.0), Claimant("g2.0", None, 1.0)])
    assert out == {"g2.0": 1}


def test_the_restarted_group_finds_its_slot_taken_and_waits() -> None:
    slots = [SlotView(0, "g0.0", Holder.LIVE), SlotView(1, "g2.0", Holder.LIVE)]
    assert _assign(slots, [Claimant("g1.1", 1, 5.0)]) == {}


def test_without_a_spare_the_restarted_group_reclaims_its_slot() -> None:
    slots = [SlotView(0, "g0.0", Holder.LIVE), SlotView(1, "g1.0", Holder.DOWN)]
    assert _assign(slots, [Claimant("g1.1", 1, 5.0)]) == {"g1.1": 1}


def test_a_holder_claiming_again_keeps_its_slot_and_live_slots_are_never_taken() -> None:
    slots = [SlotView(0, "g0.0", Holder.LIVE), SlotView(1, "g1.0", Holder.LIVE)]
    assert _assign(slots, [Claimant("g1.0", 1, 1.0), Claimant("g2.0", None, 0.5)]) == {"g1.0": 1}


def test_a_never_held_slot_waits_for_its_group_until_the_grace() -> None:
    slots = [SlotView(0, "g0.0", Holder.LIVE), SlotView(1)]
    spare = [Claimant("g2.0", None, 1.0)]
    assert _assign(slots, spare, now=30.0) == {}
    assert _assign(slots, spare, now=61.0) == {"g2.0": 1}


def test_an_assigned_holder_that_never_arrives_loses_the_slot_after_the_grace() -> None:
    arriving = SlotView(1, "g2.0", Holder.ARRIVING, assigned_at=10.0, generation=1)  # a promoted spare
    assert not claimable(arriving, 14.0, 5.0, 60.0) and claimable(arriving, 15.5, 5.0, 60.0)
    first = SlotView(1, "g1.0", Holder.ARRIVING, assigned_at=10.0)  # the slot's first holder, starting up
    assert not claimable(first, 15.5, 5.0, 60.0) and claimable(first, 70.5, 5.0, 60.0)
    assert not claimable(SlotView(1, "g1.0", Holder.LEFT), 100.0, 5.0)


# ---- the slot table in the membership -----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(heartbeat_timeout: float = 5.0) -> tuple[Membership, Clock]:
    clock = Clock()
    options = QuorumOptions(min_replicas=1, join_timeout=60.0, heartbeat_timeout=heartbeat_timeout)
    return Membership(options, ids=QuorumIdAllocator(1_700_000_000_000), clock=clock, wall_clock=clock), clock


def granted(ticket: ClaimTicket) -> tuple[int, str]:
    assert ticket.done and ticket.grant is not None, (ticket.done, ticket.error)
    return ticket.grant.slot, ticket.grant.replica_id


def start_job(m: Membership) -> ClaimTicket:
    """Two active groups claim and join, one spare waits."""
    assert granted(m.claim("g0.0", slots=2, preferred=0)) == (0, "rg0")
    assert granted(m.claim("g1.0", slots=2, preferred=1)) == (1, "rg1")
    spare = m.claim("g2.0", slots=2, preferred=2)  # started as a spare: index past the slots
    assert not spare.done
    for rid in ("rg0", "rg1"):
        m.heartbeat(rid)
    return spare


def test_promotion_on_a_lost_connection_fences_the_old_name() -> None:
    m, _ = make()
    spare = start_job(m)
    t = m.request_quorum(QuorumMember("rg0"))
    m.request_quorum(QuorumMember("rg1"))
    assert t.done
    m.connection_lost("rg1")
    assert granted(spare) == (1, "rg1.1") and spare.grant is not None and spare.grant.replaced == "rg1"
    status = m.snapshot()
    assert status.spares is not None and status.spares.promotions == 1 and status.spares.fenced == ("rg1",)
    assert status.group("rg1") is None  # forgotten, not shown as a dead group
    assert [e.event for e in status.history][:2] == ["claimed", "replaced"]
    with pytest.raises(Evicted, match="replaced"):
        m.heartbeat("rg1")  # the old holder wakes up: refused, every time
    with pytest.raises(Evicted):
        m.request_quorum(QuorumMember("rg1"))
    # The promoted spare joins the next quorum with the survivor.
    a, b = m.request_quorum(QuorumMember("rg1.1")), m.request_quorum(QuorumMember("rg0"))
    assert a.done and b.done and b.quorum is not None and b.quorum.replica_ids == ("rg0", "rg1.1")
    # The failed group, restarted, waits as a spare.
    back = m.claim("g1.1", slots=2, preferred=1)
    assert not back.done
    assert [w.claimant for w in m.snapshot().spares.waiting] == ["g1.1"]  # type: ignore[union-attr]


def test_a_hang_promotes_after_the_heartbeat_timeout() -> None:
    m, clock = make(heartbeat_timeout=2.0)
    spare = start_job(m)
    clock.now += 1.5
    m.heartbeat("rg0")
    m.tick()
    assert not spare.done
    clock.now += 1.0  # rg1 silent for 2.5 s
    m.tick()
    assert granted(spare) == (1, "rg1.1")


def test_two_failures_one_spare_the_second_slot_waits_for_its_own_group() -> None:
    m, _ = make()
    spare = start_job(m)
    m.report_failure("rg0", "killed")
    m.report_failure("rg1", "killed")
    assert granted(spare) == (0, "rg0.1")
    back = m.claim("g1.1", slots=2, preferred=1)  # rg1 restarted by its agent: no spare left
    assert granted(back) == (1, "rg1.1")
    assert m.snapshot().spares.promotions == 1  # type: ignore[union-attr]


def test_a_spare_killed_while_idle_disappears_and_nothing_else_moves() -> None:
    m, _ = make()
    spare = start_job(m)
    q = m.snapshot().quorum_id
    m.end_claim(spare, timed_out=False)  # its connection closed
    status = m.snapshot()
    assert status.spares is not None and status.spares.waiting == () and status.quorum_id == q
    assert [s.state for s in status.spares.slots] == ["live", "live"]
    # Its restart registers again.
    again = m.claim("g2.1", slots=2, preferred=2)
    assert not again.done and len(m.snapshot().spares.waiting) == 1  # type: ignore[union-attr]


def test_a_promoted_spare_that_never_arrives_is_replaced_after_the_grace() -> None:
    m, clock = make(heartbeat_timeout=2.0)
    spare = start_job(m)
    other = m.claim("g3.0", slots=2, preferred=3)
    m.connection_lost("rg1")
    assert granted(spare) == (1, "rg1.1") and not other.done
    clock.now += 1.0
    m.heartbeat("rg0")
    m.tick()
    assert not other.done
    clock.now += 1.5
    m.heartbeat("rg0")
    m.tick()
    assert granted(other) == (1, "rg1.2")
    with pytest.raises(Evicted):
        m.heartbeat("rg1.1")


def test_a_promoted_spare_that_dies_at_once_hands_the_slot_on() -> None:
    m, _ = make()
    spare = start_job(m)
    other = m.claim("g3.0", slots=2, preferred=None)
    m.connection_lost("rg1")
    assert granted(spare) == (1, "rg1.1")
    m.heartbeat("rg1.1")
    m.connection_lost("rg1.1")  # died in its first step
    assert granted(other) == (1, "rg1.2")


def test_spares_go_home_when_every_slot_is_done_and_status_round_trips() -> None:
    m, _ = make()
    spare = start_job(m)
    status = m.snapshot()
    assert LighthouseStatus.from_json(status.to_json()) == status
    m.leave("rg0")
    assert not spare.done
    m.leave("rg1")
    assert spare.done and spare.grant is None and spare.done_job


def test_a_claim_for_another_job_size_is_refused() -> None:
    m, _ = make()
    m.claim("g0.0", slots=2, preferred=0)
    with pytest.raises(ClaimError):
        m.claim("g1.0", slots=3, preferred=1)


def test_every_rank_of_a_group_gets_the_same_slot() -> None:
    m, _ = make()
    start_job(m)
    r1 = m.claim("g2.0", slots=2, preferred=2)  # rank 1 of the spare group
    m.connection_lost("rg0")
    assert granted(r1) == (0, "rg0.1")
    late = m.claim("g2.0", slots=2, preferred=2)  # a rank that asks after the grant
    assert granted(late) == (0, "rg0.1")


def test_the_dashboard_shows_slots_and_waiting_spares() -> None:
    from ftlaunch.lighthouse import dashboard

    m, _ = make()
    spare = start_job(m)
    page = dashboard.render(m.snapshot())
    assert "Slots and hot spares (1 waiting, 0 promoted)" in page and "g2.0" in page
    m.connection_lost("rg1")
    assert spare.done
    page = dashboard.render(m.snapshot())
    assert (
        "(0 waiting, 1 promoted)" in page and "rg1.1" in page and "Replaced (refused if heard again)" in page
    )


def test_a_spare_between_two_polls_keeps_its_place_and_one_that_stops_asking_is_forgotten() -> None:
    m, clock = make(heartbeat_timeout=2.0)
    first = start_job(m)
    second = m.claim("g3.0", slots=2, preferred=None)
    clock.now += 30.0
    m.heartbeat("rg0")
    m.heartbeat("rg1")
    m.end_claim(first, timed_out=True)  # its poll timed out: "ask again"
    m.tick()
    again = m.claim("g2.0", slots=2, preferred=2)
    assert [w.claimant for w in m.snapshot().spares.waiting] == ["g2.0", "g3.0"]  # type: ignore[union-attr]
    m.connection_lost("rg1")
    assert granted(again) == (1, "rg1.1") and not second.done
    m.end_claim(second, timed_out=True)
    clock.now += 2.5  # g3.0 never asked again
    m.heartbeat("rg0")
    m.heartbeat("rg1.1")
    m.tick()
    assert m.snapshot().spares.waiting == ()  # type: ignore[union-attr]


def test_the_launcher_counts_a_failure_recovered_when_the_spare_that_took_its_slot_commits() -> None:
    from ftlaunch.launcher.group import Group
    from ftlaunch.launcher.spares import Takeovers
    from ftlaunch.lighthouse.status import SlotStatus, SparesStatus

    takeovers, failed = Takeovers(2), Group(1)
    failed.agent_started()
    failed.workers_started(0, {0: 100}, now=1.0)
    assert failed.worker_exited(100, 0, 0, True, "killed by SIGKILL", now=10.0) is not None
    before = SparesStatus(slots=(SlotStatus(0, "rg0", "g0.0", "live"), SlotStatus(1, "rg1", "g1.0", "live")))
    assert takeovers.names(before) == {"rg0": 0, "rg1": 1} and takeovers.committed(1) is None
    after = SparesStatus(slots=(SlotStatus(0, "rg0", "g0.0", "live"), SlotStatus(1, "rg1.1", "g2.0", "live")))
    assert takeovers.names(after) == {"rg0": 0, "rg1.1": 2}  # progress of rg1.1 is group 2's
    assert takeovers.holder == {0: 0, 1: 2} and takeovers.committed(0) is None
    replaced = takeovers.committed(2)
    assert replaced == 1 and failed.slot_taken_over(10.25) == pytest.approx(0.25)
    assert failed.rejoin_times == [pytest.approx(0.25)] and failed.failure_at is None
    assert takeovers.committed(2) is None  # counted once


# ---- the launch paths publish the spares ----------------------------------------------------------


def test_every_launch_path_knows_the_spares() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from ftlaunch import env
    from ftlaunch.errors import ConfigurationError
    from ftlaunch.launcher.cli import options_from_args
    from ftlaunch.launcher.rendezvous import FtRendezvousConfig

    assert options_from_args(["--replicas", "2", "--spares", "1", "scripts/train_ddp.py"]).spares == 1
    job = env.JobEnv(2, 2, "http://127.0.0.1:1", spares=1)
    assert job.starts_as_spare and job.to_environ()[env.FTLAUNCH_SPARES] == "1"
    assert env.JobEnv.from_environ(job.to_environ()) == job
    with pytest.raises(ConfigurationError, match="outside 0..1"):
        env.JobEnv(2, 2, "http://127.0.0.1:1")

    def conf(**kw: str) -> FtRendezvousConfig:
        params = RendezvousParameters(
            backend="ftlaunch", endpoint="127.0.0.1:1", run_id="t", min_nodes=1, max_nodes=1, **kw
        )
        return FtRendezvousConfig.from_params(params, environ={})

    assert conf(replica_group_id="2", num_replica_groups="2", spares="1").spares == 1
    with pytest.raises(ConfigurationError, match="must be in 0..1"):
        conf(replica_group_id="2", num_replica_groups="2")


def test_the_torchx_components_add_spare_group_roles() -> None:
    pytest.importorskip("torchx")
    import ftlaunch

    app = ftlaunch.ddp(script="train.py", replicas=2, spares=1)
    assert [r.name for r in app.roles] == ["lighthouse", "rg0", "rg1", "rg2"]
    spare = app.roles[3]
    assert (
        spare.args[spare.args.index("--group") + 1] == "2"
        and spare.args[spare.args.index("--spares") + 1] == "1"
    )
    assert spare.env["FTLAUNCH_SPARES"] == "1"
    lighthouse = app.roles[0].args
    assert lighthouse[lighthouse.index("--groups") + 1] == "3"  # exit files of every group role

    from ftlaunch.launcher.group_role import build_parser, torchrun_argv

    args = build_parser().parse_args(spare.args[2 : spare.args.index("--")] + ["--"])
    assert "spares=1" in torchrun_argv(args, "127.0.0.1:1", None)[3]


def test_a_group_restarted_after_the_end_is_told_done_not_given_a_slot_to_train_alone() -> None:
    from ftlaunch.lighthouse.slots import all_done

    assert all_done([SlotView(0, "g0.0", Holder.LEFT), SlotView(1, "g1.0", Holder.DOWN)])
    assert not all_done([SlotView(0, "g0.0", Holder.LEFT), SlotView(1, "g1.0", Holder.LIVE)])
    assert not all_done(
        [SlotView(0, "g0.0", Holder.DOWN), SlotView(1, "g1.0", Holder.DOWN)]
    )  # a crash, not the end
    m, _ = make()
    start_job(m)
    m.connection_lost("rg1")  # the spare takes slot 1 ...
    m.heartbeat("rg1.1")
    m.leave("rg0")
    m.leave("rg1.1")  # ... and the training ends before rg1's restart is back
    late = m.claim("g1.1", slots=2, preferred=1)
    assert late.done and late.grant is None and late.done_job


def test_a_script_failing_through_finally_does_not_leave_so_its_slot_goes_to_a_spare() -> None:
    """A graceful leave means "this shard is done" with spares: ft.shutdown() in a ``finally:``
    while an exception propagates closes the connections instead (a failure, as for a crash)."""
    from unittest import mock

    import torch

    from ftlaunch.timeouts import Timeouts
    from ftlaunch.worker.fault_tolerance import FaultTolerance

    def make_ft() -> tuple[FaultTolerance, mock.Mock]:
        manager = mock.Mock()
        ft = FaultTolerance(manager=manager, pg=mock.Mock(), replica_group_id=0, num_replica_groups=1, rank=0,
                            world_size=1, device=torch.device("cpu"), backend="gloo", transport="pg",
                            timeouts=Timeouts.derive(10))  # fmt: skip
        return ft, manager

    ft, manager = make_ft()
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("the training failed")
        finally:
            ft.shutdown()
    assert manager.shutdown.call_args_list[0] == mock.call(leave=False)
    ft, manager = make_ft()
    with pytest.raises(SystemExit), ft:
        raise SystemExit(0)  # a clean exit: leave
    ft2, manager2 = make_ft()
    ft2.shutdown()
    assert manager.shutdown.call_args_list == [mock.call()] and manager2.shutdown.call_args_list == [
        mock.call()
    ]

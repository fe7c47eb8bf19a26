"""Stepping on the last quorum while the lighthouse is unreachable (worker/outage.py).

In one process: the Manager on fakes (tests/unit/test_manager_protocol.py) behind the real
`OutageTolerantClient`, whose scripted inner client plays the lighthouse dying and coming back; the
lighthouse's side (a live lighthouse its groups could not reach accepts the steps they took) on
`Membership` with a hand-driven clock. The real-process run is the soak (scripts/soak.py) and
tests/processes/test_lighthouse_restart_e2e.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import test_manager_protocol
import torch
from test_manager_protocol import Group, ScriptedLighthouse, in_step, peer, quorum

from ftlaunch import env
from ftlaunch.errors import LighthouseUnavailableError, QuorumTimeoutError
from ftlaunch.lighthouse.membership import ImplausibleStep, Membership
from ftlaunch.lighthouse.protocol import RESUME_KEY
from ftlaunch.lighthouse.quorum import Quorum, QuorumIdAllocator, QuorumMember, QuorumOptions
from ftlaunch.lighthouse.reconnect import OutageTolerantClient
from ftlaunch.worker.exactly_once import ExactlyOnceSampler
from ftlaunch.worker.outage import LastQuorumSteps, after_heal, healthy
from ftlaunch.worker.plan import plan_step
from ftlaunch.worker.recovery import MANAGER_STATE_KEY

make = test_manager_protocol.make  # the fixture: a Manager on fakes

pytestmark = pytest.mark.timeout(60)

OUR_STORE = test_manager_protocol.OUR_STORE
DOWN = LighthouseUnavailableError("lighthouse unreachable for 0.5s: connection refused")


def behind_outage_client(
    *answers: object, outage_timeout: float = 0.3
) -> tuple[ScriptedLighthouse, OutageTolerantClient]:
    scripted = ScriptedLighthouse(*answers)  # type: ignore[arg-type]
    return scripted, OutageTolerantClient(scripted, outage_timeout)  # type: ignore[arg-type]


def test_a_healthy_group_steps_on_its_last_quorum_while_the_lighthouse_is_down(
    make: Callable[..., Group],
) -> None:
    """Quorum 1 (both groups up to date) committed; the lighthouse dies: the next two steps commit on
    quorum 1 without reconfiguring (the same process group, the same peers); the request that
    reaches the lighthouse again carries the resume report, and its new quorum reconfigures."""
    scripted, client = behind_outage_client(in_step(1, "rg1"), DOWN, DOWN, in_step(9, "rg1"))
    g = make(client, init_sync=False)
    g.m._outage.probe_every = 1  # try the lighthouse at every step (see the probe test)
    assert g.step()[0]
    assert g.step()[0] and g.step()[0]  # two steps on quorum 1, lighthouse down
    assert g.m._outage.steps == 2 and g.m._outage.in_outage
    assert g.pg.configure_calls == [(f"{OUR_STORE}/ftlaunch/q1/r0", 0, 2)]
    assert [op.name for op in g.pg.ops].count("allreduce") >= 4  # gradients and votes went on
    committed, out = g.step()  # the lighthouse is back with quorum 9
    assert committed and out.tolist() == [6.0] * 4
    assert g.pg.configure_calls[-1] == (f"{OUR_STORE}/ftlaunch/q9/r0", 0, 2)
    assert not g.m._outage.in_outage and g.m.current_step() == 4
    assert [m.step for m in scripted.asked] == [0, 1, 2, 3]
    assert RESUME_KEY not in scripted.asked[1].data  # nothing was known to have failed yet
    assert scripted.asked[3].data[RESUME_KEY] == {"quorum_id": 1, "members": ["rg0", "rg1"]}


def test_in_outage_mode_an_unanswered_request_steps_on_again(make: Callable[..., Group]) -> None:
    """The lighthouse is back, but a peer that was refused a moment ago steps on and waits in a
    collective for us: our parked request gets no answer within the short wait, so we step on too
    (no deadlock against the collective); at the next step everyone asks and the quorum forms."""
    scripted, client = behind_outage_client(
        in_step(1, "rg1"), DOWN, QuorumTimeoutError("no quorum within 1s"), in_step(9, "rg1")
    )
    g = make(client, init_sync=False)
    g.m._outage.probe_every = 1
    assert [g.step()[0] for _ in range(4)] == [True] * 4
    assert g.m._outage.steps == 2
    assert [c[0] for c in g.pg.configure_calls] == [
        f"{OUR_STORE}/ftlaunch/q1/r0",
        f"{OUR_STORE}/ftlaunch/q9/r0",
    ]


def test_in_outage_mode_the_lighthouse_is_tried_every_few_steps_by_all_members_together(
    make: Callable[..., Group],
) -> None:
    """Every member is at the same step, so each tries the lighthouse at the same steps (multiples of
    PROBE_EVERY), once; the steps between ask nobody."""
    scripted, client = behind_outage_client(
        in_step(1, "rg1"), in_step(1, "rg1"), DOWN, DOWN, in_step(9, "rg1")
    )
    g = make(client, init_sync=False)
    assert [g.step()[0] for _ in range(10)] == [True] * 10
    assert [m.step for m in scripted.asked] == [0, 1, 2, 4, 8, 9]  # down at 2, probed at 4 and 8
    assert g.m._outage.steps == 6  # steps 2..7 on quorum 1; 8 got quorum 9
    assert [c[0] for c in g.pg.configure_calls] == [
        f"{OUR_STORE}/ftlaunch/q1/r0",
        f"{OUR_STORE}/ftlaunch/q9/r0",
    ]


def test_after_a_committed_heal_the_group_steps_on_the_quorum_at_the_reached_step(
    make: Callable[..., Group],
) -> None:
    """We healed from rg0 (step 5) on quorum 3 and committed (now at 6); the lighthouse dies: the
    next step runs on quorum 3 with both members at step 6 -- nobody heals again, no reconfigure."""
    _, client = behind_outage_client(quorum(3, peer("rg0", 5), us="rg1"), DOWN)
    g = make(client, replica_id="rg1")
    g.transport.inbox[("mem://rg0", 5)] = {
        MANAGER_STATE_KEY: {"step": 5, "batches_committed": 9},
        "default": {"w": 42},
    }
    assert g.step()[0] and g.m.current_step() == 6
    committed, out = g.step()
    assert committed and g.m.current_step() == 7 and g.m._outage.steps == 1
    assert out.tolist() == [6.0] * 4  # both up to date now: our gradient counts
    assert len(g.pg.configure_calls) == 1 and len(g.transport.events) == 1  # no reconfigure, no heal
    healer = QuorumMember("rg1", step=0, data={"heal_ready": True})
    assert after_heal(quorum(3, peer("rg0", 5), us="rg1")(healer),
                      plan_step(quorum(3, peer("rg0", 5), us="rg1")(healer), "rg1")) is not None  # fmt: skip
    # A step in which the healer waited for a snapshot is no complete one to step on.
    waited = quorum(3, peer("rg0", 5, staged=False), us="rg1")(healer)
    assert after_heal(waited, plan_step(waited, "rg1")) is None


class TimedLighthouse(ScriptedLighthouse):
    """The scripted lighthouse, also recording each request's timeout and counting failed
    connections as `LighthouseClient.connection_failures` does (a scripted callable may add some)."""

    def __init__(self, *answers: object) -> None:
        super().__init__(*answers)  # type: ignore[arg-type]
        self.timeouts: list[float] = []
        self.connection_failures = 0

    def quorum(self, member: QuorumMember, timeout: float) -> Quorum:
        self.timeouts.append(timeout)
        return super().quorum(member, timeout)


def test_a_quorum_timeout_outside_an_outage_is_the_lighthouses_answer(make: Callable[..., Group]) -> None:
    """No outage seen: a request unanswered within the short first wait is asked again for the rest
    of the quorum timeout (the lighthouse may be waiting for a join or a hang), and the lighthouse's
    timeout then is raised into the training loop, as before; nothing steps on the last quorum."""
    scripted = TimedLighthouse(in_step(1, "rg1"), QuorumTimeoutError("no quorum within 1s"),
                               QuorumTimeoutError("no quorum"), in_step(1, "rg1"))  # fmt: skip
    client = OutageTolerantClient(scripted, 0.3)  # type: ignore[arg-type]
    g = make(client, init_sync=False)
    assert g.step()[0]
    g.m.start_quorum()
    with pytest.raises(QuorumTimeoutError):  # raised into the training loop, as before
        g.m.allreduce(torch.ones(1))
    assert g.m._outage.steps == 0
    first, second = scripted.timeouts[1:]
    assert first == g.m._outage.answer_wait and second == pytest.approx(scripted.timeouts[0] - first)


def test_a_slow_quorum_outside_an_outage_is_waited_for(make: Callable[..., Group]) -> None:
    """No outage seen, the lighthouse answers the second request: the group takes that quorum."""
    scripted = TimedLighthouse(
        in_step(1, "rg1"), QuorumTimeoutError("no quorum within 1s"), in_step(2, "rg1")
    )
    g = make(OutageTolerantClient(scripted, 0.3), init_sync=False)  # type: ignore[arg-type]
    assert g.step()[0] and g.step()[0]
    assert g.m._outage.steps == 0 and not g.m._outage.in_outage
    assert [c[0] for c in g.pg.configure_calls] == [
        f"{OUR_STORE}/ftlaunch/q1/r0",
        f"{OUR_STORE}/ftlaunch/q2/r0",
    ]


def test_a_leader_that_met_the_outage_only_after_the_restart_steps_on_with_its_peers(
    make: Callable[..., Group],
) -> None:
    """The soak's 60 s stall: the lighthouse died right after our step committed and we were
    SIGSTOPped before noticing; our peers stepped on the last quorum and wait in its collective for
    us. We wake up after the lighthouse came back: our request met refused connections, then parked
    at the restarted lighthouse, which waits for the peers' requests -- that never come. Unanswered
    within the short wait after an outage, we step on the last quorum too (before: we waited for the
    quorum timeout, they for the collective timeout, 60 s)."""

    def parked_after_refusals(member: QuorumMember) -> Quorum:
        scripted.connection_failures += 2  # the dead lighthouse refused, the restarted one took it
        raise QuorumTimeoutError("no quorum within 1s")

    scripted = TimedLighthouse(in_step(1, "rg1"), parked_after_refusals, in_step(9, "rg1"))
    g = make(OutageTolerantClient(scripted, 0.3), init_sync=False)  # type: ignore[arg-type]
    g.m._outage.probe_every = 1
    assert g.step()[0]
    committed, out = g.step()  # on quorum 1 again, with the peers waiting in its collective
    assert committed and out.tolist() == [6.0] * 4
    assert g.m._outage.steps == 1 and g.m._outage.in_outage
    assert scripted.timeouts[1] == g.m._outage.answer_wait
    assert g.pg.configure_calls == [(f"{OUR_STORE}/ftlaunch/q1/r0", 0, 2)]  # the same process group
    assert g.step()[0]  # the next probe reaches the lighthouse, with the resume report
    assert scripted.asked[2].data[RESUME_KEY] == {"quorum_id": 1, "members": ["rg0", "rg1"]}
    assert g.pg.configure_calls[-1] == (f"{OUR_STORE}/ftlaunch/q9/r0", 0, 2)


def test_a_step_that_did_not_commit_waits_for_the_lighthouse(make: Callable[..., Group]) -> None:
    """A fallback step needs the last one committed: after a failed step (here a bad batch; in a real
    outage a peer that died) the group waits for the lighthouse -- and gives up after the outage
    timeout (0.3 s here, 300 s by default), as before."""
    _, client = behind_outage_client(in_step(1, "rg1"), DOWN)
    g = make(client, init_sync=False)
    assert g.step(error=RuntimeError("bad batch"))[0] is False
    g.m.start_quorum()
    with pytest.raises(LighthouseUnavailableError, match="outage timeout"):
        g.m.allreduce(torch.ones(1))
    assert g.m._outage.steps == 0


def test_a_failed_fallback_step_ends_the_fallback(make: Callable[..., Group]) -> None:
    """A member died during the outage: the fallback step's collectives fail, nothing commits, and
    the group goes back to waiting for the lighthouse instead of stepping (failing) again."""
    _, client = behind_outage_client(in_step(1, "rg1"), DOWN)
    g = make(client, init_sync=False)
    assert g.step()[0]
    g.pg.fail_next("allreduce", RuntimeError("connection reset by peer"))
    assert g.step()[0] is False
    assert g.m._outage.steps == 1 and not g.m._outage.in_outage
    g.m.start_quorum()
    with pytest.raises(LighthouseUnavailableError, match="outage timeout"):
        g.m.allreduce(torch.ones(1))


def test_the_switch_turns_it_off(make: Callable[..., Group], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.FTLAUNCH_OUTAGE_STEPS, "off")  # read by the Manager built below
    assert not env.WorkerEnv.from_environ().outage_steps
    _, client = behind_outage_client(in_step(1, "rg1"), DOWN)
    g = make(client, init_sync=False)
    assert g.step()[0]
    g.m.start_quorum()
    with pytest.raises(LighthouseUnavailableError):
        g.m.allreduce(torch.ones(1))
    monkeypatch.setenv(env.FTLAUNCH_OUTAGE_STEPS, "1")
    assert env.WorkerEnv.from_environ().outage_steps


def test_only_a_complete_quorum_of_up_to_date_groups_is_healthy() -> None:
    me = QuorumMember("rg0", step=5, store_address="s:1")
    assert healthy(plan_step(quorum(1, peer("rg1", 5))(me), "rg0"))
    assert not healthy(plan_step(quorum(1, peer("rg1", 7))(me), "rg0"))  # we heal
    assert not healthy(plan_step(quorum(1, peer("rg1", 3))(me), "rg0"))  # rg1 heals from us
    first = QuorumMember("rg0", step=0, store_address="s:1")
    assert not healthy(plan_step(quorum(1, peer("rg1", 0))(first), "rg0"))  # init_sync: rg1 copies rg0


def test_without_a_supporting_client_nothing_falls_back(make: Callable[..., Group]) -> None:
    """A bare `QuorumClient` (no outage wait to cut short) gets no fallback: its errors are its own."""
    steps = LastQuorumSteps()
    g = make(ScriptedLighthouse(in_step(1, "rg1"), DOWN), init_sync=False)
    assert g.step()[0]
    g.m.start_quorum()
    with pytest.raises(LighthouseUnavailableError):
        g.m.allreduce(torch.ones(1))
    assert steps.steps == 0 and g.m._outage.steps == 0


# ------------------------------------------------------------------ the lighthouse's side


def test_a_live_lighthouse_its_groups_could_not_reach_accepts_the_steps_they_took() -> None:
    """The lighthouse stayed up but unreachable (a partition): its groups stepped on quorum Q and come
    back further than one step past its highest. A participant of Q reporting Q is accepted; a
    group that was not in Q, or reports another quorum, is refused as before (docs/security.md)."""
    now = [1000.0]
    options = QuorumOptions(min_replicas=2, join_timeout=60.0, heartbeat_timeout=5.0)
    m = Membership(
        options, ids=QuorumIdAllocator(1_700_000_000_000), clock=lambda: now[0], wall_clock=lambda: now[0]
    )
    a, b = m.request_quorum(QuorumMember("rg0", step=4)), m.request_quorum(QuorumMember("rg1", step=4))
    assert a.quorum is not None and b.quorum is not None
    q = a.quorum.quorum_id
    with pytest.raises(ImplausibleStep):
        m.request_quorum(QuorumMember("rg0", step=30))
    with pytest.raises(ImplausibleStep):
        m.request_quorum(
            QuorumMember("rg0", step=30, data={RESUME_KEY: {"quorum_id": q - 1, "members": ["rg0"]}})
        )
    with pytest.raises(ImplausibleStep):
        m.request_quorum(
            QuorumMember("rg9", step=30, data={RESUME_KEY: {"quorum_id": q, "members": ["rg9"]}})
        )
    report = {RESUME_KEY: {"quorum_id": q, "members": ["rg0", "rg1"]}}
    ta = m.request_quorum(QuorumMember("rg0", step=30, data=report))
    tb = m.request_quorum(QuorumMember("rg1", step=30, data=report))
    assert ta.quorum is not None and tb.quorum is not None
    assert [p.step for p in ta.quorum.participants] == [30, 30]
    assert all(RESUME_KEY not in p.data for p in ta.quorum.participants)


def test_the_exactly_once_sampler_follows_the_steps_taken_on_the_last_quorum(
    make: Callable[..., Group],
) -> None:
    """The two-line loop with `ExactlyOnceSampler` through an outage: each step on the last quorum
    plans from the step the group is at (as a lighthouse's quorum would), so the sampler can tell
    which samples every commit trained -- rg0 trains its slice of each step (rg1 the other one),
    none twice, none skipped, across the outage and after the lighthouse is back."""
    _, client = behind_outage_client(in_step(1, "rg1"), DOWN, DOWN, DOWN, in_step(9, "rg1"))
    g = make(client, init_sync=False)
    g.m._outage.probe_every = 1
    sampler = ExactlyOnceSampler(range(64), g.m, rank=0, num_replicas=1, shuffle=False, num_replica_groups=2)
    draws = iter(sampler)
    trained, went_from = [], []
    for _ in range(6):
        batch = [next(draws), next(draws)]  # drawn before the step begins
        assert g.step()[0]
        trained.append(batch)
        went_from.append(g.m.latest_plan()[1].max_step)  # type: ignore[union-attr]
    assert g.m._outage.steps == 3 and went_from == [0, 1, 2, 3, 4, 5]
    ours = [i for batch in trained for i in batch]
    assert len(set(ours)) == 12 and max(ours) < 24  # rg1 trained the other 12 of the first 24
    assert (sampler.epoch, sampler.position) == (0, 24)

"""The Manager's step protocol, in one process: a scripted lighthouse, an in-memory transport, a
FakeProcessGroup (a world of identical peers) and an in-memory group store.

tests/processes/test_manager.py runs the same protocol with real processes, sockets and kills; these tests
pin down each rule of a step (reconfigure, heal, average, vote, refuse) quickly and exactly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftlaunch import env
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import (
    CheckpointTransportError,
    CommunicationError,
    ConfigurationError,
    EvictedError,
    FtlaunchError,
    LighthouseError,
    QuorumTimeoutError,
)
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.timeouts import Timeouts
from ftlaunch.worker import committed
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.managed_pg import ManagedProcessGroup
from ftlaunch.worker.manager import Manager, ManagerParts, ManagerSettings
from ftlaunch.worker.progress import state_checksum
from ftlaunch.worker.recovery import MANAGER_STATE_KEY

pytestmark = pytest.mark.timeout(60)

OUR_STORE = "10.0.0.1:29500"  # the address our group's (in-memory) store is published under

Answer = Quorum | Exception | Callable[[QuorumMember], Quorum]


def peer(replica_id: str, step: int = 0, *, staged: bool = True) -> QuorumMember:
    """Another replica group as the lighthouse lists it: its store and its transport metadata; it
    holds a snapshot to serve (``staged``) and, were it behind, is ready to heal."""
    data: dict[str, Any] = {"ckpt": [f"mem://{replica_id}"], "heal_ready": True}
    if staged:
        data["staged"] = True
    return QuorumMember(replica_id=replica_id, store_address=f"store-{replica_id}:1", step=step, data=data)


def quorum(quorum_id: int, *peers: QuorumMember, us: str = "rg0") -> Callable[[QuorumMember], Quorum]:
    """A quorum of ``peers`` and us; we appear as we asked (at our step), as the lighthouse echoes."""

    def answer(member: QuorumMember) -> Quorum:
        assert member.replica_id == us
        members = sorted((member, *peers), key=lambda m: m.replica_id)
        return Quorum(quorum_id=quorum_id, participants=tuple(members), created=0.0)

    return answer


def in_step(quorum_id: int, *others: str, us: str = "rg0") -> Callable[[QuorumMember], Quorum]:
    """A quorum whose other groups are at our step (all up to date)."""

    def answer(member: QuorumMember) -> Quorum:
        return quorum(quorum_id, *(peer(o, member.step) for o in others), us=us)(member)

    return answer


class ScriptedLighthouse:
    """A `QuorumClient` that answers what the test scripts, in order; the last quorum repeats (the
    lighthouse's fast path: nothing changed, same quorum). An exception in the script is raised."""

    def __init__(self, *answers: Answer) -> None:
        self.answers: list[Answer] = list(answers)
        self.asked: list[QuorumMember] = []
        self.heartbeats: list[str] = []
        self.left: list[str] = []
        self.closed = False
        self.lost_callback: Callable[[str, int, tuple[str, ...]], None] | None = None

    def then(self, *answers: Answer) -> None:
        self.answers.extend(answers)

    def quorum(self, member: QuorumMember, timeout: float) -> Quorum:
        assert timeout > 0
        self.asked.append(member)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer if isinstance(answer, Quorum) else answer(member)

    def start_heartbeat(self, replica_id: str, interval: float) -> object:
        self.heartbeats.append(replica_id)
        return object()

    def leave(self, replica_id: str) -> None:
        self.left.append(replica_id)

    def on_quorum_lost(self, callback: Callable[[str, int, tuple[str, ...]], None] | None) -> None:
        """The Manager registers here; `tell_lost` plays a heartbeat answer with ``lost``."""
        self.lost_callback = callback

    def tell_lost(self, quorum_id: int, *lost: str, us: str = "rg0") -> None:
        assert self.lost_callback is not None
        self.lost_callback(us, quorum_id, lost)

    def close(self) -> None:
        self.closed = True


class MemoryTransport(CheckpointTransport[dict]):
    """Live recovery through memory: ``inbox`` holds what peers serve, ``events`` what happened."""

    def __init__(self, name: str, pg: FakeProcessGroup | None = None) -> None:
        self.name = name
        self.pg = pg
        self.inbox: dict[tuple[str, int], Any] = {}
        self.events: list[tuple[Any, ...]] = []
        self.serving: dict | None = None
        self.sent: list[dict] = []

    def metadata(self) -> str:
        return f"mem://{self.name}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        self.events.append(("send", dst_ranks, step))
        self.serving = state_dict
        self.sent.append(state_dict)

    def disallow_checkpoint(self) -> None:
        # What the cross-group PG had done by then: the vote must come first.
        self.events.append(("disallow", [op.reduce_op for op in self.pg.ops] if self.pg else []))
        self.serving = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        self.events.append(("recv", src_rank, metadata, step))
        if (metadata, step) not in self.inbox:
            raise CheckpointTransportError(f"nothing served at {metadata} for step {step}")
        return self.inbox[(metadata, step)]

    def shutdown(self, wait: bool = True) -> None:
        self.events.append(("shutdown",))


class UserState:
    """The user's state: a value, and what the cross-group PG had done each time it was loaded."""

    def __init__(self, pg: FakeProcessGroup) -> None:
        self.pg = pg
        self.value = {"w": 0}
        self.loaded_after: list[list[str]] = []

    def load(self, sd: dict) -> None:
        self.loaded_after.append([op.name for op in self.pg.ops])
        self.value = dict(sd)

    def save(self) -> dict:
        return dict(self.value)


class Group:
    """One replica group's worker: a Manager on fakes."""

    def __init__(
        self, manager: Manager, pg: FakeProcessGroup, transport: MemoryTransport, user: UserState
    ) -> None:
        self.m, self.pg, self.transport, self.user = manager, pg, transport, user

    def step(self, grad: float = 6.0, error: Exception | None = None) -> tuple[bool, torch.Tensor]:
        """One training step: quorum, one gradient allreduce, commit."""
        self.m.start_quorum()
        out = self.m.allreduce(torch.full((4,), grad)).get_future().wait()
        if error is not None:
            self.m.report_error(error)
        return self.m.should_commit(), out


@pytest.fixture
def make(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Group]]:
    for var in (
        env.RANK,
        env.WORLD_SIZE,
        env.MASTER_ADDR,
        env.MASTER_PORT,
        env.TORCHELASTIC_RESTART_COUNT,
        env.REPLICA_GROUP_ID,
        env.FTLAUNCH_LIGHTHOUSE,
        env.TORCHFT_LIGHTHOUSE,
    ):
        monkeypatch.delenv(var, raising=False)
    made: list[Group] = []

    def make(
        client: ScriptedLighthouse | None,
        *,
        replica_id: str = "rg0",
        rank: int = 0,
        world_size: int = 1,
        store: dist.Store | None = None,
        **kwargs: Any,
    ) -> Group:
        pg = FakeProcessGroup()
        transport = MemoryTransport(f"{replica_id}/r{rank}", pg)
        user = UserState(pg)
        manager = Manager(
            pg=pg, load_state_dict=user.load, state_dict=user.save, replica_id=replica_id, rank=rank,
            world_size=world_size, group_store=store if store is not None else dist.HashStore(),
            store_addr="10.0.0.1", store_port=29500, quorum_client=client, checkpoint_transport=transport,
            **{"timeout": 5.0, **kwargs},
        )  # fmt: skip
        made.append(Group(manager, pg, transport, user))
        return made[-1]

    yield make
    for g in made:
        g.m.shutdown()
        if g.pg._is_registered():
            g.pg.unregister()


# ------------------------------------------------------------------------------ quorum and reconfigure


def test_an_unchanged_quorum_does_not_reconfigure(make: Callable[..., Group]) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    g = make(lighthouse, init_sync=False)
    assert [g.step()[0] for _ in range(3)] == [True] * 3
    assert g.pg.configure_calls == [(f"{OUR_STORE}/ftlaunch/q1/r0", 0, 2)]
    assert g.m.current_step() == 3 and g.m.batches_committed() == 6
    assert [m.step for m in lighthouse.asked] == [0, 1, 2]
    assert lighthouse.asked[0].store_address == OUR_STORE and lighthouse.asked[0].data["ckpt"] == [
        "mem://rg0/r0"
    ]
    # Just started, it may be behind: it waits for its first quorum and says it can heal. Then,
    # nobody behind: no snapshot, no claim (tests below: their use).
    assert [set(m.data) for m in lighthouse.asked] == [{"ckpt", "heal_ready"}, {"ckpt"}, {"ckpt"}]
    assert lighthouse.heartbeats == ["rg0"]


def test_a_new_quorum_id_reconfigures_on_a_fresh_prefix_with_the_new_rank_and_size(
    make: Callable[..., Group],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg0", us="rg1"), in_step(1, "rg0", us="rg1"),
                                    in_step(7, "rg0", "rg2", us="rg1"))  # fmt: skip
    g = make(lighthouse, replica_id="rg1", init_sync=False)
    for _ in range(3):
        assert g.step()[0]
    # The rendezvous is on the store of the first up-to-date group (rg0), under a prefix per quorum.
    assert g.pg.configure_calls == [
        ("store-rg0:1/ftlaunch/q1/r0", 1, 2),
        ("store-rg0:1/ftlaunch/q7/r0", 1, 3),
    ]
    assert (g.pg.rank(), g.pg.size()) == (1, 3)


def test_a_failed_reconfigure_skips_the_step_and_the_next_quorum_retries(make: Callable[..., Group]) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1"))
    g = make(lighthouse, init_sync=False)
    g.pg.fail_next("configure", RuntimeError("connection refused"))
    committed, out = g.step()
    assert not committed and out.tolist() == [6.0] * 4  # nothing to talk to: the tensor as is
    assert isinstance(g.m.errored(), CommunicationError) and "configure failed" in str(g.m.errored())
    assert g.step()[0]
    assert [c[0] for c in g.pg.configure_calls] == [
        f"{OUR_STORE}/ftlaunch/q1/r0",
        f"{OUR_STORE}/ftlaunch/q2/r0",
    ]


# ------------------------------------------------------------------------------ heal


def test_a_group_behind_heals_before_its_forward_pass_and_zeroes_its_gradient(
    make: Callable[..., Group],
) -> None:
    """start_quorum returns with the healed state loaded: the step's forward pass runs on the state
    its source committed (its buffers then change like the source's), not on the stale one."""
    lighthouse = ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1"))
    g = make(lighthouse, replica_id="rg1")
    served = {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 9}, "default": {"w": 42}}
    g.transport.inbox[("mem://rg0", 5)] = served

    g.m.start_quorum()
    assert g.transport.events[0] == ("recv", 0, "mem://rg0", 5)  # from rg0's rank with our group rank
    assert g.user.value == {"w": 42} and g.m.current_step() == 5  # loaded before any collective
    assert g.user.loaded_after == [[]]
    assert g.m.num_participants() == 1 and g.m.participating_rank() is None and not g.m.is_participating()
    g.m.allreduce(torch.full((4,), 6.0)).wait()
    assert g.pg.ops[-1].inputs[0].tolist() == [0.0] * 4  # not a participant this step: zeros
    assert g.m.should_commit()
    assert g.pg.ops[-1].reduce_op == dist.ReduceOp.MIN
    assert g.m.current_step() == 6 and g.m.batches_committed() == 10  # the source's step, + 1


def test_a_group_that_finds_itself_behind_after_its_forward_began_waits_a_step(
    make: Callable[..., Group],
) -> None:
    """A group up to date at its boundary (it took its quorum in the background, its forward pass
    runs) but behind in the quorum -- it was stopped while the others went on -- says it is not
    ready to heal: it waits the step (zeros, no error, nothing loaded), and heals at the next."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg0", us="rg1"), quorum(2, peer("rg0", 9), us="rg1"))
    g = make(lighthouse, replica_id="rg1", init_sync=False)
    assert g.step()[0] and g.m.current_step() == 1
    g.transport.inbox[("mem://rg0", 9)] = {
        MANAGER_STATE_KEY: {"step": 9, "batches_committed": 9},
        "default": {"w": 7},
    }
    committed, out = g.step()
    assert not committed and g.m.errored() is None and out.tolist() == [0.0] * 4
    assert "heal_ready" not in lighthouse.asked[-1].data and g.user.loaded_after == []
    assert g.step()[0] and lighthouse.asked[-1].data["heal_ready"] is True
    assert g.user.value == {"w": 7} and g.m.current_step() == 10 and g.m.errored() is None


@pytest.mark.parametrize("served", [None, {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 5}}],
                         ids=["transfer-fails", "state-lacks-a-key"])  # fmt: skip
def test_a_failed_heal_is_not_committed_and_loads_nothing(
    make: Callable[..., Group], served: dict | None
) -> None:
    g = make(ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1")), replica_id="rg1")
    if served is not None:
        g.transport.inbox[("mem://rg0", 5)] = served
    committed, out = g.step()
    assert not committed and out.tolist() == [0.0] * 4
    assert isinstance(g.m.errored(), CommunicationError)
    assert g.user.loaded_after == [] and g.m.current_step() == 0


def claiming(replica_id: str, step: int, state: dict) -> QuorumMember:
    """A peer at ``step`` that claims (honestly or not) the checksum of ``state``."""
    member = peer(replica_id, step)
    return QuorumMember(
        replica_id=replica_id,
        store_address=member.store_address,
        step=step,
        data={**member.data, "claim": [state_checksum(state)]},
    )


HONEST = {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 9}, "default": {"w": torch.ones(3)}}
POISONED = {MANAGER_STATE_KEY: {"step": 5, "batches_committed": 9}, "default": {"w": torch.full((3,), 1e9)}}


def on_demand(replica_id: str, step: int) -> QuorumMember:
    """A peer at ``step`` that, like us, claims on demand (an empty claim: `plan.claims_wanted`)."""
    member = peer(replica_id, step)
    return QuorumMember(
        replica_id=replica_id,
        store_address=member.store_address,
        step=step,
        data={**member.data, "claim": []},
    )


def test_no_snapshot_and_no_checksum_is_made_while_nobody_heals(
    make: Callable[..., Group], monkeypatch: pytest.MonkeyPatch
) -> None:
    sums: list[int] = []
    copies: list[int] = []
    real_sum, real_stage = committed.state_checksum, committed.stage
    monkeypatch.setattr(committed, "state_checksum", lambda state: sums.append(1) or real_sum(state))
    monkeypatch.setattr(
        committed, "stage", lambda state, step: copies.append(step) or real_stage(state, step)
    )
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    g = make(lighthouse, init_sync=False)
    assert [g.step()[0] for _ in range(3)] == [True] * 3
    assert all("claim" not in m.data and "staged" not in m.data for m in lighthouse.asked)
    assert sums == [] and copies == []


class Forward:
    """Plays a forward pass that updates a buffer in place (BatchNorm statistics) while the quorum
    thread plans, claims and serves: the served state must be the boundary's, not these bytes."""

    def __init__(self, g: Group) -> None:
        self.g, self.real = g, g.m._round.run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.g.user.value["w"].add_(100.0)  # the forward pass, overlapping the quorum thread
        return self.real(*args, **kwargs)


def test_a_source_snapshots_its_committed_state_when_a_heal_is_due_and_serves_that(
    make: Callable[..., Group],
) -> None:
    """The source's side. A healer shows up in a quorum while no source holds a snapshot: it waits
    that step, we commit it. At the next boundary we snapshot our committed state, claim it in our
    first request and serve it -- the snapshot, while the forward pass changes the training
    tensors in place. The step after, nobody is behind: no snapshot."""
    lighthouse = ScriptedLighthouse(quorum(2, peer("rg1", 0)), quorum(2, peer("rg1", 0)), in_step(3, "rg1"))
    g = make(lighthouse, init_sync=False)
    g.m.load_state_dict({"step": 5, "batches_committed": 9})
    g.user.value = {"w": torch.arange(4.0)}
    assert g.step()[0] and g.m.current_step() == 6 and not any(e[0] == "send" for e in g.transport.events)
    assert "staged" not in lighthouse.asked[0].data  # nobody was behind at our boundary

    g.m._round.run = Forward(g)  # type: ignore[method-assign]
    assert g.step()[0]
    offered = {"default": {"w": torch.arange(4.0)}, MANAGER_STATE_KEY: {"step": 6, "batches_committed": 11}}
    asked = lighthouse.asked[1]
    assert (
        asked.step == 6 and asked.data["staged"] is True and asked.data["claim"] == [state_checksum(offered)]
    )
    assert ("send", [1], 6) in g.transport.events
    assert torch.equal(g.transport.sent[-1]["default"]["w"], torch.arange(4.0))  # not the +100
    assert g.transport.sent[-1]["default"]["w"] is not g.user.value["w"]  # a copy, not the training tensor
    assert len(lighthouse.asked) == 2  # no second request: the claim rode on the first
    # The heal committed: nobody behind any more, no snapshot, no claim.
    g.m._round.run = g.m._round.run.real  # type: ignore[attr-defined,method-assign]
    assert g.step()[0] and set(lighthouse.asked[-1].data) == {"ckpt"}


def test_served_live_when_a_heal_is_due_every_member_asks_again_with_the_checksum_of_its_state(
    make: Callable[..., Group],
) -> None:
    """Live mode (LocalSGD, DiLoCo: the state is held still during the quorum): the quorum holds a
    healer (rg1 at step 0 behind our 5) and everyone claims on demand, so we ask again at once,
    claiming, and plan (and serve the live state) from that second answer."""

    def second(member: QuorumMember) -> Quorum:  # the healer claims too (its claim is never used)
        return quorum(2, claiming("rg1", 0, {}), us="rg0")(member)

    lighthouse = ScriptedLighthouse(quorum(2, on_demand("rg1", 0)), second)
    g = make(lighthouse, init_sync=False)
    g.m.serve_live_state()
    g.m.load_state_dict({"step": 5, "batches_committed": 9})
    g.user.value = {"w": torch.arange(4.0)}
    assert g.step()[0]
    offered = {"default": {"w": torch.arange(4.0)}, MANAGER_STATE_KEY: {"step": 5, "batches_committed": 9}}
    assert [m.data["claim"] for m in lighthouse.asked] == [[], [state_checksum(offered)]]
    assert [m.step for m in lighthouse.asked] == [5, 5]
    assert g.pg.configure_calls == [(f"{OUR_STORE}/ftlaunch/q2/r0", 0, 2)]  # configured once, from the second
    assert ("send", [1], 5) in g.transport.events
    # The next step: nobody heals any more, one request, no checksum.
    lighthouse.then(in_step(2, "rg1"))
    lighthouse.answers.pop(0)
    assert g.step()[0] and lighthouse.asked[-1].data["claim"] == [] and len(lighthouse.asked) == 3


def test_a_member_that_does_not_claim_on_demand_means_nobody_asks_again(make: Callable[..., Group]) -> None:
    """The choice depends on the quorum alone: one live member without the empty claim (claims
    off) and nobody asks again -- a lone second request would wait for the others."""
    lighthouse = ScriptedLighthouse(quorum(2, peer("rg1", 0)))
    g = make(lighthouse, init_sync=False)
    g.m.serve_live_state()
    g.m.load_state_dict({"step": 5, "batches_committed": 9})
    assert g.step()[0] and len(lighthouse.asked) == 1


def test_a_healer_rejects_state_that_is_not_what_its_source_claimed(make: Callable[..., Group]) -> None:
    """The source claims the honest state and serves another (valid payload, wrong weights): the
    healer refuses it, loads nothing, and the step commits nowhere; served as claimed, it heals."""
    g = make(ScriptedLighthouse(quorum(3, claiming("rg0", 5, HONEST), us="rg1")), replica_id="rg1")
    g.transport.inbox[("mem://rg0", 5)] = POISONED
    committed, _ = g.step()
    assert not committed and g.user.loaded_after == [] and g.m.current_step() == 0
    assert isinstance(g.m.errored(), CommunicationError) and "does not match the checksum" in str(
        g.m.errored()
    )
    g.transport.inbox[("mem://rg0", 5)] = HONEST
    assert g.step()[0] and g.m.current_step() == 6 and torch.equal(g.user.value["w"], torch.ones(3))


def test_a_healer_rejects_state_at_another_step_than_its_source_claimed(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(quorum(3, peer("rg0", 5), us="rg1")), replica_id="rg1")
    g.transport.inbox[("mem://rg0", 5)] = {
        MANAGER_STATE_KEY: {"step": 10**9, "batches_committed": 9},
        "default": {"w": 1},
    }
    assert not g.step()[0] and g.m.current_step() == 0 and "claimed step 5" in str(g.m.errored())


def test_when_the_sources_claims_tie_a_healer_checks_its_own_sources_claim(
    make: Callable[..., Group],
) -> None:
    """No majority: the healer heals from its source (rg0), checked against rg0's own claim."""
    g = make(
        ScriptedLighthouse(quorum(3, claiming("rg0", 5, HONEST), claiming("rg2", 5, POISONED), us="rg1")),
        replica_id="rg1",
    )
    g.transport.inbox[("mem://rg0", 5)] = POISONED  # not what rg0 claimed: rejected
    assert not g.step()[0] and g.m.current_step() == 0 and "does not match" in str(g.m.errored())
    g.transport.inbox[("mem://rg0", 5)] = HONEST
    g.transport.inbox[("mem://rg2", 5)] = (
        POISONED  # the next try goes to rg2 (commit_failures 1): as it claimed
    )
    assert g.step()[0] and g.m.current_step() == 6


def test_a_source_serves_its_state_to_its_healers_until_the_vote(make: Callable[..., Group]) -> None:
    step_of = {"rg1": 2, "rg2": 5}

    def answer(member: QuorumMember) -> Quorum:  # rg1 stays behind; rg2 keeps up, never serving
        step_of["rg2"] = member.step
        return quorum(4, peer("rg1", 2), peer("rg2", step_of["rg2"], staged=False))(member)

    g = make(ScriptedLighthouse(answer))
    g.m.load_state_dict({"step": 5, "batches_committed": 7})
    g.user.value = {"w": 3}
    assert g.step()[0] and g.transport.events == []  # rg1 waits: nobody snapshotted for it yet
    assert g.step()[0]
    send, disallow = g.transport.events
    assert send == ("send", [1], 6)  # rg1 (replica rank 1) heals from us: sources are rg0, rg2
    assert disallow[0] == "disallow" and disallow[1][-1] == dist.ReduceOp.MIN  # after the vote
    assert g.transport.serving is None
    assert g.m.current_step() == 7 and g.m.batches_committed() == 11


def test_the_snapshot_sent_holds_every_registered_state(make: Callable[..., Group]) -> None:
    """The start of a job: we are the primary (step 0); rg1 waits the first step, we snapshot its
    end and serve it at the second."""
    g = make(ScriptedLighthouse(quorum(4, peer("rg1", 0))), init_sync=True)
    g.m.register_state_dict_fn("sampler", lambda sd: None, lambda: {"epoch": 2})
    with pytest.raises(ValueError, match="already registered"):
        g.m.register_state_dict_fn("sampler", lambda sd: None, lambda: {})
    assert g.step()[0] and g.transport.sent == []
    g.m.start_quorum()
    g.m.wait_quorum()
    assert g.transport.serving == {"default": {"w": 0}, "sampler": {"epoch": 2},
                                   MANAGER_STATE_KEY: {"step": 1, "batches_committed": 1}}  # fmt: skip
    assert g.m.should_commit()


# ------------------------------------------------------------------------------ allreduce


def test_the_average_divides_by_the_number_of_up_to_date_groups(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(quorum(2, peer("rg1", 3), peer("rg2", 1))))
    g.m.load_state_dict({"step": 3, "batches_committed": 3})
    committed, out = g.step(grad=6.0)
    assert committed and g.m.num_participants() == 2
    assert g.pg.ops[0].inputs[0].tolist() == [3.0] * 4  # 6 / 2 sources, divided before the sum
    assert g.pg.ops[0].reduce_op == dist.ReduceOp.SUM
    assert out.tolist() == [9.0] * 4  # three identical peers: sum of 3.0 x 3
    assert g.m.batches_committed() == 5


def test_a_sum_is_not_divided(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(2, "rg1", "rg2")), init_sync=False)
    g.m.start_quorum()
    out = g.m.allreduce(torch.full((2,), 6.0), reduce_op="sum").get_future().wait()
    assert g.pg.ops[0].inputs[0].tolist() == [6.0, 6.0] and out.tolist() == [18.0, 18.0]
    with pytest.raises(ValueError, match="reduce_op"):
        g.m.allreduce(torch.ones(1), reduce_op="median")
    assert g.m.should_commit()


def test_alone_the_average_is_the_tensor_and_no_collective_runs(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1)))
    committed, out = g.step(grad=6.0)
    assert committed and out.tolist() == [6.0] * 4
    assert g.pg.ops == []  # no peer: neither a gradient allreduce nor a vote


def test_a_managed_process_group_reduces_through_the_manager(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(quorum(2, peer("rg1", 3), peer("rg2", 1))))
    g.m.load_state_dict({"step": 3, "batches_committed": 3})
    mpg = ManagedProcessGroup(g.m)
    g.m.start_quorum()
    t = torch.full((2,), 6.0)
    assert mpg.allreduce([t], dist.ReduceOp.AVG).wait()
    assert mpg.size() == 2 and t.tolist() == [9.0, 9.0]  # as Manager.allreduce: 6 / 2 sources, x 3 peers
    assert g.m.should_commit()


# ------------------------------------------------------------------------------ errors and commit


def test_an_allreduce_error_is_committed_nowhere_and_the_next_step_commits(
    make: Callable[..., Group],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1"))  # the failure changes the id
    g = make(lighthouse, init_sync=False)
    g.pg.fail_next("allreduce", RuntimeError("connection reset by peer"))
    committed, out = g.step()
    assert not committed
    assert isinstance(g.m.errored(), CommunicationError) and "connection reset" in str(g.m.errored())
    assert g.m.current_step() == 0
    assert g.step()[0]
    assert lighthouse.asked[1].commit_failures == 1 and lighthouse.asked[1].step == 0
    assert g.m.current_step() == 1 and g.m.errored() is None


def test_a_reported_error_still_takes_part_with_zeros_and_refuses_the_commit(
    make: Callable[..., Group],
) -> None:
    g = make(ScriptedLighthouse(in_step(1, "rg1")), init_sync=False)
    g.m.start_quorum()
    g.m.report_error(RuntimeError("NaN loss"))
    g.m.allreduce(torch.full((4,), 6.0)).wait()
    assert g.pg.ops[0].inputs[0].tolist() == [0.0] * 4  # same collectives as the peers, no contribution
    assert not g.m.should_commit()
    assert g.pg.ops[-1].inputs[0].tolist() == [0]  # it voted no


def test_an_errored_process_group_is_not_used_and_the_step_not_committed(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1, "rg1")), init_sync=False)  # the id never changes here
    g.pg.fail_next("allreduce")
    assert not g.step()[0]
    issued = len(g.pg.ops)
    committed, out = g.step()
    assert not committed and out.tolist() == [6.0] * 4
    assert len(g.pg.ops) == issued  # neither the gradient nor the vote went to a failed group
    assert g.m.errored() is g.pg.errored()


def test_a_hung_collective_costs_the_commit_timeout_and_aborts_the_group(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1")), init_sync=False)
    g.m.start_quorum()
    g.pg.hang_next("allreduce")
    fut = g.m.allreduce(torch.full((4,), 6.0)).get_future()
    t0 = time.monotonic()
    assert g.m.should_commit(timeout=0.3) is False
    assert 0.25 < time.monotonic() - t0 < 3
    assert g.pg.aborts == 1 and fut.done()  # the abort released the hung op
    assert "commit timed out after 0.3 s" in str(g.m.errored())
    assert g.step()[0]  # the next quorum rebuilds the group


def test_a_peer_the_lighthouse_declares_lost_aborts_the_hung_step_at_once(make: Callable[..., Group]) -> None:
    """A participant hangs (SIGSTOP: its sockets stay open, the collective neither completes nor
    fails) and the lighthouse declares it lost in a heartbeat answer: the step is aborted then, not
    at the commit timeout (120 s here, above this test's own 60 s timeout: without the abort this
    test fails by timing out), and the next quorum -- without the lost group -- commits."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2))
    g = make(lighthouse, init_sync=False, timeout=120.0)
    g.m.start_quorum()
    g.pg.hang_next("allreduce")
    fut = g.m.allreduce(torch.full((4,), 6.0)).get_future()
    prepared: list[float] = []
    g.pg.prepare_abort = lambda: prepared.append(time.monotonic())  # type: ignore[method-assign]
    threading.Timer(1.5, lighthouse.tell_lost, args=(1, "rg1")).start()
    assert g.m.should_commit() is False
    fut.wait()  # the abort (on its own thread) released the hung op
    assert g.pg.aborts == 1
    assert len(prepared) == 1  # after 1 s of waiting: a Baby group starts its replacement child then
    assert isinstance(g.m.errored(), CommunicationError)  # the released allreduce, or the loss itself
    lighthouse.tell_lost(1, "rg1")  # heartbeats repeat it until the next quorum: aborted once
    committed, out = g.step()
    assert committed and out.tolist() == [6.0] * 4  # alone now (quorum 2)
    assert g.pg.configure_calls[-1] == (f"{OUR_STORE}/ftlaunch/q2/r0", 0, 1) and g.pg.aborts == 1


def test_a_lost_notice_releases_an_allreduce_that_the_training_loop_itself_waits_for(
    make: Callable[..., Group],
) -> None:
    """DDP's backward waits for its allreduce futures itself, outside `should_commit`: the notice's
    own thread aborts once an allreduce of the step has been pending for a second."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2))
    g = make(lighthouse, init_sync=False, timeout=120.0)
    g.m.start_quorum()
    g.pg.hang_next("allreduce")
    fut = g.m.allreduce(torch.full((4,), 6.0)).get_future()
    lighthouse.tell_lost(1, "rg1")
    fut.wait()  # as DDP's reducer does: released by the abort, not by the 120 s timeout
    assert g.pg.aborts == 1 and g.m.should_commit() is False
    assert g.step()[0]


def test_a_lost_notice_for_another_quorum_or_before_the_collective_changes_nothing(
    make: Callable[..., Group],
) -> None:
    """A stale answer (an older quorum id: the group moved on) is ignored; a notice for the quorum in
    use that comes while nothing waits (between steps; or a crashed peer, whose sockets closed, so
    the collectives failed by themselves) aborts nothing: a Baby child that is still usable is not
    replaced. The next quorum (whose id the loss changed) rebuilds the group and commits. Slow but
    live peers are never reported (tests/unit/test_lighthouse_membership.py)."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(1, "rg1"), in_step(5, "rg1"))
    g = make(lighthouse, init_sync=False)
    assert g.step()[0]
    lighthouse.tell_lost(99, "rg1")  # not the quorum in use
    assert g.step()[0] and g.pg.aborts == 0
    lighthouse.tell_lost(1, "rg1")  # between steps: rg1 hung (or died) after the last commit
    time.sleep(0.2)
    assert g.pg.aborts == 0
    assert g.step()[0]  # quorum 5: a new group, no error carried over
    lighthouse.tell_lost(1, "rg1")  # stale now
    assert g.step()[0] and g.pg.aborts == 0


def test_a_group_whose_quorum_went_on_without_it_aborts_its_step(make: Callable[..., Group]) -> None:
    """Stopped (SIGSTOP) while its peers aborted and formed quorum 7 without it, a group resumes
    inside a collective of quorum 1 that nobody else uses any more; the heartbeat answer says
    ``superseded`` (lost with no ids): it aborts then, not at the commit timeout (120 s)."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(8, "rg1"))
    g = make(lighthouse, init_sync=False, timeout=120.0)
    g.m.start_quorum()
    g.pg.hang_next("allreduce")
    g.m.allreduce(torch.full((4,), 6.0))
    lighthouse.tell_lost(1)  # "the current quorum is 1": that is ours, nothing to do
    threading.Timer(0.3, lighthouse.tell_lost, args=(7,)).start()
    assert g.m.should_commit() is False
    assert g.step()[0] and g.pg.aborts == 1  # the next reconfigure waited for the abort


def test_too_few_up_to_date_groups_is_not_committed(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1), in_step(2, "rg1")), min_replica_size=2, init_sync=False)
    assert g.step()[0] is False and g.m.errored() is None
    assert g.step()[0] is True


def test_max_retries_consecutive_failures_raise(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1)), max_retries=1)
    assert g.step(error=RuntimeError("bad batch"))[0] is False
    with pytest.raises(FtlaunchError, match=r"2 consecutive steps failed to commit \(max_retries=1\)"):
        g.step(error=RuntimeError("bad batch"))


# ------------------------------------------------------------------------------ lighthouse failures


def test_eviction_is_raised_into_the_training_loop(make: Callable[..., Group]) -> None:
    g = make(ScriptedLighthouse(in_step(1), EvictedError("evicted by admin")))
    assert g.step()[0]
    g.m.start_quorum()
    with pytest.raises(EvictedError, match="evicted by admin"):
        g.m.allreduce(torch.ones(1))


def test_quorum_retries_absorb_a_lighthouse_error_and_a_synchronous_quorum_raises_at_once(
    make: Callable[..., Group],
) -> None:
    g = make(ScriptedLighthouse(QuorumTimeoutError("no quorum"), in_step(1)), quorum_retries=1)
    assert g.step()[0]
    g2 = make(
        ScriptedLighthouse(LighthouseError("lighthouse said no")), replica_id="rg9", use_async_quorum=False
    )
    with pytest.raises(LighthouseError, match="lighthouse said no"):
        g2.m.start_quorum()


# ------------------------------------------------------------------------------ a group of two ranks


def test_a_two_rank_group_shares_the_leaders_quorum_and_votes_through_its_store(
    make: Callable[..., Group],
) -> None:
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2, "rg1"), LighthouseError("lighthouse gone"))
    store = dist.HashStore()
    ranks = [make(lighthouse, rank=0, world_size=2, store=store, init_sync=False),
             make(None, rank=1, world_size=2, store=store, init_sync=False)]  # fmt: skip

    def both(errors: list[Exception | None]) -> list[Any]:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(g.step, 6.0, e) for g, e in zip(ranks, errors, strict=True)]
            return [f.result(timeout=20) for f in futures]

    assert [c for c, _ in both([None, None])] == [True, True]
    assert [g.pg.configure_calls for g in ranks] == [[(f"{OUR_STORE}/ftlaunch/q1/r0", 0, 2)],
                                                     [(f"{OUR_STORE}/ftlaunch/q1/r1", 0, 2)]]  # fmt: skip
    assert lighthouse.asked[0].data["ckpt"] == ["mem://rg0/r0", "mem://rg0/r1"]  # every rank's metadata
    assert "claim" not in lighthouse.asked[0].data  # nobody heals here: nothing claimed
    # An error on rank 1 only: rank 0 voted yes, but the group's vote refuses the step on both.
    assert [c for c, _ in both([None, RuntimeError("rank 1 failed")])] == [False, False]
    assert all(g.m.current_step() == 1 for g in ranks)
    assert len(lighthouse.asked) == 2  # only the leader asks the lighthouse
    # The leader's failure reaches the other rank through the store instead of leaving it waiting.
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(g.step) for g in ranks]
        for f in futures:
            with pytest.raises(LighthouseError):
                f.result(timeout=20)


def test_in_a_two_rank_group_every_rank_snapshots_and_claims_when_a_heal_is_due(
    make: Callable[..., Group],
) -> None:
    """Both ranks decide alike to snapshot (the same plan), and the request after the healer waited
    carries both ranks' checksums (rank 1's through the group store); then the votes line up."""
    lighthouse = ScriptedLighthouse(quorum(2, peer("rg1", 0)))
    store = dist.HashStore()
    ranks = [make(lighthouse, rank=0, world_size=2, store=store, init_sync=False),
             make(None, rank=1, world_size=2, store=store, init_sync=False)]  # fmt: skip
    for r, g in enumerate(ranks):  # each rank its own shard
        g.m.load_state_dict({"step": 5, "batches_committed": 9})
        g.user.value = {"w": torch.full((2,), float(r))}
    for _ in range(2):
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(g.step) for g in ranks]
            assert [f.result(timeout=20)[0] for f in futures] == [True, True]
    claims = [m.data.get("claim") for m in lighthouse.asked]
    assert len(claims) == 2 and claims[0] is None and len(claims[1]) == 2 and claims[1][0] != claims[1][1]
    assert lighthouse.asked[1].data["staged"] is True
    assert all(("send", [1], 6) in g.transport.events for g in ranks)
    assert all(g.m.current_step() == 7 for g in ranks)


def test_the_leader_passes_a_lost_quorum_on_to_the_other_ranks_of_its_group(
    make: Callable[..., Group],
) -> None:
    """Only the leader heartbeats, but every rank's cross-group group waits on the hung group: the
    leader writes the loss to the group's store and rank 1, waiting in its own hung allreduce, reads
    it there and aborts too (commit timeout 120 s, above this test's 60 s)."""
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"), in_step(2))
    store = dist.HashStore()
    ranks = [make(lighthouse, rank=0, world_size=2, store=store, init_sync=False, timeout=120.0),
             make(None, rank=1, world_size=2, store=store, init_sync=False, timeout=120.0)]  # fmt: skip

    def hung_step(g: Group) -> bool:
        g.m.start_quorum()
        g.pg.hang_next("allreduce")
        g.m.allreduce(torch.full((4,), 6.0))
        return g.m.should_commit()

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(hung_step, g) for g in ranks]
        time.sleep(0.5)
        lighthouse.tell_lost(1, "rg1")
        assert [f.result(timeout=50) for f in futures] == [False, False]
    with ThreadPoolExecutor(2) as pool:  # the next quorum (without rg1) rebuilds both and commits
        assert [f.result(timeout=20)[0] for f in [pool.submit(g.step) for g in ranks]] == [True, True]
    assert [g.pg.aborts for g in ranks] == [1, 1]


def test_a_restarted_incarnation_never_reads_its_predecessors_keys() -> None:
    store = dist.HashStore()
    old = GroupStore(store, address="h:1", replica_id="rg0", attempt=0, rank=0, world_size=2, timeout=5)
    q = Quorum(quorum_id=1, participants=(QuorumMember("rg0"),), created=0.0)
    assert old.relay_quorum(1, lambda: q) == q
    old_follower = GroupStore(
        store, address="h:1", replica_id="rg0", attempt=0, rank=1, world_size=2, timeout=5
    )
    assert old_follower.relay_quorum(1, lambda: q) == q
    new_follower = GroupStore(
        store, address="h:1", replica_id="rg0", attempt=1, rank=1, world_size=2, timeout=0.2
    )
    with pytest.raises(dist.DistStoreError):
        new_follower.relay_quorum(1, lambda: q)


# ------------------------------------------------------------------------------ construction and teardown


def test_torchft_style_defaults_name_what_is_missing(make: Callable[..., Group]) -> None:
    with pytest.raises(ConfigurationError, match="REPLICA_GROUP_ID is not set"):
        Manager(pg=FakeProcessGroup(), load_state_dict=None, state_dict=None, group_store=dist.HashStore(),
                store_addr="h", store_port=1)  # fmt: skip
    with pytest.raises(ConfigurationError, match="no lighthouse address"):
        Manager(pg=FakeProcessGroup(), load_state_dict=None, state_dict=None, replica_id="rg0",
                group_store=dist.HashStore(), store_addr="h", store_port=1)  # fmt: skip
    with pytest.raises(ValueError, match="pass store_addr= and store_port="):
        Manager(pg=FakeProcessGroup(), load_state_dict=None, state_dict=None, replica_id="rg0",
                group_store=dist.HashStore(), quorum_client=ScriptedLighthouse(in_step(1)))  # fmt: skip
    with pytest.raises(ConfigurationError, match="rank 2 is outside world_size 2"):
        make(None, rank=2, world_size=2)


def test_the_core_constructor_takes_its_parts_and_reads_no_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Manager.from_parts`` (what ``ftlaunch.init`` calls) is made of what it is given: a malformed
    variable of the long form's defaults would raise if it were read."""
    monkeypatch.setenv(env.REPLICA_GROUP_ID, "abc")
    monkeypatch.setenv(env.FTLAUNCH_HEAL_CLAIMS, "maybe")
    monkeypatch.setenv(env.FTLAUNCH_TIMEOUT, "-1")
    pg = FakeProcessGroup()
    settings = ManagerSettings(replica_id="rg0", group_rank=0, group_world_size=1,
                               timeouts=Timeouts.derive(5.0),
                               init_sync=False)  # fmt: skip
    store = GroupStore(dist.HashStore(), address=OUR_STORE, replica_id="rg0", attempt=0, rank=0, world_size=1,
                       timeout=5.0)  # fmt: skip
    transport, user, lighthouse = (
        MemoryTransport("rg0/r0", pg),
        UserState(pg),
        ScriptedLighthouse(in_step(1, "rg1")),
    )
    m = Manager.from_parts(ManagerParts(settings, pg, store, transport, lighthouse, user.load, user.save))
    try:
        m.start_quorum()
        m.allreduce(torch.ones(4)).wait()
        assert m.should_commit() and m.current_step() == 1 and m.num_participants() == 2
    finally:
        m.shutdown()
    assert lighthouse.left == ["rg0"] and lighthouse.closed
    with pytest.raises(ValueError, match="rank 0"):  # the leader, and only it, holds the client
        ManagerParts(settings, pg, store, transport, None)
    with pytest.raises(ValueError, match="both load_state_dict and state_dict"):
        ManagerParts(settings, pg, store, transport, lighthouse, user.load, None)
    with pytest.raises(ValueError, match="min_replica_size must be >= 1"):
        ManagerSettings(replica_id="rg0", group_rank=0, group_world_size=1, timeouts=settings.timeouts,
                        min_replica_size=0)  # fmt: skip


def test_shutdown_leaves_the_lighthouse_and_releases_everything(make: Callable[..., Group]) -> None:
    lighthouse = ScriptedLighthouse(in_step(1))
    g = make(lighthouse)
    assert g.step()[0]
    g.m.shutdown()
    g.m.shutdown()  # idempotent
    assert lighthouse.left == ["rg0"] and lighthouse.closed
    assert g.transport.events[-1] == ("shutdown",)
    with pytest.raises(ValueError, match="shut down"):
        g.pg.allreduce([torch.ones(1)], dist.ReduceOp.SUM)
    with pytest.raises(FtlaunchError, match="shut down"):
        g.m.start_quorum()


def test_the_settings_ftlaunch_init_hands_down_are_not_read_again(
    make: Callable[..., Group], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ftlaunch.init`` reads `env.WorkerEnv` once and passes it: the Manager then reads no variable
    of it (a malformed one here would raise if it did)."""
    monkeypatch.setenv(env.FTLAUNCH_HEAL_CLAIMS, "maybe")
    lighthouse = ScriptedLighthouse(in_step(1, "rg1"))
    g = make(lighthouse, init_sync=False, worker_env=env.WorkerEnv(heal_claims=False, outage_steps=False))
    assert g.step()[0] and "claim" not in lighthouse.asked[0].data
    assert not g.m._outage.enabled


@pytest.mark.parametrize("interval", [0, 1e-9, float("nan"), float("inf"), timedelta(hours=1)])
def test_the_heartbeat_interval_is_bounded(make: Callable[..., Group], interval: object) -> None:
    """A heartbeat every nanosecond would flood the lighthouse; ``inf`` would never beat."""
    with pytest.raises(
        ConfigurationError, match=r"heartbeat_interval=.* is out of range: use a duration of 10 ms to 60 s"
    ):
        make(ScriptedLighthouse(in_step(1)), heartbeat_interval=interval)


def test_heal_claims_can_be_turned_off(make: Callable[..., Group], monkeypatch: pytest.MonkeyPatch) -> None:
    """No checksum, but the snapshot is taken and served all the same."""
    monkeypatch.setenv(env.FTLAUNCH_HEAL_CLAIMS, "false")  # any flag spelling: "0" and "false" alike
    lighthouse = ScriptedLighthouse(quorum(1, peer("rg1", 0)))
    g = make(lighthouse, init_sync=False)
    g.m.load_state_dict({"step": 5, "batches_committed": 9})
    assert g.step()[0] and g.step()[0]
    assert all("claim" not in m.data for m in lighthouse.asked) and lighthouse.asked[1].data["staged"] is True
    assert ("send", [1], 6) in g.transport.events

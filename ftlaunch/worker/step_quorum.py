"""A step's quorum, on the Manager's quorum thread: ask for it, plan the step from it, reconfigure the
cross-group process group when it changed, heal (`StepQuorum.run`, which returns a `QuorumResult`).

Kept apart from the Manager because it runs on its own thread, overlapped with the forward pass: it
returns what the step needs (the plan, a healer's received state) and the training thread takes it
once ``wait_quorum`` returned. What it keeps across steps is its own: the round number, the quorum
the process group is configured for, the last plan, whether this rank serves a heal. It never reads
the training tensors of a source: what it claims and serves is the step's snapshot
(`worker.committed`), taken by the training thread at the commit boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.worker import quorum_request, recovery
from ftlaunch.worker.committed import CommittedState, Snapshot
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.hang_abort import LostPeerAbort
from ftlaunch.worker.leader import LeaderLink
from ftlaunch.worker.manager_parts import ManagerSettings
from ftlaunch.worker.outage import LastQuorumSteps
from ftlaunch.worker.plan import StepPlan, plan_step
from ftlaunch.worker.plan import claims_wanted as plan_claims_wanted
from ftlaunch.worker.recovery import StateRegistry

__all__ = ["QuorumResult", "StepQuorum"]


@dataclass(frozen=True)
class QuorumResult:
    """What a quorum round gives its step: the plan, the state a healer received (None otherwise),
    and a failure of the heal transfer, which fails the step but keeps the plan (the group still
    takes part in the step's collectives and votes no: its peers expect it there)."""

    plan: StepPlan
    received: dict[str, Any] | None = None
    error: Exception | None = None


class StepQuorum:
    """The quorum rounds of one rank, one per step (module docstring)."""

    def __init__(
        self,
        settings: ManagerSettings,
        *,
        pg: ProcessGroup,
        group: GroupStore,
        transport: CheckpointTransport[Any],
        outage: LastQuorumSteps,
        hang_abort: LostPeerAbort,
        link: LeaderLink,
        state: StateRegistry,
        committed: CommittedState,
        mark: Callable[[str], None],
        log: logging.LoggerAdapter,
    ) -> None:
        self._settings = settings
        self._pg = pg
        self._group = group
        self._transport = transport
        self._outage = outage
        self._hang_abort = hang_abort
        self._link = link
        self._state = state
        self._committed = committed
        self._mark = mark
        self._log = log
        #: The round number among the group's ranks (the group store's key; the group's votes use
        #: it too). A step's round is `begin`'s; a round that asks again for heal claims takes the next.
        self.seq = 0
        #: How this group lays out its state (`Manager.require_same_layout`), sent with every request.
        self.layout: dict[str, str] | None = None
        #: The quorum the process group is configured (or being configured) for.
        self.quorum_id: int | None = None
        #: When the configure in flight began (None: none is): a step that waits on a peer there is
        #: told apart from one that computes (`Manager._stuck`, `Manager._blocked`).
        self.configuring_since: float | None = None
        #: The plan of the last round that planned, kept across steps: whether a heal is due at the
        #: next boundary (`plan.snapshot_due`, `plan.may_heal`).
        self.last_plan: StepPlan | None = None
        self._ready = False  # published this rank's readiness (`quorum_request.become_ready`)
        self._transport_metadata: list[str] | None = None  # every rank's, read once by the leader
        self._serving = False  # offered a snapshot to healers: withdrawn after the step's vote

    def begin(self) -> int:
        """A new step's round (the training thread, before `run` is submitted)."""
        self.seq += 1
        return self.seq

    def run(
        self,
        seq: int,
        step: int,
        commit_failures: int,
        *,
        allow_heal: bool,
        shrink_only: bool,
        timeout: float,
        heal_ready: bool,
    ) -> QuorumResult:
        """Round ``seq`` of a group at ``step``: quorum -> this group's plan -> reconfigure if it
        changed -> heal. Raises when there is no plan (lighthouse, relay or configure failure) or
        the plan is refused (`ConfigurationError`: a layout differs from the up-to-date groups')."""
        if not self._ready:  # ask to be counted only once we can take part at once
            quorum_request.become_ready(self._pg, self._group, self._transport, self._log)
            self._ready = True
            self._mark("ready")
        snapshot = self._committed.current(step)
        ready = heal_ready and allow_heal
        asking = _Asking(step, commit_failures, shrink_only, timeout, snapshot, ready)
        quorum = self._ask(seq, asking, claiming=False)
        if plan_claims_wanted(quorum, init_sync=self._settings.init_sync):
            # Someone heals from a live state: heal sources must agree (worker/plan.py), so every
            # member asks again, now with a checksum of the state it would offer. A new round of the
            # group's store.
            self.seq += 1
            quorum = self._ask(self.seq, asking, claiming=True)
        self._mark("quorum")
        plan = plan_step(
            quorum,
            self._settings.replica_id,
            init_sync=self._settings.init_sync,
            world_size_mode=self._settings.world_size_mode,
            min_replica_size=self._settings.min_replica_size,
        )
        self.last_plan = plan
        if plan.quorum_id != self.quorum_id:
            self._reconfigure(plan)
            self._mark("configured")
        if plan.layout_conflict is not None:
            # Raised after the reconfigure, so that the other groups' rendezvous does not wait for
            # us; our peers' collectives then fail when this process stops, and they go on without it.
            raise ConfigurationError(plan.layout_conflict)
        progress = self._link.progress
        if not allow_heal:
            if progress is not None:
                progress.quorum_done()
            return QuorumResult(plan)
        # A source serves its snapshot to the healers assigned to it (until the vote); a healer
        # fetches it now and loads it before its forward pass (`Manager.start_quorum`; live mode:
        # only once every group agreed to commit).
        started = time.perf_counter()
        try:
            sent, received = recovery.exchange(
                self._transport, plan, quorum, snapshot, self._settings.group_rank, self._state,
                self._settings.timeouts.as_timedelta("heal"), self._log,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the step fails; its collectives and votes still need us
            return QuorumResult(plan, error=e)
        self._serving = self._serving or sent
        if plan.heal:
            self._mark("healed")
        if progress is not None:
            progress.quorum_done(time.perf_counter() - started if plan.heal else 0.0)
        return QuorumResult(plan, received)

    def heals_over(self) -> None:
        """The step's vote is over, so every healer has its copy: withdraw what this rank served
        and let the snapshot go (the state may change again)."""
        if self._serving:
            self._transport.disallow_checkpoint()
            self._serving = False
        self._committed.release()

    def _reconfigure(self, plan: StepPlan) -> None:
        self._log.info(
            "quorum %d: %d groups (this is replica rank %d), %d up to date at step %d; reconfiguring",
            plan.quorum_id, plan.replica_world_size, plan.replica_rank, plan.num_sources, plan.max_step,
        )  # fmt: skip
        # Mark the id first: if configure fails, the next quorum (whose id the failure changes)
        # retries with a fresh prefix instead of reusing a half-built one.
        self.quorum_id = plan.quorum_id
        self._hang_abort.use(plan.quorum_id)  # waits for an abort of the previous quorum to finish
        store_addr = f"{plan.store_address}/ftlaunch/q{plan.quorum_id}/r{self._settings.group_rank}"
        # A configure that waits on a peer (or on the store of a group that died right after the
        # quorum) counts as stuck: the lost-peer abort releases it, not the collective timeout.
        self.configuring_since = time.monotonic()
        try:
            self._pg.configure(store_addr, plan.replica_rank, plan.replica_world_size)
        finally:
            self.configuring_since = None

    def _ask(self, seq: int, asking: _Asking, *, claiming: bool) -> Quorum:
        """Round ``seq``'s quorum. Only the leader asks the lighthouse; the group store relays its
        answer to the other ranks. A group whose boundary took a snapshot says so with its claim
        (every rank's, the leader gathers them); a live one claims on demand, and with ``claiming``
        (the second round of `plan.claims_wanted`) claims its live state."""
        snapshot = asking.snapshot
        live = snapshot is not None and snapshot.live
        gather = claiming if live else self._committed.due
        claim = recovery.claim_token(snapshot, self._settings.heal_claims) if gather else None
        if gather and self._settings.group_rank != 0:
            self._group.publish_claim(seq, claim)
        return self._group.relay_quorum(seq, lambda: self._ask_lighthouse(seq, asking, gather, claim, live))

    def _ask_lighthouse(
        self, seq: int, asking: _Asking, gather: bool, claim: str | None, live: bool
    ) -> Quorum:
        client = self._link.client
        assert client is not None  # the leader has one
        s = self._settings
        if self._transport_metadata is None:  # the first request: once every rank is ready
            self._transport_metadata = self._group.transport_metadata()
            self._link.start_heartbeat()
        tokens = self._group.claims(seq, claim, s.timeouts.collective) if gather else None
        if live:  # served live: claims on demand, or (asked again) the claims gathered
            staged, claims = True, tokens if gather else recovery.on_demand(s.heal_claims)
        else:  # a snapshot on every rank, or nothing to serve
            staged = tokens is not None
            claims = tokens if staged and s.heal_claims else None
        request = quorum_request.member(
            s.replica_id, store_address=self._group.address, step=asking.step, world_size=s.group_world_size,
            shrink_only=asking.shrink_only, commit_failures=asking.commit_failures,
            transport_metadata=self._transport_metadata, layout=self.layout, claims=claims, staged=staged,
            heal_ready=asking.heal_ready,
        )  # fmt: skip
        return self._outage.ask(client, request, s.quorum_retries, asking.timeout, self._log)


@dataclass(frozen=True)
class _Asking:
    """What one step asks its quorum with (both rounds, when heal claims are wanted)."""

    step: int
    commit_failures: int
    shrink_only: bool
    timeout: float
    snapshot: Snapshot | None
    heal_ready: bool

"""The Manager's quorum thread (torchft's per-step protocol, part 1): ask for the step's quorum,
plan the step from it, reconfigure the cross-group process group when the quorum changed, heal.

Kept apart from `manager.py` (the step's allreduces, commit and teardown) because it runs on its
own thread, overlapped with the forward pass, and writes only what the step reads once
``wait_quorum`` returned: the plan, the quorum id, a healer's received state. It never reads the
training tensors of a source: what it claims and serves is the step's snapshot (`worker.committed`),
taken by the training thread at the commit boundary.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import Timeouts
from ftlaunch.worker import quorum_request, recovery
from ftlaunch.worker.committed import CommittedState, Snapshot
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.hang_abort import LostPeerAbort
from ftlaunch.worker.leader import LeaderLink
from ftlaunch.worker.outage import LastQuorumSteps
from ftlaunch.worker.plan import StepPlan, WorldSizeMode, plan_step
from ftlaunch.worker.plan import claims_wanted as plan_claims_wanted
from ftlaunch.worker.progress import ProgressTracker
from ftlaunch.worker.recovery import StateRegistry


class QuorumRound:
    """Mixed into `ftlaunch.worker.manager.Manager`, which sets these fields."""

    replica_id: str
    timeouts: Timeouts
    log: logging.LoggerAdapter
    _pg: ProcessGroup
    _group: GroupStore
    _group_rank: int
    _group_world_size: int
    _transport: CheckpointTransport[Any]
    _transport_metadata: list[str] | None
    _client: QuorumClient | None
    _link: LeaderLink
    _outage: LastQuorumSteps
    _hang_abort: LostPeerAbort
    _progress: ProgressTracker | None
    _state: StateRegistry
    _committed: CommittedState
    _heal_claims: bool
    _layout: dict[str, str] | None
    _ready: bool
    _init_sync: bool
    _world_size_mode: WorldSizeMode
    _min_replica_size: int
    _quorum_retries: int
    _quorum_seq: int
    _quorum_id: int | None
    _plan: StepPlan | None
    _last_plan: StepPlan | None
    _step: int
    _commit_failures: int
    _sent_checkpoint: bool
    _pending_state: dict[str, Any] | None
    _configuring_since: float | None

    def _mark(self, phase: str) -> None:
        raise NotImplementedError

    def _run_quorum(
        self, seq: int, allow_heal: bool, shrink_only: bool, quorum_timeout: float, heal_ready: bool = True
    ) -> None:
        """The quorum thread: quorum -> this group's plan -> reconfigure if it changed -> heal."""
        if not self._ready:  # ask to be counted only once we can take part at once
            quorum_request.become_ready(self._pg, self._group, self._transport, self.log)
            self._ready = True
            self._mark("ready")
        snapshot = self._committed.current(self._step)
        ready = heal_ready and allow_heal
        quorum = self._ask_quorum(seq, shrink_only, quorum_timeout, snapshot, ready, claiming=False)
        if plan_claims_wanted(quorum, init_sync=self._init_sync):
            # Someone heals from a live state: heal sources must agree (worker/plan.py), so every
            # member asks again, now with a checksum of the state it would offer. A new round of the
            # group's store.
            self._quorum_seq += 1
            quorum = self._ask_quorum(
                self._quorum_seq, shrink_only, quorum_timeout, snapshot, ready, claiming=True
            )
        self._mark("quorum")
        plan = plan_step(
            quorum,
            self.replica_id,
            init_sync=self._init_sync,
            world_size_mode=self._world_size_mode,
            min_replica_size=self._min_replica_size,
        )
        self._last_plan = plan
        if plan.quorum_id != self._quorum_id:
            self._reconfigure(plan)
            self._mark("configured")
        if plan.layout_conflict is not None:
            # Raised after the reconfigure, so that the other groups' rendezvous does not wait for
            # us; our peers' collectives then fail when this process stops, and they go on without it.
            raise ConfigurationError(plan.layout_conflict)
        self._plan = plan
        if not allow_heal:
            if self._progress is not None:
                self._progress.quorum_done()
            return
        # A source serves its snapshot to the healers assigned to it (until the vote); a healer
        # fetches it now and loads it before its forward pass (`Manager.start_quorum`; live mode:
        # only once every group agreed to commit).
        started = time.perf_counter()
        sent, self._pending_state = recovery.exchange(
            self._transport, plan, quorum, snapshot, self._group_rank, self._state,
            self.timeouts.as_timedelta("heal"), self.log,
        )  # fmt: skip
        self._sent_checkpoint = self._sent_checkpoint or sent
        if plan.heal:
            self._mark("healed")
        if self._progress is not None:
            self._progress.quorum_done(time.perf_counter() - started if plan.heal else 0.0)

    def _ask_quorum(
        self,
        seq: int,
        shrink_only: bool,
        quorum_timeout: float,
        snapshot: Snapshot | None,
        heal_ready: bool,
        claiming: bool,
    ) -> Quorum:
        """Round ``seq``'s quorum. Only the leader asks the lighthouse; the group store relays its
        answer to the other ranks. A group whose boundary took a snapshot says so with its claim
        (every rank's, the leader gathers them); a live one claims on demand, and with ``claiming``
        (the second round of `plan.claims_wanted`) claims its live state."""
        live = snapshot is not None and snapshot.live
        gather = claiming if live else self._committed.due
        claim = recovery.claim_token(snapshot, self._heal_claims) if gather else None
        if gather and self._group_rank != 0:
            self._group.publish_claim(seq, claim)
        return self._group.relay_quorum(
            seq,
            lambda: self._ask_lighthouse(shrink_only, quorum_timeout, seq, gather, claim, live, heal_ready),
        )

    def _ask_lighthouse(
        self,
        shrink_only: bool,
        quorum_timeout: float,
        seq: int,
        gather: bool,
        claim: str | None,
        live: bool,
        heal_ready: bool,
    ) -> Quorum:
        assert self._client is not None  # the leader has one
        if self._transport_metadata is None:  # the first request: once every rank is ready
            self._transport_metadata = self._group.transport_metadata()
            self._link.start_heartbeat()
        tokens = self._group.claims(seq, claim, self.timeouts.collective) if gather else None
        if live:  # served live: claims on demand, or (asked again) the claims gathered
            staged, claims = True, tokens if gather else recovery.on_demand(self._heal_claims)
        else:  # a snapshot on every rank, or nothing to serve
            staged = tokens is not None
            claims = tokens if staged and self._heal_claims else None
        request = quorum_request.member(
            self.replica_id, store_address=self._group.address, step=self._step,
            world_size=self._group_world_size, shrink_only=shrink_only, commit_failures=self._commit_failures,
            transport_metadata=self._transport_metadata, layout=self._layout, claims=claims, staged=staged,
            heal_ready=heal_ready,
        )  # fmt: skip
        return self._outage.ask(self._client, request, self._quorum_retries, quorum_timeout, self.log)

    def _reconfigure(self, plan: StepPlan) -> None:
        self.log.info(
            "quorum %d: %d groups (this is replica rank %d), %d up to date at step %d; reconfiguring",
            plan.quorum_id, plan.replica_world_size, plan.replica_rank, plan.num_sources, plan.max_step,
        )  # fmt: skip
        # Mark the id first: if configure fails, the next quorum (whose id the failure changes)
        # retries with a fresh prefix instead of reusing a half-built one.
        self._quorum_id = plan.quorum_id
        self._hang_abort.use(plan.quorum_id)  # waits for an abort of the previous quorum to finish
        store_addr = f"{plan.store_address}/ftlaunch/q{plan.quorum_id}/r{self._group_rank}"
        # A configure that waits on a peer (or on the store of a group that died right after the
        # quorum) counts as stuck: the lost-peer abort releases it, not the collective timeout.
        self._configuring_since = time.monotonic()
        try:
            self._pg.configure(store_addr, plan.replica_rank, plan.replica_world_size)
        finally:
            self._configuring_since = None

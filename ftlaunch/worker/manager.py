"""The Manager: the per-step fault-tolerance protocol of one worker of one replica group.

Each step::

    start_quorum()      # optimizer.zero_grad(): ask for the step's quorum in the background
    ... forward ...     # overlaps the quorum round trip (and the heal transfer, if any)
    allreduce(grad)     # waits for the quorum, reconfigures the cross-group PG if its id changed
    should_commit()     # optimizer.step(): every group and every rank agrees, or nobody commits

Failures never raise into the training loop: a failed collective, reconfigure or heal marks the step
as errored, ``should_commit`` returns False everywhere, and the next quorum (which the failure changes)
carries on without the dead group. Only conditions training cannot survive raise: the lighthouse is
gone, this group was evicted, or ``max_retries`` consecutive steps failed. One ends the process
instead: the training finished ahead of this group with nobody left to heal it from (``SystemExit(0)``,
see `Manager._end_after_finish`).

The class reads in that order; the quorum thread's round (ask, plan, reconfigure, heal) is the
`manager_quorum.QuorumRound` it mixes in. The mechanics live beside it: `plan` (what this group does in the
step, from the quorum), `quorum_request` (what the leader asks the lighthouse with, and retries),
`group_store` (the quorum relay and the commit vote among the group's ranks), `allreduce` (the
arithmetic of one tensor's average across groups), `commit` (bounded waits, the vote across
groups), `recovery` (what travels with a heal, and its transfer), `defaults` (the
torchft-compatible defaults read from the environment).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftlaunch import env, phases
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import (
    CommunicationError,
    ConfigurationError,
    FtlaunchError,
    LighthouseError,
    TrainingFinishedError,
)
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.process_group.base import ProcessGroup, release_process_group
from ftlaunch.process_group.work import completed_future
from ftlaunch.timeouts import Timeouts, to_seconds
from ftlaunch.worker import allreduce as allreduce_math
from ftlaunch.worker import defaults
from ftlaunch.worker.allreduce import ReduceOpLike
from ftlaunch.worker.commit import CrossGroupVote, vote_of_all_groups, vote_of_group_ranks, wait_all
from ftlaunch.worker.committed import CommittedState
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.hang_abort import SUSPECT_AFTER, LostPeerAbort
from ftlaunch.worker.leader import LeaderLink
from ftlaunch.worker.managed_work import ManagedWork, with_default
from ftlaunch.worker.manager_quorum import QuorumRound
from ftlaunch.worker.manager_state import ManagerStateApi
from ftlaunch.worker.outage import LastQuorumSteps
from ftlaunch.worker.plan import StepPlan, WorldSizeMode, may_heal, snapshot_due
from ftlaunch.worker.recovery import DEFAULT_STATE_KEY, StateRegistry
from ftlaunch.worker.watchdog import progress_timeout

logger = logging.getLogger(__name__)

__all__ = ["Manager", "ManagedWork", "ReduceOpLike", "WorldSizeMode", "release_process_group"]

T = TypeVar("T")


class _StepLog(logging.LoggerAdapter):
    """Prefixes every record with ``[rg1/r0 step 42]`` so interleaved worker logs stay readable."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(logger, {})
        self._m = manager

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        m = self._m
        return f"[{m.replica_id}/r{m._group_rank} step {m._step}] {msg}", kwargs


class Manager(QuorumRound, ManagerStateApi):
    """Per-step quorum, fault-tolerant allreduce, commit and live recovery (torchft's API)."""

    def __init__(
        self,
        pg: ProcessGroup,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int = 1,
        use_async_quorum: bool = True,
        timeout: timedelta | float | None = None,
        quorum_timeout: timedelta | float | None = None,
        connect_timeout: timedelta | float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta | float = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport[Any] | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        token: str | None = None,
        heal_timeout: timedelta | float | None = None,
        commit_timeout: timedelta | float | None = None,
        timeouts: Timeouts | None = None,
        quorum_client: QuorumClient | None = None,
        group_store: dist.Store | None = None,
        worker_env: env.WorkerEnv | None = None,
    ) -> None:
        """Arguments not given default the way torchft's do, from the launcher's environment:
        ``replica_id`` from ``REPLICA_GROUP_ID``, ``rank``/``world_size``/``store_addr``/
        ``store_port`` from torchelastic's variables, ``lighthouse_addr``/``token`` from
        ``FTLAUNCH_LIGHTHOUSE``/``FTLAUNCH_TOKEN``.

        Timeouts: ``timeout`` is the one knob (else ``FTLAUNCH_TIMEOUT``, else 60 s); the quorum,
        connect, heal and commit timeouts derive from it unless given, and the set is validated
        (``ftlaunch.timeouts``). ``timeouts=`` passes an already derived set instead.

        ``world_size_mode``: `WorldSizeMode.DYNAMIC` averages over every up-to-date group;
        ``FIXED_WITH_SPARES`` over exactly ``min_replica_size`` of them (the others contribute
        zeros), as in torchft. ``port`` is accepted for torchft scripts and unused: torchft runs a
        per-group manager server on it; here the group leader talks to the lighthouse directly.

        Injection: ``quorum_client`` replaces the `LighthouseClient` the group leader (rank 0) would
        build (the Manager owns it: ``shutdown`` leaves and closes it); ``group_store`` replaces the
        connection to the replica group's store (``store_addr``/``store_port`` then only name it
        for the other groups, and may be omitted for a ``TCPStore``).
        ``worker_env``: what the user tuned through the environment (``ftlaunch.init`` reads it
        once); read from the environment when not given.
        """
        defaults.check_arguments(min_replica_size, max_retries, world_size_mode, port, heartbeat_interval)
        timeouts = defaults.timeouts(
            timeouts,
            timeout,
            quorum=quorum_timeout,
            connect=connect_timeout,
            heal=heal_timeout,
            commit=commit_timeout,
        )
        self.timeouts = timeouts
        self._pg = pg
        self._min_replica_size = min_replica_size
        self._world_size_mode = world_size_mode
        self._use_async_quorum = use_async_quorum
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._quorum_retries = quorum_retries

        # torchft-compatible defaults: what is not passed, torchelastic and the launcher published.
        group_env = defaults.group_env()
        self._group_rank = group_env.rank if rank is None else rank
        self._group_world_size = group_env.world_size if world_size is None else world_size
        if not 0 <= self._group_rank < self._group_world_size:
            raise ConfigurationError(
                f"rank {self._group_rank} is outside world_size {self._group_world_size}"
            )
        self.replica_id = defaults.replica_id() if replica_id is None else replica_id
        self.log = _StepLog(self)

        self._state = StateRegistry(self.load_state_dict, self.state_dict)
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("pass both load_state_dict and state_dict, or neither")
        if load_state_dict is not None and state_dict is not None:
            self._state.register(DEFAULT_STATE_KEY, load_state_dict, state_dict)
        # What a heal source serves and claims: its state as committed, snapshotted at the boundary.
        self._committed = CommittedState(self._state, self.log)

        # Step state: what this replica group has committed, and the step in progress.
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_seq = 0
        self._quorum_id: int | None = None
        self._quorum_future: CFuture[None] | None = None
        self._plan: StepPlan | None = None
        self._last_plan: StepPlan | None = None  # the plan of the last step taken, kept across steps
        self._pending: list[torch.futures.Future[torch.Tensor]] = []  # this step's allreduces
        self._issued_at = 0.0  # when this step's first allreduce went out
        # When the configure of the quorum in use / the commit's waits began (None: not now): a
        # step waiting on a peer is told apart from one that computes (`_stuck`, `_blocked`).
        self._configuring_since: float | None = None
        self._waiting_since: float | None = None
        self._errored: Exception | None = None
        self._error_lock = threading.Lock()
        self._pending_state: dict[str, Any] | None = None  # a healer's received state, not loaded yet
        self._healed_at_start = False  # this step's heal was loaded before its forward pass
        self._sent_checkpoint = False
        self._vote_across_groups = CrossGroupVote()
        self._layout: dict[str, str] | None = None  # published with every quorum request
        self._shutdown = False
        #: The lighthouse said the training finished ahead of this group (`_end_after_finish`).
        self._ended_after_finish = False

        # Only the leader talks to the lighthouse. Built before anything connects: a missing address
        # is a configuration error, raised before a store or a transport is left behind.
        # It waits out a lighthouse outage (lighthouse/reconnect.py); the other ranks wait as long.
        self._client: QuorumClient | None = None
        tuned = defaults.worker_env() if worker_env is None else worker_env
        outage = tuned.lighthouse_outage
        self._outage = LastQuorumSteps(tuned.outage_steps)  # the leader steps on through an outage
        self._heal_claims = tuned.heal_claims
        if self._group_rank == 0:
            self._client = quorum_client or defaults.lighthouse_client(
                lighthouse_addr, token, timeouts.connect, outage
            )
        self._group = GroupStore.open(
            group_store,
            store_addr if store_addr is not None else group_env.master_addr,
            store_port if store_port is not None else group_env.master_port,
            replica_id=self.replica_id,
            attempt=group_env.incarnation,
            rank=self._group_rank,
            world_size=self._group_world_size,
            hostname=hostname or defaults.local_addr(lighthouse_addr),
            timeouts=timeouts,
            leader_outage=outage,
        )

        if checkpoint_transport is None:
            from ftlaunch.checkpointing import HTTPTransport

            checkpoint_transport = HTTPTransport(
                timeout=timeouts.as_timedelta("heal"),
                bind=defaults.local_addr(lighthouse_addr) or "127.0.0.1",
            )
        self._transport: CheckpointTransport[Any] = checkpoint_transport
        # Published once this rank is ready (`quorum_request.become_ready`): the leader's read of
        # every rank's metadata is then also the wait for the whole group to be ready.
        self._ready = False
        self._transport_metadata: list[str] | None = None  # every rank's, read once by the leader
        self._phases = phases.enabled()  # the opt-in start-up phase log, until the first commit

        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"ftlaunch-quorum-{self.replica_id}"
        )
        # The leader's heartbeats (from its first request), progress reports, progress watchdog and
        # lost-peer abort (worker/leader.py): a participant of the quorum in use that the lighthouse
        # declares lost (hung, gone) aborts the step at once, not after the collective timeout.
        multi_rank = self._group_world_size > 1
        self._hang_abort = LostPeerAbort(
            self._pg.abort, self.log,
            tell_group=self._group.tell_lost if multi_rank and self._group_rank == 0 else None,
            told_by_leader=self._group.was_lost if multi_rank and self._group_rank != 0 else None,
            stuck=self._stuck,
        )  # fmt: skip
        in_flight = lambda: self._quorum_future is not None and not self._quorum_future.done()  # noqa: E731
        self._link = LeaderLink(
            self._client, self.replica_id, heartbeat_interval=to_seconds(heartbeat_interval),
            progress_limit=progress_timeout(timeouts.collective, tuned.progress_timeout), in_flight=in_flight, hang_abort=self._hang_abort,
            blocked=self._blocked, logger=self.log,
        )  # fmt: skip
        self._progress = self._link.progress
        self.log.info(
            "manager up: group world_size=%d store=%s transport=%s",
            self._group_world_size, self._group.address, type(self._transport).__name__,
        )  # fmt: skip
        timeouts.log(self.log)
        if port is not None:
            self.log.info("port=%d is not used: ftlaunch has no per-group manager server", port)
        self._mark("manager_up")

    def _mark(self, phase: str) -> None:
        if self._phases:
            phases.mark(phase, step=self._step)

    # ============================================================================ 1. the quorum
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | float | None = None
    ) -> None:
        """Begin a step: ask for its quorum (in the background when ``use_async_quorum``).

        A group that may heal in this quorum (it was behind, or has just started) waits for the
        quorum here, and loads the healed state before returning: its forward pass then runs on the
        state its peers committed, so buffers that a forward updates (BatchNorm statistics) stay
        the same as theirs. Live mode (`serve_live_state`) loads at the commit instead."""
        if self._shutdown:
            raise FtlaunchError("manager is shut down")
        self._link.touch()
        if self._quorum_future is not None and not self._quorum_future.done():
            # The previous step never waited for its quorum (no allreduce, no commit): finish it.
            self._quorum_future.exception()
        # The commit boundary: the optimizer applied the last committed step and this step's forward
        # pass has not begun. A heal due now is served from a snapshot of exactly this state.
        self._committed.at_boundary(self._step, snapshot_due(self._step, self._last_plan))
        live = self._committed.live
        heal_first = allow_heal and not live and may_heal(self._step, self._last_plan)
        self._errored = None
        self._pending = []
        self._pending_state = None
        self._healed_at_start = False
        self._plan = None
        quorum_timeout = self.timeouts.quorum if timeout is None else to_seconds(timeout)
        if self._progress is not None:
            self._progress.step_started()
        self._quorum_seq += 1
        synchronous = heal_first or not self._use_async_quorum
        self._quorum_future = self._executor.submit(
            self._run_quorum, self._quorum_seq, allow_heal, shrink_only, quorum_timeout, synchronous or live
        )
        if synchronous:
            self.wait_quorum()
            if not live:
                self._heal_before_forward()

    def _heal_before_forward(self) -> None:
        """Load this step's healed state now, if every rank of the group received its part (a group
        vote: one rank must not move to the source's step while another stays behind). A state
        that did not arrive everywhere is loaded nowhere, and the step is not committed."""
        plan = self._plan
        if plan is None or not plan.heal:
            return
        ok = self._pending_state is not None and self._errored is None
        if self._group_world_size > 1:
            deadline = time.monotonic() + self.timeouts.heal
            try:
                ok = self._group.vote(self._quorum_seq, ok, deadline, topic="heal")
            except CommunicationError as e:
                self.report_error(e)
                ok = False
        if not ok:
            self.report_error(CommunicationError("a rank of this group received no state: nobody loads it"))
            self._pending_state = None
            return
        self._load_healed_state()
        self._healed_at_start = True

    def wait_quorum(self) -> None:
        """Block until this step's quorum is known; fatal lighthouse errors and a layout that
        differs from the up-to-date groups' (`require_same_layout`) are raised here."""
        if self._quorum_future is None:
            raise FtlaunchError("wait_quorum() before start_quorum()")
        if self._progress is not None and not self._quorum_future.done():
            waiting_since = time.perf_counter()
            self._quorum_future.exception()  # waits; raised below
            self._progress.waited(time.perf_counter() - waiting_since)
        try:
            self._quorum_future.result()
        except TrainingFinishedError as e:
            self._end_after_finish(e)
        except (LighthouseError, ConfigurationError):
            raise
        except Exception as e:  # noqa: BLE001 - reconfigure/heal failures: survive, skip the step
            self.report_error(e)

    def _end_after_finish(self, e: TrainingFinishedError) -> None:
        """The training finished while this group was behind it (restarted just as the others
        ended), with nobody left to heal it from: end this process cleanly, as a straggler of a
        finished job. Exit status 0, so that torchelastic does not restart the group into the same
        answer; the leave tells the lighthouse without "finished" or a checksum (this state is not
        the job's result)."""
        self.log.warning("ending as a straggler of a finished job: %s", e)
        self._ended_after_finish = True
        self.shutdown()
        raise SystemExit(0) from None

    # ============================================================================ 2. allreduce
    def allreduce(
        self,
        tensor: torch.Tensor,
        reduce_op: ReduceOpLike | bool | int = "avg",
        should_quantize: bool | int | ReduceOpLike = False,
    ) -> ManagedWork:
        """Fault-tolerant allreduce over the replica groups; averages over the participating groups.

        Returns a Work (torchft's): ``get_future()`` completes with the tensor, ``wait()`` returns
        whether the step is still good. Never raises a communication error: a failure is recorded
        (``errored()``), the future completes with the tensor as is, and ``should_commit()`` will
        refuse the step. ``should_quantize`` (True or 8, or 4: the bit width) sends low-bit codes
        instead of the values (`ftlaunch.worker.quantization`; avg/sum of floating point tensors
        only, else ValueError). torchft's positional order, ``allreduce(tensor, should_quantize,
        reduce_op)``, is accepted too (`allreduce_math.torchft_positional`).
        """
        reduce_op, should_quantize = allreduce_math.torchft_positional(reduce_op, should_quantize)
        bits = allreduce_math.check_args(tensor, reduce_op, should_quantize)
        if self._progress is not None:
            self._progress.peers_needed()
        self.wait_quorum()
        plan = self._plan
        if plan is None or self._pg.errored() is not None:
            # No usable process group this step (quorum or reconfigure failed): nothing to talk to.
            return self._work(completed_future(tensor))
        # Even after a local error we still take part: every group must issue the same sequence of
        # collectives, or peers hang (or gloo aborts on a size mismatch). The commit vote discards the step.
        zeros = not plan.participates or self._errored is not None
        fut = allreduce_math.reduce_across_groups(
            self._pg, plan, tensor, reduce_op, bits, zeros, self.report_error
        )
        if fut is None:
            return self._work(completed_future(tensor))
        if not self._pending:
            self._issued_at = time.monotonic()
        self._pending.append(fut)
        return self._work(fut)

    def _stuck(self) -> bool:
        """After the lighthouse said the quorum in use lost a participant (hang_abort): whether to
        abort now. A configure in flight, at once: it cannot complete without every participant
        (nor at all when the lost one hosted the rendezvous store: it waited a second for nothing,
        and its peers for it, in the soak); an allreduce, once it has been pending for `SUSPECT_AFTER` (a
        dead peer makes it fail by itself, and an abort would replace a usable Baby child)."""
        if self._configuring_since is not None:
            return True
        pending = list(self._pending)
        return any(not f.done() for f in pending) and time.monotonic() - self._issued_at >= SUSPECT_AFTER

    def _blocked(self) -> tuple[int, float] | None:
        """For the leader's heartbeats (``blocked``): the quorum in use and how long this step has
        waited in its collectives (configure, allreduces, the commit's waits), once that is
        `SUSPECT_AFTER` or more; else None. The lighthouse declares a silent peer lost on it."""
        quorum_id = self._quorum_id
        starts = [t for t in (self._configuring_since, self._waiting_since) if t is not None]
        if any(not f.done() for f in list(self._pending)):
            starts.append(self._issued_at)
        if quorum_id is None or not starts:
            return None
        waited = time.monotonic() - min(starts)
        return (quorum_id, waited) if waited >= SUSPECT_AFTER else None

    def _work(self, future: torch.futures.Future[torch.Tensor]) -> ManagedWork:
        return ManagedWork(future, lambda: self._errored is not None, self.report_error)

    def wrap_future(
        self, fut: torch.futures.Future[T], default: T, timeout: timedelta | float | None = None
    ) -> torch.futures.Future[T]:
        """A future that never fails (torchft's API): ``fut``'s value, or ``default`` when ``fut``
        fails or does not complete within ``timeout`` (default: the collective timeout). The
        failure is reported (``errored()``), so this step will not commit."""
        seconds = self.timeouts.collective if timeout is None else to_seconds(timeout)
        return with_default(fut, default, seconds, self.report_error)

    def report_error(self, e: Exception) -> None:
        """Record a failure of this step: it will not be committed (by any group)."""
        with self._error_lock:
            if self._errored is None:
                self._errored = e
                self.log.warning("step failed, will not commit: %s: %s", type(e).__name__, e)

    def errored(self) -> Exception | None:
        """This step's first failure, or None."""
        return self._errored

    # ============================================================================ 3. the commit
    def should_commit(self, timeout: timedelta | float | None = None) -> bool:
        """True when every rank of every participating group finished this step cleanly."""
        if self._quorum_future is None:
            raise FtlaunchError("should_commit() before start_quorum()")
        self._link.touch()
        budget = self.timeouts.commit if timeout is None else to_seconds(timeout)
        deadline = time.monotonic() + budget
        if self._progress is not None:
            self._progress.peers_needed()
            self._progress.commit_started()
        self.wait_quorum()
        self._waiting_since = time.monotonic()
        interrupted = self._hang_abort.watch(self._pg.prepare_abort)
        if not wait_all(self._pending, deadline, interrupted):
            # A collective of this step hangs (a peer stopped, not died). Give up on the step and
            # abort the process group so the hung op is released; the next quorum rebuilds it.
            # When the lighthouse said the peer is lost, that abort is under way already.
            lost = self._hang_abort.error
            self._hang_abort.settle()
            self.report_error(lost or CommunicationError(
                f"commit timed out after {budget:g} s waiting for this step's allreduces"))  # fmt: skip
            if lost is None:
                self._pg.abort()
        self._pending = []
        plan = self._plan
        healed = self._healed_at_start
        if (
            plan is not None
            and plan.heal
            and self._pending_state is None
            and not healed
            and self._errored is None
        ):
            self.report_error(CommunicationError("healing was planned but no state was received"))

        # Enough groups up to date (torchft's rule: those at the quorum's max step; at step 0 with
        # init_sync that is every group, though only the primary's gradients count).
        ok = self._errored is None and plan is not None and plan.num_up_to_date >= self._min_replica_size
        if plan is not None and plan.replica_world_size > 1:
            lost = self._hang_abort.error
            if lost is not None:  # the quorum lost a peer: no vote with it (every live peer was told)
                self.report_error(lost)
                ok = False
            else:
                ok = vote_of_all_groups(self._vote_across_groups, self._pg, ok, deadline, self.report_error,
                                        interrupted)  # fmt: skip
        if self._group_world_size > 1:
            ok = vote_of_group_ranks(
                self._group, self._quorum_seq, ok, deadline, self.report_error, self.replica_id
            )
        if self._hang_abort.error is not None:
            self._hang_abort.settle()  # the aborted ops fail within this step
        if self._sent_checkpoint:
            # Every healer has voted, so it has its copy: the state may change again.
            self._transport.disallow_checkpoint()
            self._sent_checkpoint = False
        self._committed.release()
        self._waiting_since = None
        self._outage.after_step(ok, plan)

        if ok and plan is not None and plan.waits:
            # Voted yes so that the others commit; behind, this group applies nothing (it heals
            # from their snapshot of this step's end, at the next quorum).
            return False
        if ok:
            assert plan is not None
            if plan.heal and not healed:
                # Live mode: only now, every rank of every group agreed, so every healing rank loads
                # together (one rank must not jump to the source's step while another stays behind).
                self._load_healed_state()
            self._step += 1
            self._batches_committed += plan.num_participants
            self._commit_failures = 0
            if self._progress is not None:
                self._progress.committed(self._step, healed=plan.heal)
            if self._phases:
                self._mark("first_commit")
                self._phases = False  # nothing more to time: the step path stays free of it
            return True
        self._commit_failures += 1
        if self._progress is not None:
            self._progress.not_committed()
        self.log.info("step not committed (consecutive failures: %d)", self._commit_failures)
        if self._max_retries is not None and self._commit_failures > self._max_retries:
            raise FtlaunchError(
                f"{self._commit_failures} consecutive steps failed to commit (max_retries="
                f"{self._max_retries}); last error: {self._errored!r}"
            )
        return False

    def _load_healed_state(self) -> None:
        state, self._pending_state = self._pending_state, None
        if state is None:  # guarded before the vote; kept as a clear error rather than a TypeError
            raise FtlaunchError("healing was planned but no state was received")
        self._state.load(state)
        self.log.info("healed: loaded state at step %d", self._step)

    # ============================================================================ teardown
    def shutdown(self, wait: bool = True, *, leave: bool = True) -> None:
        """Leave the lighthouse gracefully and release threads, servers and the process group.

        ``leave=False`` (the training failed): just close the connections, so the lighthouse counts
        a failure, as for a crash -- with hot spares a graceful leave would mean "this shard is done".
        """
        if self._shutdown:
            return
        self._shutdown = True
        # The final report rides on the leave. Only a clean exit (no exception on its way out
        # through a `finally`) reports the state's checksum and "finished"; a group the lighthouse
        # refused because the training finished without it reports neither.
        clean = sys.exc_info()[0] is None and not self._ended_after_finish
        self._link.close(self._step, self._state.agreed if clean else None, leave=leave)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._hang_abort.close()  # its notice watcher and an abort under way
        self._transport.shutdown(wait=wait)
        release_process_group(self._pg)
        self._group.close()  # its socket: nothing of this worker's may outlive shutdown
        self.log.info("manager shut down")

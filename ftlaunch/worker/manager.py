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

The Manager is the holder of its collaborators and reads in the step's order; each owns its state:
`step.StepCount` (what the group committed), `step.StepAttempt` (the step in progress, one per
``start_quorum``), `step_quorum.StepQuorum` (the quorum thread's round: ask, plan, reconfigure,
heal; it returns a `QuorumResult`), `commit.StepCommit` (wait, vote: a `Verdict`), `leader.LeaderLink`
(heartbeats, progress, watchdog), `hang_abort.LostPeerAbort`, `outage.LastQuorumSteps`,
`committed.CommittedState` (what a heal serves) and `recovery.StateRegistry` (what travels with it).
It is made from `manager_parts.ManagerParts` (`Manager.from_parts`); torchft's long-form
constructor fills those from its arguments and the environment (`defaults.manager_parts`).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable, Collection, MutableMapping
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
from ftlaunch.lighthouse.protocol import BLOCKED_FOR
from ftlaunch.process_group.base import ProcessGroup, release_process_group
from ftlaunch.process_group.work import completed_future
from ftlaunch.timeouts import Timeouts, to_seconds
from ftlaunch.worker import allreduce as allreduce_math
from ftlaunch.worker import defaults
from ftlaunch.worker.allreduce import ReduceOpLike
from ftlaunch.worker.commit import StepCommit, Verdict
from ftlaunch.worker.committed import CommittedState
from ftlaunch.worker.hang_abort import LostPeerAbort
from ftlaunch.worker.leader import LeaderLink
from ftlaunch.worker.managed_work import ManagedWork, with_default
from ftlaunch.worker.manager_parts import ManagerParts, ManagerSettings
from ftlaunch.worker.outage import LastQuorumSteps
from ftlaunch.worker.plan import StepPlan, WorldSizeMode, may_heal, snapshot_due
from ftlaunch.worker.recovery import DEFAULT_STATE_KEY, StateRegistry
from ftlaunch.worker.step import StepAttempt, StepCount
from ftlaunch.worker.step_quorum import QuorumResult, StepQuorum
from ftlaunch.worker.watchdog import progress_timeout

logger = logging.getLogger(__name__)

__all__ = [
    "ManagedWork",
    "Manager",
    "ManagerParts",
    "ManagerSettings",
    "ReduceOpLike",
    "WorldSizeMode",
    "release_process_group",
]

T = TypeVar("T")


class _StepLog(logging.LoggerAdapter):
    """Prefixes every record with ``[rg1/r0 step 42]`` so interleaved worker logs stay readable."""

    def __init__(self, settings: ManagerSettings, count: StepCount) -> None:
        super().__init__(logger, {})
        self._prefix = f"[{settings.replica_id}/r{settings.group_rank} step "
        self._count = count

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self._prefix}{self._count.step}] {msg}", kwargs


class Manager:
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
        """torchft's long form. Arguments not given default the way torchft's do, from the
        launcher's environment: ``replica_id`` from ``REPLICA_GROUP_ID``, ``rank``/``world_size``/
        ``store_addr``/``store_port`` from torchelastic's variables, ``lighthouse_addr``/``token``
        from ``FTLAUNCH_LIGHTHOUSE``/``FTLAUNCH_TOKEN``.

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

        A thin factory: `defaults.manager_parts` builds the collaborators, `from_parts` the Manager.
        """
        parts = defaults.manager_parts(
            pg, load_state_dict, state_dict, min_replica_size=min_replica_size,
            use_async_quorum=use_async_quorum, timeout=timeout, quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout, rank=rank, world_size=world_size,
            world_size_mode=world_size_mode,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse_addr,
            replica_id=replica_id,
            port=port, hostname=hostname, heartbeat_interval=heartbeat_interval,
            checkpoint_transport=checkpoint_transport, init_sync=init_sync, max_retries=max_retries,
            quorum_retries=quorum_retries, token=token, heal_timeout=heal_timeout,
            commit_timeout=commit_timeout,
            timeouts=timeouts, quorum_client=quorum_client, group_store=group_store, worker_env=worker_env,
        )  # fmt: skip
        self._assemble(parts)
        if port is not None:
            self.log.info("port=%d is not used: ftlaunch has no per-group manager server", port)

    @classmethod
    def from_parts(cls, parts: ManagerParts) -> Manager:
        """The core constructor: a Manager made of ``parts`` (``ftlaunch.init`` builds them)."""
        manager = cls.__new__(cls)
        manager._assemble(parts)
        return manager

    def _assemble(self, parts: ManagerParts) -> None:
        s = self._settings = parts.settings
        self.timeouts = s.timeouts
        self.replica_id = s.replica_id
        self._pg = parts.pg
        self._group = parts.group
        self._transport = parts.transport
        self._count = StepCount()
        self.log = _StepLog(s, self._count)
        self._state = StateRegistry(self._count.load_state_dict, self._count.state_dict)
        if parts.load_state_dict is not None and parts.state_dict is not None:
            self._state.register(DEFAULT_STATE_KEY, parts.load_state_dict, parts.state_dict)
        # What a heal source serves and claims: its state as committed, snapshotted at the boundary.
        self._committed = CommittedState(self._state, self.log)
        self._attempt = StepAttempt()  # the step in progress (a fresh one at each start_quorum)
        self._quorum_future: CFuture[QuorumResult] | None = None
        self._shutdown = False
        #: The lighthouse said the training finished ahead of this group (`_end_after_finish`).
        self._ended_after_finish = False
        self._outage = LastQuorumSteps(s.worker_env.outage_steps)  # the leader steps on through an outage
        self._phases = phases.enabled()  # the opt-in start-up phase log, until the first commit
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"ftlaunch-quorum-{s.replica_id}"
        )
        # The leader's heartbeats (from its first request), progress reports, progress watchdog and
        # lost-peer abort (worker/leader.py): a participant of the quorum in use that the lighthouse
        # declares lost (hung, gone) aborts the step at once, not after the collective timeout.
        multi_rank = s.group_world_size > 1
        self._hang_abort = LostPeerAbort(
            self._pg.abort, self.log,
            tell_group=self._group.tell_lost if multi_rank and s.group_rank == 0 else None,
            told_by_leader=self._group.was_lost if multi_rank and s.group_rank != 0 else None,
            stuck=self._stuck,
        )  # fmt: skip
        self._link = LeaderLink(
            parts.client, s.replica_id, heartbeat_interval=s.heartbeat_interval,
            progress_limit=progress_timeout(s.timeouts.collective, s.worker_env.progress_timeout),
            in_flight=self._quorum_in_flight, hang_abort=self._hang_abort, blocked=self._blocked,
            logger=self.log,
        )  # fmt: skip
        self._progress = self._link.progress
        self._round = StepQuorum(
            s, pg=self._pg, group=self._group, transport=self._transport, outage=self._outage,
            hang_abort=self._hang_abort, link=self._link, state=self._state, committed=self._committed,
            mark=self._mark, log=self.log,
        )  # fmt: skip
        self._commit = StepCommit(s, self._pg, self._group, self._hang_abort, self.report_error)
        self.log.info(
            "manager up: group world_size=%d store=%s transport=%s",
            s.group_world_size, self._group.address, type(self._transport).__name__,
        )  # fmt: skip
        s.timeouts.log(self.log)
        self._mark("manager_up")

    def _mark(self, phase: str) -> None:
        if self._phases:
            phases.mark(phase, step=self._count.step)

    def _quorum_in_flight(self) -> bool:
        future = self._quorum_future
        return future is not None and not future.done()

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
        if self._quorum_in_flight():
            # The previous step never waited for its quorum (no allreduce, no commit): finish it.
            assert self._quorum_future is not None
            self._quorum_future.exception()
        step, last_plan = self._count.step, self._round.last_plan
        # The commit boundary: the optimizer applied the last committed step and this step's forward
        # pass has not begun. A heal due now is served from a snapshot of exactly this state.
        self._committed.at_boundary(step, snapshot_due(step, last_plan))
        live = self._committed.live
        heal_first = allow_heal and not live and may_heal(step, last_plan)
        self._attempt = StepAttempt()
        quorum_timeout = self.timeouts.quorum if timeout is None else to_seconds(timeout)
        if self._progress is not None:
            self._progress.step_started()
        synchronous = heal_first or not self._settings.use_async_quorum
        self._quorum_future = self._executor.submit(
            self._round.run, self._round.begin(), step, self._count.commit_failures, allow_heal=allow_heal,
            shrink_only=shrink_only, timeout=quorum_timeout, heal_ready=synchronous or live,
        )  # fmt: skip
        if synchronous:
            self.wait_quorum()
            if not live:
                self._heal_before_forward()

    def _heal_before_forward(self) -> None:
        """Load this step's healed state now, if every rank of the group received its part (a group
        vote: one rank must not move to the source's step while another stays behind). A state
        that did not arrive everywhere is loaded nowhere, and the step is not committed."""
        attempt = self._attempt
        if attempt.plan is None or not attempt.plan.heal:
            return
        ok = attempt.received is not None and attempt.error is None
        if self._settings.group_world_size > 1:
            deadline = time.monotonic() + self.timeouts.heal
            try:
                ok = self._group.vote(self._round.seq, ok, deadline, topic="heal")
            except CommunicationError as e:
                self.report_error(e)
                ok = False
        if not ok:
            self.report_error(CommunicationError("a rank of this group received no state: nobody loads it"))
            attempt.take_received()
            return
        self._load_healed_state(attempt)
        attempt.healed_at_start = True

    def wait_quorum(self) -> None:
        """Block until this step's quorum is known; fatal lighthouse errors and a layout that
        differs from the up-to-date groups' (`require_same_layout`) are raised here."""
        if self._quorum_future is None:
            raise FtlaunchError("wait_quorum() before start_quorum()")
        try:
            result = self._quorum_future.result()
        except TrainingFinishedError as e:
            self._end_after_finish(e)
        except (LighthouseError, ConfigurationError):
            raise
        except Exception as e:  # noqa: BLE001 - reconfigure/heal failures: survive, skip the step
            self.report_error(e)
            return
        self._attempt.take_quorum(result.plan, result.received)
        if result.error is not None:  # the heal transfer failed: the step goes on, to be refused
            self.report_error(result.error)

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
        attempt = self._attempt
        plan = attempt.plan
        if plan is None or self._pg.errored() is not None:
            # No usable process group this step (quorum or reconfigure failed): nothing to talk to.
            return self._work(completed_future(tensor))
        # Even after a local error we still take part: every group must issue the same sequence of
        # collectives, or peers hang (or gloo aborts on a size mismatch). The commit vote discards the step.
        zeros = not plan.participates or attempt.error is not None
        fut = allreduce_math.reduce_across_groups(
            self._pg, plan, tensor, reduce_op, bits, zeros, self.report_error
        )
        if fut is None:
            return self._work(completed_future(tensor))
        attempt.issued(fut)
        return self._work(fut)

    def _stuck(self) -> bool:
        """After the lighthouse said the quorum in use lost a participant (hang_abort): whether to
        abort now. A configure in flight, at once: it cannot complete without every participant
        (nor at all when the lost one hosted the rendezvous store: it waited a second for nothing,
        and its peers for it, in the soak); an allreduce, once it has been pending for
        `protocol.BLOCKED_FOR` (a dead peer makes it fail by itself, and an abort would replace a
        usable Baby child)."""
        if self._round.configuring_since is not None:
            return True
        return self._attempt.allreduce_pending_for(time.monotonic()) >= BLOCKED_FOR

    def _blocked(self) -> tuple[int, float] | None:
        """For the leader's heartbeats (``blocked``): the quorum in use and how long this step has
        waited in its collectives (configure, allreduces, the commit's waits), once that is
        `protocol.BLOCKED_FOR` or more; else None. The lighthouse declares a silent peer lost on it."""
        quorum_id = self._round.quorum_id
        since = self._attempt.blocked_since(self._round.configuring_since)
        if quorum_id is None or since is None:
            return None
        waited = time.monotonic() - since
        return (quorum_id, waited) if waited >= BLOCKED_FOR else None

    def _work(self, future: torch.futures.Future[torch.Tensor]) -> ManagedWork:
        return ManagedWork(future, lambda: self.errored() is not None, self.report_error)

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
        if self._attempt.report_error(e):
            self.log.warning("step failed, will not commit: %s: %s", type(e).__name__, e)

    def errored(self) -> Exception | None:
        """This step's first failure, or None."""
        return self._attempt.error

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
        attempt = self._attempt
        # wait: for the step's collectives (bounded; cut short when a peer is lost)
        interrupted = self._commit.wait(attempt, deadline, budget)
        # vote: every group, then every rank of this group
        verdict = self._commit.vote(attempt, self._round.seq, deadline, interrupted)
        self._round.heals_over()
        attempt.waiting_since = None
        self._outage.after_step(verdict.agreed, attempt.plan)
        # apply, or count the failure
        if verdict is Verdict.COMMIT:
            self._apply(attempt)
            return True
        if verdict is Verdict.TOO_FEW:
            self._heal_only(attempt)
        if verdict in (Verdict.REFUSE, Verdict.TOO_FEW):
            self._count_failure(attempt)
        return False

    def _heal_only(self, attempt: StepAttempt) -> None:
        """A clean step with too few groups up to date: a live healer loads what it received, so
        that the next step has one more group up to date (see `Verdict.TOO_FEW`)."""
        plan = attempt.plan
        if plan is not None and plan.heal and not attempt.healed_at_start and attempt.received is not None:
            self._load_healed_state(attempt)

    def _apply(self, attempt: StepAttempt) -> None:
        """Every rank of every group agreed on the step: it counts (and a live heal loads now)."""
        plan = attempt.plan
        assert plan is not None  # a committed step had one
        if plan.heal and not attempt.healed_at_start:
            # Live mode: only now, every rank of every group agreed, so every healing rank loads
            # together (one rank must not jump to the source's step while another stays behind).
            self._load_healed_state(attempt)
        self._count.committed(plan.num_participants)
        if self._progress is not None:
            self._progress.committed(self._count.step, healed=plan.heal)
        if self._phases:
            self._mark("first_commit")
            self._phases = False  # nothing more to time: the step path stays free of it

    def _count_failure(self, attempt: StepAttempt) -> None:
        if self._progress is not None:
            self._progress.not_committed()
        failures = self._count.failed()
        self.log.info("step not committed (consecutive failures: %d)", failures)
        max_retries = self._settings.max_retries
        if max_retries is not None and failures > max_retries:
            raise FtlaunchError(
                f"{failures} consecutive steps failed to commit (max_retries={max_retries}); "
                f"last error: {attempt.error!r}"
            )

    def _load_healed_state(self, attempt: StepAttempt) -> None:
        state = attempt.take_received()
        if state is None:  # guarded before the vote; kept as a clear error rather than a TypeError
            raise FtlaunchError("healing was planned but no state was received")
        self._state.load(state)
        self.log.info("healed: loaded state at step %d", self._count.step)

    # ============================================================================ state (torchft's API)
    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Add state that travels with live recovery (e.g. a data loader position)."""
        self._state.register(key, load_state_dict, state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """torchft's older name: `register_state_dict_fn` under the key ``"set_state_dict_fns"``."""
        warnings.warn(
            "set_state_dict_fns is deprecated: use register_state_dict_fn", DeprecationWarning, stacklevel=2
        )
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def require_same_layout(self, digest: str, text: str = "") -> None:
        """Publish how this group lays out its state (e.g. how it shards the model: ``digest``
        identifies it, ``text`` describes it for error messages) and refuse to take part in a step
        whose up-to-date groups publish another layout: gradient shards would be averaged with the
        wrong peers' shards and healed state would land in the wrong places. The refusal is a
        `ConfigurationError` raised into the training loop. Call it before the first step, with
        the same value on every rank of the group.
        """
        self._round.layout = {"digest": digest, "text": text}

    def disallow_state_dict_read(self) -> None:
        """Keep the state from being read for a heal while the caller changes it outside a step
        (waits for a read in progress). Healing this step's peers then waits, up to the heal
        timeout, for `allow_state_dict_read`."""
        self._state.gate.disallow()

    def allow_state_dict_read(self) -> None:
        """Let heals read the state again (see `disallow_state_dict_read`)."""
        self._state.gate.allow()

    def set_agreed_state(self, select: Callable[[dict[str, Any]], Any]) -> None:
        """Say which part of the state every replica group holds bit-identical after each commit:
        ``select`` gets the whole state that travels with a heal (the default answer) and returns
        that part. The group leader reports its checksum at a clean exit, and ``ftlaunch``'s summary
        compares them across groups. DDP leaves out the module's buffers (BatchNorm statistics are
        each replica's own, as in torch's DDP), LocalSGD keeps the parameters and DiLoCo its global
        parameters and outer optimizer state: their groups legitimately differ in the rest."""
        self._state.agreed_fn = select

    def serve_live_state(self) -> None:
        """Heals serve the training tensors themselves, at every quorum, instead of a snapshot the
        Manager copies at the commit boundary when a heal is due (worker/committed.py).

        For training loops that take each quorum synchronously (``start_quorum`` then
        ``wait_quorum`` before anything else) and change no state until the step's first collective
        completed -- every healer fetches before it joins one: LocalSGD and DiLoCo, whose quorums
        are their sync points. They skip the copy of the model at each sync point, and a joining
        group heals at the first one instead of waiting a sync interval for a snapshot. Any other
        loop must not call it: its forward pass would change what the heal reads.
        """
        self._committed.live = True

    def save_after_syncs(self, shared: Collection[str] = ()) -> None:
        """Durable checkpoints of this job are taken after its syncs (`sync_applied`), not at the
        commit boundary: for LocalSGD and DiLoCo, whose boundary is the next sync point's quorum,
        when each group holds a whole interval of local progress. ``shared``: the registered
        entries every group holds bit-identical right after a sync (DiLoCo's global parameters and
        outer state); each group saves the others, its inner optimizer state among them, on its own
        (docs/checkpointing.md). Without durable checkpoints it does nothing."""
        if self._committed.durable is not None:
            self._committed.durable.save_after_syncs(shared)

    def sync_applied(self) -> None:
        """The algorithm applied the sync this step committed (`save_after_syncs`): the state is the
        one every group shares, the moment to save it when the step is due."""
        if self._committed.durable is not None:
            self._committed.durable.after_sync(self._count.step)

    def state_dict(self) -> dict[str, int]:
        return self._count.state_dict()

    def _manager_state_dict(self) -> dict[str, Any]:
        """torchft's name for everything a heal carries: ``{"user": {key: state}, "torchft":
        self.state_dict()}``. Private in torchft, but torchft users' tests read it to compare groups
        step by step, so the name and layout are kept (README, *What still differs*)."""
        return self._state.torchft_layout()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._count.load_state_dict(state_dict)

    def current_step(self) -> int:
        return self._count.step

    def batches_committed(self) -> int:
        return self._count.batches_committed

    def num_participants(self) -> int:
        """Groups whose gradients count this step (the divisor of the average): the up-to-date
        groups, at most ``min_replica_size`` of them with `WorldSizeMode.FIXED_WITH_SPARES`."""
        self.wait_quorum()
        plan = self._attempt.plan
        return plan.num_participants if plan is not None else 0

    def participating_rank(self) -> int | None:
        """This group's rank among the participants, None while it heals or stands by as a spare."""
        self.wait_quorum()
        plan = self._attempt.plan
        return plan.participant_rank if plan is not None else None

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def latest_plan(self) -> tuple[int, StepPlan | None]:
        """``(attempt, plan)`` of the latest step, read without waiting: ``attempt`` changes whenever
        a step begins (it numbers the quorum requests), ``plan`` is None until that step's quorum is
        known and when the step failed before planning. Between two steps it describes the step
        that just ended -- who took part (``plan.participant_ids``), from which step
        (``plan.max_step``) -- which is what the exactly-once sampler reads after a commit."""
        return self._round.seq, self._attempt.plan

    @property
    def pg(self) -> ProcessGroup:
        return self._pg

    @property
    def group_rank(self) -> int:
        return self._settings.group_rank

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
        self._link.close(self._count.step, self._state.agreed if clean else None, leave=leave)
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._hang_abort.close()  # its notice watcher and an abort under way
        self._transport.shutdown(wait=wait)
        release_process_group(self._pg)
        self._group.close()  # its socket: nothing of this worker's may outlive shutdown
        self.log.info("manager shut down")

"""The Manager: the per-step fault-tolerance protocol of one worker of one replica group.

Each step::

    start_quorum()      # optimizer.zero_grad(): ask for the step's quorum in the background
    ... forward ...     # overlaps the quorum round trip (and the heal transfer, if any)
    allreduce(grad)     # waits for the quorum, reconfigures the cross-group PG if its id changed
    should_commit()     # optimizer.step(): every group and every rank agrees, or nobody commits

Failures never raise into the training loop: a failed collective, reconfigure or heal marks the step
as errored, ``should_commit`` returns False everywhere, and the next quorum (which the failure changes)
carries on without the dead group. Only conditions training cannot survive raise: the lighthouse is
gone, this group was evicted, or ``max_retries`` consecutive steps failed.

Inside a replica group only the leader (group rank 0) talks to the lighthouse; the quorum and the
commit votes travel to the other ranks through the group's own store, so all ranks agree.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ftlaunch import env
from ftlaunch.errors import (
    CommunicationError,
    ConfigurationError,
    EvictedError,
    FtlaunchError,
    LighthouseError,
)
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.process_group.base import completed_future
from ftlaunch.timeouts import to_seconds
from ftlaunch.worker.plan import StepPlan, plan_step

if TYPE_CHECKING:
    from ftlaunch.timeouts import Timeouts

logger = logging.getLogger(__name__)

#: Key of the manager's own state inside the healed state dict.
MANAGER_STATE_KEY = "ftlaunch_manager"
#: Key of the user state registered through the constructor.
DEFAULT_STATE_KEY = "default"


def _wait_all(futures: list[torch.futures.Future[Any]], deadline: float) -> bool:
    """Wait for every future until ``deadline`` (monotonic); False if some are still running.

    torch futures have no timed wait: completion callbacks count down to an Event instead. The
    common case (everything already done by the time the optimizer steps) costs one check each.
    """
    waiting = [f for f in futures if not f.done()]
    if waiting:
        done = threading.Event()
        left = [len(waiting)]
        lock = threading.Lock()

        def one_done(_: torch.futures.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for f in waiting:
            f.add_done_callback(one_done)
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            return False
    for f in futures:
        f.wait()  # done: surfaces nothing (errors were reported in the completion callbacks)
    return True


def release_process_group(pg: Any) -> None:
    """Shut ``pg`` down if it can be; best effort (teardown must not mask the reason for it)."""
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is None:
        return
    try:
        shutdown()
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        logger.debug("process group shutdown: %s", e)


def _is_avg(op: Any) -> bool:
    """AVG given as a string, a ``ReduceOp`` or a ``ReduceOp.RedOpType`` (which compare equal)."""
    if isinstance(op, str):
        if op.lower() not in ("avg", "sum"):
            raise ValueError(f"reduce_op must be 'avg', 'sum' or a torch ReduceOp, got {op!r}")
        return op.lower() == "avg"
    return bool(op == dist.ReduceOp.AVG)


class _StepLog(logging.LoggerAdapter):
    """Prefixes every record with ``[rg1/r0 step 42]`` so interleaved worker logs stay readable."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(logger, {})
        self._m = manager

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        m = self._m
        return f"[{m.replica_id}/r{m._group_rank} step {m._step}] {msg}", kwargs


class Manager:
    """Per-step quorum, fault-tolerant allreduce, commit and live recovery (torchft's API)."""

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[Any], None] | None,
        state_dict: Callable[[], Any] | None,
        min_replica_size: int = 1,
        use_async_quorum: bool = True,
        timeout: timedelta | float | None = None,
        quorum_timeout: timedelta | float | None = None,
        connect_timeout: timedelta | float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta | float = timedelta(milliseconds=100),
        checkpoint_transport: Any | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        token: str | None = None,
        heal_timeout: timedelta | float | None = None,
        commit_timeout: timedelta | float | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        """Timeouts: ``timeout`` is the one knob (else ``FTLAUNCH_TIMEOUT``, else 60 s); the quorum,
        connect, heal and commit timeouts derive from it unless given, and the set is validated
        (``ftlaunch.timeouts``). ``timeouts=`` passes an already derived set instead.
        """
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        if max_retries is not None and max_retries < 0:
            raise ValueError(f"max_retries must be >= 0 or None, got {max_retries}")
        self._pg = pg
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        if timeouts is None:
            from ftlaunch.timeouts import Timeouts

            timeouts = Timeouts.derive(
                timeout, quorum=quorum_timeout, connect=connect_timeout, heal=heal_timeout, commit=commit_timeout
            )
        elif any(t is not None for t in (timeout, quorum_timeout, connect_timeout, heal_timeout, commit_timeout)):
            raise ValueError("pass either timeouts= or the individual timeouts, not both")
        self.timeouts = timeouts
        self._timeout = timeouts.collective
        self._quorum_timeout = timeouts.quorum
        self._connect_timeout = timeouts.connect
        self._heal_timeout = timeouts.heal
        self._commit_timeout = timeouts.commit
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._quorum_retries = quorum_retries

        self._group_rank = rank if rank is not None else (env.get_int(env.RANK) or 0)
        self._group_world_size = world_size if world_size is not None else (env.get_int(env.WORLD_SIZE) or 1)
        if not 0 <= self._group_rank < self._group_world_size:
            raise ConfigurationError(f"rank {self._group_rank} is outside world_size {self._group_world_size}")
        if replica_id is None:
            rgid = os.environ.get(env.REPLICA_GROUP_ID)
            if rgid is None:
                raise ConfigurationError(
                    f"no replica_id given and {env.REPLICA_GROUP_ID} is not set: launch with "
                    "`ftlaunch --replicas N script.py` or pass replica_id="
                )
            replica_id = f"rg{rgid}"
        self.replica_id = replica_id
        self.log = _StepLog(self)

        self._user_state: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("pass both load_state_dict and state_dict, or neither")
        if load_state_dict is not None and state_dict is not None:
            self._user_state[DEFAULT_STATE_KEY] = (load_state_dict, state_dict)

        # Step state.
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_seq = 0
        self._quorum_id: int | None = None
        self._plan: StepPlan | None = None
        self._quorum_future: CFuture[None] | None = None
        self._pending: list[torch.futures.Future[Any]] = []
        self._errored: Exception | None = None
        self._error_lock = threading.Lock()
        self._pending_state: dict[str, Any] | None = None
        self._sent_checkpoint = False
        self._shutdown = False
        # The commit vote's flag, reused every step (see _cross_group_vote).
        self._vote_flag: torch.Tensor | None = None

        self._group_store, self._store_address = self._connect_group_store(
            store_addr, store_port, hostname
        )

        if checkpoint_transport is None:
            from ftlaunch.checkpointing import HTTPTransport

            checkpoint_transport = HTTPTransport(timeout=timedelta(seconds=self._heal_timeout))
        self._transport = checkpoint_transport
        self._group_store.set(f"ckpt_meta/{self._group_rank}", self._transport.metadata())
        self._ckpt_metas: list[str] | None = None

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ftlaunch-quorum-{replica_id}")
        self._client = None
        self._heartbeat = None
        if self._group_rank == 0:
            from ftlaunch.lighthouse.client import LighthouseClient

            addr = lighthouse_addr or env.lighthouse_address()
            if not addr:
                raise ConfigurationError(
                    f"no lighthouse address: pass lighthouse_addr= or set {env.FTLAUNCH_LIGHTHOUSE} "
                    "(the `ftlaunch` launcher sets it for you)"
                )
            self._client = LighthouseClient(
                addr, connect_timeout=self._connect_timeout, token=token or os.environ.get(env.FTLAUNCH_TOKEN)
            )
            self._heartbeat = self._client.start_heartbeat(replica_id, to_seconds(heartbeat_interval))
        self.log.info(
            "manager up: group world_size=%d store=%s transport=%s",
            self._group_world_size,
            self._store_address,
            type(self._transport).__name__,
        )
        timeouts.log(self.log)

    # ----------------------------------------------------------------------------- setup helpers
    def _connect_group_store(
        self, store_addr: str | None, store_port: int | None, hostname: str | None
    ) -> tuple[dist.Store, str]:
        """The replica group's own store: torchelastic's (or the caller's), or a private one.

        Keys are prefixed per restart attempt so a restarted group never reads its previous
        incarnation's quorum or votes (torchelastic keeps its store across worker restarts).
        """
        # Non-leader ranks wait on the store for the leader's quorum call (quorum + its connect retries).
        self._store_timeout = timedelta(seconds=max(self._quorum_timeout + self._connect_timeout, self._timeout))
        addr = store_addr or os.environ.get(env.MASTER_ADDR)
        port = store_port if store_port is not None else env.get_int(env.MASTER_PORT)
        if addr is None or port is None:
            if self._group_world_size != 1:
                raise ConfigurationError(
                    "a replica group with more than one worker needs its store: set MASTER_ADDR and "
                    "MASTER_PORT (torchrun/ftlaunch do) or pass store_addr/store_port"
                )
            host = hostname or "127.0.0.1"
            store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self._timeout)
            )
            addr, port = host, store.port
        else:
            try:
                store = dist.TCPStore(
                    addr,
                    port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=self._connect_timeout),
                )
            except Exception as e:  # noqa: BLE001 - torch raises several types here
                raise CommunicationError(f"cannot connect to the replica group's store at {addr}:{port}: {e}") from e
            store.set_timeout(self._store_timeout)
        attempt = os.environ.get(env.TORCHELASTIC_RESTART_COUNT, "0")
        prefixed = dist.PrefixStore(f"/ftlaunch/{self.replica_id}/attempt_{attempt}", store)
        host_for_peers = addr if ":" not in addr or addr.startswith("[") else f"[{addr}]"
        return prefixed, f"{host_for_peers}:{port}"

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Add state that travels with live recovery (e.g. a data loader position)."""
        if key in self._user_state or key == MANAGER_STATE_KEY:
            raise ValueError(f"state dict key {key!r} is already registered")
        self._user_state[key] = (load_state_dict, state_dict)

    # ----------------------------------------------------------------------------- quorum
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | float | None = None
    ) -> None:
        """Begin a step: ask for its quorum (in the background when ``use_async_quorum``)."""
        if self._shutdown:
            raise FtlaunchError("manager is shut down")
        if self._quorum_future is not None and not self._quorum_future.done():
            # The previous step never waited for its quorum (no allreduce, no commit): finish it.
            self._quorum_future.exception()
        self._errored = None
        self._pending = []
        self._pending_state = None
        self._plan = None
        quorum_timeout = self._quorum_timeout if timeout is None else to_seconds(timeout)
        self._quorum_seq += 1
        fut = self._executor.submit(self._run_quorum, self._quorum_seq, allow_heal, shrink_only, quorum_timeout)
        self._quorum_future = fut
        if not self._use_async_quorum:
            self.wait_quorum()

    def wait_quorum(self) -> None:
        """Block until this step's quorum is known; fatal lighthouse errors are raised here."""
        if self._quorum_future is None:
            raise FtlaunchError("wait_quorum() before start_quorum()")
        try:
            self._quorum_future.result()
        except LighthouseError:
            raise
        except Exception as e:  # noqa: BLE001 - reconfigure/heal failures: survive, skip the step
            self.report_error(e)

    def _run_quorum(self, seq: int, allow_heal: bool, shrink_only: bool, quorum_timeout: float) -> None:
        quorum = self._fetch_quorum(seq, shrink_only, quorum_timeout)
        plan = plan_step(quorum, self.replica_id, init_sync=self._init_sync)
        if plan.quorum_id != self._quorum_id:
            self._reconfigure(plan)
        self._plan = plan
        if not allow_heal:
            return
        if plan.recover_dst_ranks:
            self.log.info("sending state to replica ranks %s", list(plan.recover_dst_ranks))
            self._transport.send_checkpoint(
                dst_ranks=list(plan.recover_dst_ranks),
                step=self._step,
                state_dict=self._full_state_dict(),
                timeout=timedelta(seconds=self._heal_timeout),
            )
            self._sent_checkpoint = True
        if plan.heal:
            src_rank = plan.recover_src_rank
            assert src_rank is not None  # plan.heal means recover_src_rank is set
            src = quorum.participants[src_rank]
            metas = src.data.get("ckpt") or []
            meta = metas[self._group_rank] if self._group_rank < len(metas) else ""
            self.log.info("healing from %s at step %d", plan.recover_src_id, plan.max_step)
            state = self._transport.recv_checkpoint(
                src_rank=src_rank,
                metadata=meta,
                step=plan.max_step,
                timeout=timedelta(seconds=self._heal_timeout),
            )
            missing = [k for k in (MANAGER_STATE_KEY, *self._user_state) if k not in state]
            if missing:  # checked here so the step fails the vote instead of raising after commit
                raise CommunicationError(
                    f"state received from {plan.recover_src_id} has no entries {missing}: "
                    "do all groups register the same state?"
                )
            self._pending_state = state

    def _fetch_quorum(self, seq: int, shrink_only: bool, quorum_timeout: float) -> Quorum:
        key = f"quorum/{seq}"
        if self._group_rank != 0:
            raw = self._group_store.get(key)
            payload = json.loads(raw)
            if "error" in payload:
                cls = EvictedError if payload.get("type") == "EvictedError" else LighthouseError
                raise cls(f"the group leader could not get a quorum: {payload['error']}")
            return Quorum.from_json(payload)
        try:
            quorum = self._leader_quorum(shrink_only, quorum_timeout)
        except Exception as e:
            if self._group_world_size > 1:
                self._group_store.set(key, json.dumps({"error": str(e), "type": type(e).__name__}))
            raise
        if self._group_world_size > 1:
            self._group_store.set(key, json.dumps(quorum.to_json()))
            if seq > 2:
                self._group_store.delete_key(f"quorum/{seq - 2}")
        return quorum

    def _leader_quorum(self, shrink_only: bool, quorum_timeout: float) -> Quorum:
        assert self._client is not None  # leader only (rank 0 builds the client)
        if self._ckpt_metas is None:
            self._ckpt_metas = [
                self._group_store.get(f"ckpt_meta/{r}").decode() for r in range(self._group_world_size)
            ]
        member = QuorumMember(
            replica_id=self.replica_id,
            address=f"{socket.gethostname()}:{os.getpid()}",
            store_address=self._store_address,
            step=self._step,
            world_size=self._group_world_size,
            shrink_only=shrink_only,
            commit_failures=self._commit_failures,
            data={"ckpt": self._ckpt_metas},
        )
        attempts = self._quorum_retries + 1
        for attempt in range(attempts):
            try:
                return self._client.quorum(member, timeout=quorum_timeout)
            except EvictedError:
                raise
            except LighthouseError as e:
                if attempt + 1 >= attempts:
                    raise
                self.log.warning("quorum attempt %d/%d failed: %s", attempt + 1, attempts, e)
        raise AssertionError("unreachable")

    def _reconfigure(self, plan: StepPlan) -> None:
        store_addr = f"{plan.store_address}/ftlaunch/q{plan.quorum_id}/r{self._group_rank}"
        self.log.info(
            "quorum %d: %d groups (this is replica rank %d), %d up to date at step %d; reconfiguring",
            plan.quorum_id,
            plan.replica_world_size,
            plan.replica_rank,
            plan.num_sources,
            plan.max_step,
        )
        # Mark the id first: if configure fails, the next quorum (whose id the failure changes)
        # retries with a fresh prefix instead of reusing a half-built one.
        self._quorum_id = plan.quorum_id
        self._pg.configure(store_addr, plan.replica_rank, plan.replica_world_size)

    # ----------------------------------------------------------------------------- collectives
    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = "avg") -> torch.futures.Future[torch.Tensor]:
        """Fault-tolerant allreduce over the replica groups; averages over up-to-date groups.

        Never raises a communication error: a failure is recorded (``errored()``), the returned
        future completes with the tensor as is, and ``should_commit()`` will refuse the step.
        """
        avg = _is_avg(reduce_op)
        self.wait_quorum()
        plan = self._plan
        if plan is None or self._pg_error() is not None:
            # No usable process group this step (quorum or reconfigure failed): nothing to talk to.
            return completed_future(tensor)
        # Even after a local error we still take part: every group must issue the same sequence of
        # collectives, or peers hang (or gloo aborts on a size mismatch). The commit vote discards the step.
        divisor = plan.num_sources if avg else 1
        post_divide = False
        if plan.heal or self._errored is not None:
            # A healing group's gradients come from stale weights: contribute zeros, receive the average.
            tensor.zero_()
        elif divisor > 1:
            if tensor.is_floating_point() or tensor.is_complex():
                # Average as sum(x_i / n), dividing here as torch's DDP does, not (sum x_i) / n in
                # the completion callback: that runs on a backend thread holding the GIL, and an
                # 8 MB div_ there stalled this thread's next bucket hook by as long. Every group
                # computes the same expression, so committed results stay bit-identical.
                tensor.div_(divisor)
            else:
                post_divide = True  # other dtypes: divided after the sum, as before
        if plan.replica_world_size == 1:
            return completed_future(tensor)  # alone (and so the only source): the average is the tensor
        op = dist.ReduceOp.SUM if avg or reduce_op == "sum" else reduce_op
        try:
            work = self._pg.allreduce([tensor], op)
            fut = work.get_future()
        except Exception as e:  # noqa: BLE001
            self.report_error(e)
            return completed_future(tensor)

        def finish(f: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                f.value()
                if post_divide:
                    tensor.div_(divisor)
            except Exception as e:  # noqa: BLE001 - reported, the step will not commit
                self.report_error(e)
            return tensor

        out = fut.then(finish)
        self._pending.append(out)
        return out

    def report_error(self, e: Exception) -> None:
        """Record a failure of this step: it will not be committed (by any group)."""
        with self._error_lock:
            if self._errored is None:
                self._errored = e
                self.log.warning("step failed, will not commit: %s: %s", type(e).__name__, e)

    def errored(self) -> Exception | None:
        return self._errored

    def _pg_error(self) -> Exception | None:
        errored = getattr(self._pg, "errored", None)
        return errored() if errored is not None else None

    # ----------------------------------------------------------------------------- commit
    def should_commit(self, timeout: timedelta | float | None = None) -> bool:
        """True when every rank of every participating group finished this step cleanly."""
        if self._quorum_future is None:
            raise FtlaunchError("should_commit() before start_quorum()")
        budget = self._commit_timeout if timeout is None else to_seconds(timeout)
        deadline = time.monotonic() + budget
        self.wait_quorum()
        if not _wait_all(self._pending, deadline):
            # A collective of this step hangs (a peer stopped, not died). Give up on the step and
            # abort the process group so the hung op is released; the next quorum rebuilds it.
            self.report_error(
                CommunicationError(f"commit timed out after {budget:g} s waiting for this step's allreduces")
            )
            abort = getattr(self._pg, "abort", None)
            if abort is not None:
                abort()
        self._pending = []
        plan = self._plan
        if plan is not None and plan.heal and self._pending_state is None and self._errored is None:
            self.report_error(CommunicationError("healing was planned but no state was received"))
        ok = self._errored is None and plan is not None and plan.num_sources >= self._min_replica_size
        if plan is not None and plan.replica_world_size > 1:
            pg_error = self._pg_error()
            if pg_error is None:
                ok = self._cross_group_vote(ok, deadline)
            else:
                # The cross-group PG failed before or during this step (allreduce skips a failed
                # group without a word): gradients were not exchanged, so the step cannot commit.
                self.report_error(pg_error)
                ok = False
        if self._group_world_size > 1:
            ok = self._group_vote(ok, deadline)
        if self._sent_checkpoint:
            self._transport.disallow_checkpoint()
            self._sent_checkpoint = False
        if ok:
            assert plan is not None
            if plan.heal:
                # Only now: every rank of every group agreed, so every healing rank loads together.
                # Loading before the vote let one rank jump to the source's step while a peer rank
                # whose heal failed stayed behind, and the group's ranks drifted apart.
                self._apply_pending_state()
            self._step += 1
            self._batches_committed += plan.num_sources
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            self.log.info("step not committed (consecutive failures: %d)", self._commit_failures)
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                raise FtlaunchError(
                    f"{self._commit_failures} consecutive steps failed to commit (max_retries="
                    f"{self._max_retries}); last error: {self._errored!r}"
                )
        return ok

    def _cross_group_vote(self, ok: bool, deadline: float) -> bool:
        # The same tensor for every step's vote: a Baby PG shares a storage with its child the first
        # time it sees it (a shm file, an fd sent over a socket, an unregister when it dies), which
        # a fresh tensor per step paid on every vote. After a failed vote the op may still be in
        # flight somewhere, so that tensor is dropped and the next vote starts a new one.
        flag = self._vote_flag
        if flag is None:
            flag = self._vote_flag = torch.empty(1, dtype=torch.int32)
        flag.fill_(1 if ok else 0)
        try:
            # timedelta(0) means "no timeout" to torch: never pass less than a millisecond.
            left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
            if not self._pg.allreduce([flag], dist.ReduceOp.MIN).wait(left):
                raise CommunicationError("the commit vote timed out (commit timeout)")
        except Exception as e:  # noqa: BLE001
            self._vote_flag = None
            self.report_error(e)
            return False
        return bool(flag.item() == 1)

    def _group_vote(self, ok: bool, deadline: float) -> bool:
        seq = self._quorum_seq
        # Store.set takes bytes too (pybind std::string); torch's stub says str only.
        self._group_store.set(f"commit/{seq}/{self._group_rank}", b"1" if ok else b"0")  # type: ignore[arg-type]
        keys = [f"commit/{seq}/{r}" for r in range(self._group_world_size)]
        try:
            # Bound the vote by the commit deadline. set_timeout is local to this client, so this
            # costs no extra round trip on the per-step path (a store.wait() before the get would).
            self._group_store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            try:
                votes = self._group_store.multi_get(keys)
            finally:
                self._group_store.set_timeout(self._store_timeout)
            if self._group_rank == 0 and seq > 2:
                for r in range(self._group_world_size):
                    self._group_store.delete_key(f"commit/{seq - 2}/{r}")
        except Exception as e:  # noqa: BLE001 - a peer rank died: its agent restarts the group
            self.report_error(CommunicationError(f"commit vote inside the group failed: {e}"))
            return False
        return all(v == b"1" for v in votes)

    def _apply_pending_state(self) -> None:
        state = self._pending_state
        self._pending_state = None
        if state is None:  # guarded before the vote; kept as a clear error rather than a TypeError
            raise FtlaunchError("healing was planned but no state was received")
        missing = [k for k in (MANAGER_STATE_KEY, *self._user_state) if k not in state]
        if missing:
            raise FtlaunchError(f"healed state has no entries {missing}: do both groups register the same state?")
        self.load_state_dict(state[MANAGER_STATE_KEY])
        for key, (load, _) in self._user_state.items():
            load(state[key])
        self.log.info("healed: loaded state at step %d", self._step)

    def _full_state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {key: save() for key, (_, save) in self._user_state.items()}
        sd[MANAGER_STATE_KEY] = self.state_dict()
        return sd

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, int]:
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def num_participants(self) -> int:
        """Up-to-date groups in this step's quorum (the divisor of the average)."""
        self.wait_quorum()
        return self._plan.num_sources if self._plan is not None else 0

    def participating_rank(self) -> int | None:
        """This group's rank among the up-to-date groups, None while it heals."""
        self.wait_quorum()
        return self._plan.source_rank if self._plan is not None else None

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    @property
    def pg(self) -> Any:
        return self._pg

    @property
    def group_rank(self) -> int:
        return self._group_rank

    # ----------------------------------------------------------------------------- teardown
    def shutdown(self, wait: bool = True) -> None:
        """Leave the lighthouse gracefully and release threads, servers and the process group."""
        if self._shutdown:
            return
        self._shutdown = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._client is not None:
            try:
                self._client.leave(self.replica_id)
            except LighthouseError as e:
                self.log.debug("leave failed (lighthouse gone?): %s", e)
            self._client.close()
        self._executor.shutdown(wait=wait, cancel_futures=True)
        self._transport.shutdown(wait=wait)
        release_process_group(self._pg)
        self.log.info("manager shut down")

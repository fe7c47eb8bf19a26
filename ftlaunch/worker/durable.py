"""Durable checkpoints of a replica group: saved from the committed state, in the background, by
one group at a time; resumed from at the start of a job.

Live recovery is the fast path and the disk the safety net: a group that dies heals from a live
peer and never reads the disk; only a job that lost *every* group (a Ctrl-C and re-run, a requeue,
the node with the lighthouse) comes back from the newest complete checkpoint. What is saved is what
a heal carries -- the Manager's step, every registered state (model, optimizer, the sampler's
position, DiLoCo's outer state) -- as one step's state:

* **At the commit boundary** (`worker.committed.CommittedState.at_boundary`, on the training thread
  after the optimizer applied step ``s - 1`` and before step ``s``'s forward pass), when step ``s``
  is due (`durable_plan.save_due`), the group whose turn it is (`durable_plan.is_writer`, from the
  participants of the committed quorum: every group derives the same answer, without a message)
  takes a staged copy (`checkpointing.staging`; the heal snapshot of the same boundary when it took
  one) and hands it to its writer thread. The other groups do nothing at all.
* **In the background**, the writer thread writes the copy in DCP's layout and publishes it
  atomically (`checkpointing.durable.write`), then applies retention. A save due while the previous
  one still runs is skipped and counted, not queued; a failed save (a full disk) is logged in one
  line and counted, and the previous checkpoint stays the newest. In a group of several ranks, each
  rank writes its own shards over a Gloo group of its own (``dcp_group``), and the ranks agree on
  "still busy" over another (``agree_group``), so they all write, or all skip.
* **Resume**, in ``ftlaunch.init``: a group that starts with the job (a restarted group, or a hot
  spare taking a failed group's slot, only when no live peer holds the state:
  `resume_unless_a_peer_holds_it`; otherwise it heals from that peer) loads the newest complete
  checkpoint that verifies, a damaged newer one reported in one line: the entries registered by
  then at once, each one registered later (``ft.sampler``, ``ft.diloco``, ``ft.wrap`` of a sharded
  model) as it registers, until the first step. Every group then asks its first quorum at the saved
  step, so the job's step continues from it; a group that found nothing (or is behind) heals from
  the others as usual.
* **After a sync** (LocalSGD, DiLoCo: `DurableCheckpoints.save_after_syncs`): their commit boundary
  is the next sync point's quorum, a whole interval of inner steps later, when each group holds its
  own local parameters beside the last sync's global ones. Their checkpoint is taken instead right
  after a due sync's update (`DurableCheckpoints.after_sync`), when every group holds the state the
  algorithm shares; the writer saves the job's checkpoint, and *every* group saves what it holds
  on its own (`durable_plan.own_keys`: its model and inner optimizer state) under
  ``DIR/group-<id>/``. The Manager's state saved is the one at the sync's quorum: a resumed job
  first joins (a sync point of its own, which commits), and that commit stands in for the sync's,
  so the job's steps continue as in the run it repeats. At resume each group loads its own state
  of the checkpoint's step; a group with none (the job came back with more groups, or its save
  did not complete) keeps the writer group's, which the job's checkpoint holds, and says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.checkpointing import durable, durable_plan
from ftlaunch.checkpointing.staging import StagedState, stage
from ftlaunch.errors import CommunicationError, ConfigurationError
from ftlaunch.lighthouse.client import LighthouseClient
from ftlaunch.lighthouse.status import LighthouseStatus
from ftlaunch.worker.plan import StepPlan
from ftlaunch.worker.recovery import MANAGER_STATE_KEY, StateRegistry

__all__ = [
    "DurableCheckpoints",
    "DurableConfig",
    "DurableStats",
    "live_peer_steps",
    "reached_step",
    "resume_unless_a_peer_holds_it",
    "reshard_sampler_states",
]


@dataclass(frozen=True)
class DurableConfig:
    """Where and how often (see `ftlaunch.env.CheckpointEnv`)."""

    directory: str
    every: int = 100
    keep_last: int = 3

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigurationError(f"checkpoint_every={self.every} must be >= 0 (0: resume only)")
        if self.keep_last < 0:
            raise ConfigurationError(f"keep_last={self.keep_last} must be >= 0 (0: keep all)")


@dataclass
class DurableStats:
    """What this process's durable checkpointing did (for logs and the leader's progress reports)."""

    #: Checkpoints this group published, saves skipped (the previous one still ran), saves failed.
    saves: int = 0
    skipped: int = 0
    failed: int = 0
    #: The last checkpoint this group published: its step, when, how long the write took.
    last_step: int | None = None
    last_time: float | None = None
    last_seconds: float | None = None
    #: The step this process resumed from (None: it did not read the disk).
    resumed_from: int | None = None
    #: Newer checkpoints refused at resume, with why.
    refused: list[tuple[int, str]] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        """The durable fields of the leader's progress reports (`lighthouse.progress.ProgressReport`)."""
        return {
            "durable_step": self.last_step or 0,
            "durable_time": round(self.last_time or 0.0, 3),
            "durable_seconds": round(self.last_seconds or 0.0, 6),
            "durable_saves": self.saves,
            "durable_skipped": self.skipped,
            "durable_failed": self.failed,
            "resumed_from": self.resumed_from or 0,
        }


_SAMPLER_KEYS = frozenset({"num_shards", "position", "epoch", "dataset_len"})


def _is_sampler_state(value: Any) -> bool:
    """Whether ``value`` is a data sampler's position (`ftlaunch.worker.data.DistributedSampler`)."""
    return isinstance(value, dict) and _SAMPLER_KEYS <= value.keys()


def reshard_sampler_states(saved: Any, here: Any) -> Any:
    """``saved`` with every sampler position (`ftlaunch.worker.data.DistributedSampler`'s state:
    a dict with ``num_shards`` and ``position``) moved onto the sharding of the same entry in
    ``here``: a job that resumes with another number of replica groups continues from the same
    number of samples seen in the epoch (``position * num_shards``), not from the same index in a
    shard of another size. Pure; other entries are returned as they are."""
    if isinstance(saved, dict) and isinstance(here, dict):
        if _is_sampler_state(saved) and _is_sampler_state(here):
            old, new = int(saved["num_shards"]), int(here["num_shards"])
            if old != new and new > 0:
                return {**saved, "num_shards": new, "position": int(saved["position"]) * old // new}
            return saved
        return {k: reshard_sampler_states(v, here.get(k)) for k, v in saved.items()}
    return saved


def live_peer_steps(status: LighthouseStatus, replica_id: str) -> list[int]:
    """The steps of the groups other than ``replica_id`` that the lighthouse sees live (the step
    of each one's last quorum request: the state it holds; 0 for a restarted process that has
    not asked yet). ``replica_id``'s own entry is the process this one replaces."""
    return [g.step for g in status.groups if g.live and g.replica_id != replica_id]


def reached_step(status: LighthouseStatus) -> int | None:
    """The step of the job's last quorum (its furthest participant's), None before the first."""
    quorum = status.quorum
    if quorum is None or not quorum.participants:
        return None
    return max(p.step for p in quorum.participants)


def resume_unless_a_peer_holds_it(
    lighthouse: str,
    token: str | None,
    connect_timeout: float,
    replica_id: str,
    log: logging.Logger | logging.LoggerAdapter,
) -> Callable[[int | None], bool]:
    """``DurableCheckpoints.resume``'s ``decide`` for a group that (re)starts while the job runs:
    load the checkpoint only when no live group holds its step or a newer one
    (`durable_plan.resume_from_disk`), from the lighthouse's status read now -- before this
    process's first quorum request. Groups restarting together see each other as they are: dead,
    back but not asked yet (step 0: the lighthouse forgets the step of a process that is gone), or
    at the checkpoint's step below the step the job's last quorum had reached (loaded from the same
    checkpoint); each loads it. A lighthouse that cannot be read: load (loading is never wrong; a
    peer ahead is still healed from)."""

    def decide(checkpoint_step: int | None) -> bool:
        if checkpoint_step is None:
            return False
        client = LighthouseClient(lighthouse, connect_timeout=connect_timeout, token=token)
        try:
            status = client.snapshot()
            peers, reached = live_peer_steps(status, replica_id), reached_step(status)
        except Exception as e:  # noqa: BLE001 - any failure to read: the disk is the safe answer
            log.warning(
                "durable checkpoints: cannot read the lighthouse's status (%s): resuming from disk", e
            )
            return True
        finally:
            client.close()
        load = durable_plan.resume_from_disk(checkpoint_step, peers, reached)
        log.info(
            "durable checkpoint of step %d, live peers at steps %s, the job's last quorum at step %s: %s",
            checkpoint_step, sorted(peers) or "none", "-" if reached is None else reached,
            "resuming from it" if load else "healing from a peer",
        )  # fmt: skip
        return load

    return decide


class DurableCheckpoints:
    """One process's side of durable checkpointing (see the module docstring)."""

    def __init__(
        self,
        config: DurableConfig,
        registry: StateRegistry,
        last_plan: Callable[[], StepPlan | None],
        log: logging.Logger | logging.LoggerAdapter,
        *,
        group_rank: int = 0,
        group_id: int = 0,
        dcp_group: dist.ProcessGroup | None = None,
        agree_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self._registry = registry
        self._last_plan = last_plan
        self._log = log
        self._group_rank = group_rank
        self._group_id = group_id
        self._dcp_group = dcp_group
        self._agree_group = agree_group
        self.stats = DurableStats()
        self._started = False
        self._resume_path: Path | None = None
        self._data_at_commit: tuple[int, dict[str, Any]] | None = None
        #: The registered entries that are samplers (keyed by how many entries there were).
        self._sampler_keys: tuple[int, frozenset[str]] | None = None
        self._last_due: int | None = None
        #: Saves after syncs (`save_after_syncs`): the entries every group holds alike then.
        self._shared: frozenset[str] | None = None
        #: The Manager's state at the last sync point's quorum: ``(step, state)``.
        self._at_quorum: tuple[int, Any] | None = None
        self._lock = threading.Lock()
        self._running: Future[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftlaunch-durable")

    @property
    def resuming(self) -> bool:
        """Whether entries registered now load from the checkpoint resumed from."""
        return self._resume_path is not None

    # ------------------------------------------------------------------------ the boundary
    def first_boundary(self, step: int) -> int:
        """The process's first commit boundary: entries registered from now on are not loaded
        from the checkpoint resumed from (the training has begun)."""
        if not self._started:
            self._started = True
            self._resume_path = None
            self._registry.on_register = None
        return step

    def at_boundary(self, step: int, staged: StagedState | None = None) -> None:
        """The commit boundary of ``step``: hand a staged copy of the state to the writer thread
        when this group writes ``step``'s checkpoint. ``staged``: a copy this boundary took already
        (the heal snapshot), used instead of a second one. After `save_after_syncs`: only note the
        Manager's state (a sync point's quorum), which `after_sync` saves."""
        if self._shared is not None:
            self._at_quorum = (step, dict(self._registry.entries()[MANAGER_STATE_KEY][1]()))
            return
        every = self.config.every
        if not durable_plan.save_due(step, every, self.stats.resumed_from) or step == self._last_due:
            return
        plan = self._last_plan()
        if plan is None or not durable_plan.is_writer(
            step, every, plan.participant_rank, plan.num_participants
        ):
            return
        self._last_due = step
        if self._busy():
            with self._lock:
                self.stats.skipped += 1
            self._log.warning(
                "durable checkpoint of step %d skipped: the "
                "previous save is still being written (%d skipped)",
                step, self.stats.skipped,
            )  # fmt: skip
            return
        if staged is None or staged.step != step:
            staged = self._stage_now(step, "durable checkpoint")
            if staged is None:
                return
        state = self._with_data_at_commit(staged, step)
        self._data_at_commit = None
        self._running = self._executor.submit(self._write, staged, state)

    def committed(self, step: int) -> None:
        """The optimizer has just applied the update that made ``step`` (``ft.wrap``'s optimizer
        calls it): record the data positions now -- every sampler's when ``step`` is due, those
        known to be samplers otherwise (any step may be the last one, saved by `final`).

        Why: a training loop draws the next batch before it starts the next step (the boundary),
        so at the boundary a sampler's position already counts a batch no step has used; a job
        resumed from it would skip that batch. The position at the commit is the one to resume
        from. Only sampler states are taken here (other state, an LR scheduler's, legitimately
        moves between the commit and the boundary)."""
        if self.config.every <= 0:
            return
        entries = self._registry.entries()
        if not durable_plan.save_due(step, self.config.every, self.stats.resumed_from):
            # Any committed step may be the last one (`final`): the samplers' positions, known by
            # key once looked up (one cheap state dict each, not the model's).
            if self._sampler_keys is None or self._sampler_keys[0] != len(entries):
                self._sampler_keys = (len(entries), self._samplers(entries))
            keys = self._sampler_keys[1]
            self._data_at_commit = (step, {k: dict(entries[k][1]()) for k in keys if k in entries})
            return
        data = {}
        for key, (_, save) in entries.items():
            if key == MANAGER_STATE_KEY:
                continue
            value = save()
            if _is_sampler_state(value):
                data[key] = dict(value)
        self._data_at_commit = (step, data)

    @staticmethod
    def _samplers(entries: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]]) -> frozenset[str]:
        return frozenset(
            key
            for key, (_, save) in entries.items()
            if key != MANAGER_STATE_KEY and _is_sampler_state(save())
        )

    def final(self, step: int) -> None:
        """A clean end of the training at ``step``: write its checkpoint now, synchronously, unless
        one of it exists (or the job resumed from it), so the finished model is on disk even when
        the last step is not a multiple of ``checkpoint_every`` -- the checkpoint of a due step is
        taken at the next step's boundary, which the last step never reaches.

        Why the same writer rule: every group ends at the same step with the same last quorum, so
        one group writes it, chosen as for a due save, and the others exit at once. A save still
        running is waited for first (one writer thread). A failure is logged and counted, never
        raised: the training itself has finished. After syncs (`save_after_syncs`), every group
        writes its own state of ``step`` too, as at a due save."""
        every = self.config.every
        if every <= 0 or step <= 0 or step == self.stats.resumed_from or step == self._last_due:
            return
        if self._shared is not None:
            running = self._running
            if running is not None:
                running.result()
            self._last_due = step
            taken = self._take_after_sync(step)
            if taken is not None:
                what = "checkpoint" if taken[2] else "checkpoint of this group's own state"
                self._log.info("writing the final durable %s of step %d", what, step)
                self._write_after_sync(*taken)
            return
        plan = self._last_plan()
        if plan is None or not durable_plan.is_writer(
            step, every, plan.participant_rank, plan.num_participants
        ):
            return
        running = self._running
        if running is not None:
            running.result()
        if (Path(self.config.directory) / durable_plan.dir_name(step)).is_dir():
            return
        self._last_due = step
        staged = self._stage_now(step, "final durable checkpoint")
        if staged is None:
            return
        state = self._with_data_at_commit(staged, step)
        self._log.info("writing the final durable checkpoint of step %d", step)
        self._write(staged, state)

    def _stage_now(self, step: int, what: str) -> StagedState | None:
        """A staged copy of the registry's state, taken on the training thread (which never waits
        for the gate); None, with a warning naming ``what``, when the state is closed for reading."""
        try:
            with self._registry.gate.reading(0.0):
                return stage(self._registry.snapshot(), step)
        except CommunicationError:
            self._log.warning("%s of step %d skipped: the state was closed for reading", what, step)
            return None

    def _with_data_at_commit(self, staged: StagedState, step: int) -> Any:
        """``staged``'s state with the sampler positions recorded when ``step`` committed: a new
        dict, since a heal may be serving ``staged`` as it is."""
        at_commit = self._data_at_commit
        if at_commit is not None and at_commit[0] == step:
            return {**staged.state, **at_commit[1]}
        return staged.state

    # ------------------------------------------------------------------------ after a sync
    def save_after_syncs(self, shared: Collection[str]) -> None:
        """Take this job's checkpoints after its syncs (`after_sync`), not at the commit boundary:
        LocalSGD and DiLoCo call it when they start (see the module docstring). ``shared``: the
        registered entries every group holds bit-identical after a sync (DiLoCo's); the others,
        data positions aside, are each group's own and every group saves them. A job resuming
        loads this group's own state now (its entries are registered by then)."""
        self._shared = frozenset(shared) | {MANAGER_STATE_KEY}
        if self._resume_path is not None and self.stats.resumed_from is not None:
            self._load_own(self.stats.resumed_from)

    def after_sync(self, step: int) -> None:
        """A sync committed ``step`` and the algorithm applied its update: when ``step`` is due,
        the writer group hands the job's checkpoint to its writer thread, and every group its own
        state (`durable_plan.own_keys`) under ``DIR/group-<id>/``."""
        if self._shared is None:
            return
        every = self.config.every
        if not durable_plan.save_due(step, every, self.stats.resumed_from) or step == self._last_due:
            return
        self._last_due = step
        if self._busy():
            with self._lock:
                self.stats.skipped += 1
            self._log.warning(
                "durable checkpoint of step %d skipped: the previous save is still being written "
                "(%d skipped)", step, self.stats.skipped,
            )  # fmt: skip
            return
        taken = self._take_after_sync(step)
        if taken is not None:
            self._running = self._executor.submit(self._write_after_sync, *taken)

    def _take_after_sync(self, step: int) -> tuple[StagedState, list[str], bool] | None:
        """A staged copy of the state to save after the sync that committed ``step`` (the job's
        whole state when this group writes the job's checkpoint, else its own entries), the own
        entries' keys, and whether this group writes the job's checkpoint."""
        plan = self._last_plan()
        writer = plan is not None and durable_plan.is_writer(
            step, self.config.every, plan.participant_rank, plan.num_participants
        )
        at_quorum = self._at_quorum
        if at_quorum is None or at_quorum[0] != step - 1:
            self._log.warning("durable checkpoint of step %d skipped: no state of its sync point", step)
            return None
        try:
            with self._registry.gate.reading(0.0):  # the training thread itself: never wait
                state = self._registry.snapshot()
                own = durable_plan.own_keys(
                    state, self._shared or (), [k for k, v in state.items() if _is_sampler_state(v)]
                )
                state[MANAGER_STATE_KEY] = at_quorum[1]  # the join after a resume commits ``step``
                staged = stage(state if writer else {k: state[k] for k in own}, step)
        except CommunicationError:
            self._log.warning("durable checkpoint of step %d skipped: the state was closed for reading", step)
            return None
        return staged, own, writer

    def _write_after_sync(self, staged: StagedState, own: list[str], writer: bool) -> None:
        staged.wait()
        mine = Path(self.config.directory) / durable_plan.group_dir_name(self._group_id)
        try:  # first: a complete job checkpoint then has its writer's own state
            durable.write(
                {k: staged.state[k] for k in own},
                mine,
                staged.step,
                process_group=self._dcp_group,
                coordinator=self._group_rank == 0,
            )
        except Exception as e:  # noqa: BLE001 - a failed save must never reach the training loop
            with self._lock:
                self.stats.failed += 1
            self._log.warning(
                "durable checkpoint of step %d: this group's own state failed (%s); the job's "
                "checkpoint resumes this group with the writer group's", staged.step, e,
            )  # fmt: skip
        else:
            if self._group_rank == 0:
                durable.retain(mine, self.config.keep_last, staged.step)
        if writer:
            self._write(staged, staged.state)

    def _load_own(self, step: int) -> None:
        root = Path(self.config.directory) / durable_plan.group_dir_name(self._group_id)
        path = root / durable_plan.dir_name(step)
        entries = self._registry.entries()
        keys = durable_plan.own_keys(
            entries, self._shared or (), [k for k, (_, save) in entries.items() if _is_sampler_state(save())]
        )
        why = durable.verify(path) if path.is_dir() else "none was saved"
        if why is not None:
            self._log.warning(
                "durable checkpoint of step %d: no state of this group's own (%s): its %s start as the "
                "writer group saved them", step, why, ", ".join(keys) or "entries",
            )  # fmt: skip
            return
        self._load({k: entries[k] for k in keys}, path)
        self._log.info("durable checkpoint of step %d: loaded this group's own %s", step, ", ".join(keys))

    def _busy(self) -> bool:
        """Whether the previous save still runs -- on any rank of the group, so all ranks write
        (their shards, in one DCP save) or none does."""
        running = self._running
        busy = running is not None and not running.done()
        if self._agree_group is None:
            return busy
        flag = torch.tensor([1 if busy else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._agree_group)
        return bool(flag.item())

    def _write(self, staged: StagedState, state: Any) -> None:
        staged.wait()
        step = staged.step
        try:
            published = durable.write(
                state,
                self.config.directory,
                step,
                process_group=self._dcp_group,
                coordinator=self._group_rank == 0,
            )
        except Exception as e:  # noqa: BLE001 - a failed save must never reach the training loop
            with self._lock:
                self.stats.failed += 1
            self._log.warning(
                "durable checkpoint of step %d failed, the previous one stays the newest: %s", step, e
            )
            return
        if published is None:  # a rank other than the coordinator: its shards are written
            return
        removed = durable.retain(self.config.directory, self.config.keep_last, step)
        with self._lock:
            self.stats.saves += 1
            self.stats.last_step = step
            self.stats.last_time = time.time()
            self.stats.last_seconds = published.seconds
        self._log.info(
            "durable checkpoint of step %d: %s, %.1f MB in %.2f s%s",
            step, published.path, published.nbytes / 1e6, published.seconds,
            f" (removed {', '.join(removed)})" if removed else "",
        )  # fmt: skip

    # ------------------------------------------------------------------------ resume
    def resume(self, decide: Callable[[int | None], bool] | None = None) -> int | None:
        """Resume from the newest complete, intact checkpoint (a damaged newer one is reported in
        one line and passed over): load it into every entry registered so far -- the Manager's
        step among them -- and into each entry registered later, as it registers, until the first
        commit boundary (``ft.sampler``, ``ft.diloco`` and ``ft.wrap`` of a sharded model register
        after ``ftlaunch.init``). Returns the step resumed from, None when there is none.

        ``decide``: for a group that (re)starts while the job runs, whether to load the newest
        complete checkpoint, of the step it is given (None: none), at all
        (`durable_plan.resume_from_disk`); the group's rank 0 decides, and every rank follows its
        answer (``agree_group``)."""
        root = Path(self.config.directory)
        try:
            names = [p.name for p in root.iterdir()] if root.is_dir() else []
        except OSError as e:
            self._log.warning("durable checkpoints: cannot list %s (%s): starting from scratch", root, e)
            names = None
        if decide is not None:
            # Decided on the listing alone: a group that heals live reads no checkpoint's files
            # (an older intact one is chosen below when the newest is damaged: still no newer
            # than what a peer ahead would give).
            newest = max(durable_plan.list_dir(names or ()).complete, default=None)
            load = self._agree(decide(newest) if self._group_rank == 0 else False)
            if not load:
                if newest is not None:
                    self._log.info(
                        "durable checkpoint of step %d not read: a live group holds that state or a "
                        "newer one (healing from it)", newest,
                    )  # fmt: skip
                return None
        if names is None:
            return None
        return self._load_choice(root, self._choose(root, names))

    def _agree(self, load: bool) -> bool:
        """Rank 0's ``load``, on every rank of the group."""
        if self._agree_group is None:
            return load
        flag = torch.tensor([1 if load else 0], dtype=torch.int32)
        dist.broadcast(flag, src=dist.get_global_rank(self._agree_group, 0), group=self._agree_group)
        return bool(flag.item())

    def _choose(self, root: Path, names: list[str]) -> durable_plan.ResumeChoice:
        listing = durable_plan.list_dir(names)
        choice = durable_plan.choose_resume(
            listing.complete, lambda s: durable.verify(root / durable_plan.dir_name(s))
        )
        for step, why in choice.refused:
            self._log.warning(
                "durable checkpoint %s is not usable (%s): resuming from an older one",
                root / durable_plan.dir_name(step), why,
            )  # fmt: skip
        self.stats.refused = list(choice.refused)
        if choice.step is None and listing.complete:
            self._log.warning("no usable durable checkpoint in %s: starting from scratch", root)
        return choice

    def _load_choice(self, root: Path, choice: durable_plan.ResumeChoice) -> int | None:
        if choice.step is None:
            return None
        t0 = time.monotonic()
        self._resume_path = root / durable_plan.dir_name(choice.step)
        entries = self._registry.entries()
        self._load(entries)
        step = choice.step  # the Manager's step, or (saved after a sync) the one after it
        self.stats.resumed_from = step
        self._registry.on_register = self._on_register
        self._log.info(
            "resumed from durable checkpoint %s (step %d) in %.2f s",
            self._resume_path, step, time.monotonic() - t0,
        )  # fmt: skip
        return step

    def _on_register(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        if self._resume_path is not None:
            self._load({key: (load, save)})

    def _load(
        self, entries: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]], path: Path | None = None
    ) -> None:
        path = path or self._resume_path
        assert path is not None  # noqa: S101 - set by resume
        here = {key: save() for key, (_, save) in entries.items()}
        saved = durable.read(path, here, process_group=self._dcp_group)
        for key, (load, _) in entries.items():
            if key not in saved:
                self._log.warning(
                    "durable checkpoint %s has no state %r: it starts as the script made it", path, key
                )
                continue
            try:
                load(reshard_sampler_states(saved[key], here[key]))
            except Exception as e:
                raise ConfigurationError(
                    f"durable checkpoint {path}: its state {key!r} does not load here ({type(e).__name__}: "
                    f"{e}); was it saved by this training script? (move it away to start from scratch)"
                ) from e

    # ------------------------------------------------------------------------ teardown
    def close(self, wait: bool = True) -> None:
        """Let a save in progress finish (``wait``), then stop the writer thread."""
        self._executor.shutdown(wait=wait)

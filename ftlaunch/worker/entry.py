"""The worker side of an ftlaunch job: ``ftlaunch.init()`` turns what the launcher published into a
ready fault-tolerant setup, so a training script needs two lines instead of twenty::

    ft = ftlaunch.init(model, optimizer)            # Manager, process groups, state, timeouts
    model, optimizer = ft.wrap(model, optimizer)    # DDP across groups + commit-gated optimizer

and, to shard the model inside each replica group (fault-tolerant HSDP), four::

    ft = ftlaunch.init()
    model = ft.shard(model)                         # FSDP2 over the group's workers
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = ft.wrap(model, optimizer)    # averaged across groups, commit-gated, healable

All three launch paths (``ftlaunch --replicas N``, ``torchrun --rdzv-backend ftlaunch`` and
``torchx run ftlaunch:hsdp``) publish the same environment: ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``FTLAUNCH_LIGHTHOUSE`` (+ token) and torchelastic's ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` (the replica group's own store). ``init`` reads only that, so it
behaves the same under each, and names the three commands when it finds none of it.

This module builds; what it returns, `FaultTolerance`, is in ``fault_tolerance.py``; a job with hot
spares (``FTLAUNCH_SPARES``) waits for its replica-group slot in ``spare.py`` between the process
groups (built first, so a spare is hot) and the Manager (built for the slot it got).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftlaunch import env, phases
from ftlaunch.bootstrap import prestart
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError, install_brief_errors
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import Timeouts, to_seconds
from ftlaunch.worker import defaults, spare
from ftlaunch.worker.durable import DurableCheckpoints, DurableConfig, resume_unless_a_peer_holds_it
from ftlaunch.worker.fault_tolerance import FaultTolerance, InitState, Registered, model_state_fns
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.manager import Manager, ManagerParts, ManagerSettings, release_process_group

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "FaultTolerance",
    "default_backend",
    "init",
    "make_process_group",
    "model_device",
]

#: Cross-group process-group backends ``init`` can build (argument ``backend=`` or ``FTLAUNCH_BACKEND``).
BACKENDS = env.BACKENDS
#: Live-recovery transports (argument ``transport=`` or ``FTLAUNCH_TRANSPORT``).
TRANSPORTS = env.TRANSPORTS


def _choice(value: str | None, allowed: tuple[str, ...], what: str) -> str | None:
    """An argument of ``init`` that names one of ``allowed`` (case and ``_``/``-`` as the variable's)."""
    if value is None:
        return None
    norm = value.strip().lower().replace("_", "-")
    if norm not in allowed:
        raise ConfigurationError(f"{what}={value!r} is not one of {', '.join(allowed)}")
    return norm


def default_backend(device: torch.device) -> str:
    """Baby NCCL for a model on CUDA, Baby Gloo otherwise.

    Baby (subprocess) groups, because a hung collective in a subprocess can be abandoned and the
    group rebuilt at the next quorum without taking the training process down with it.
    """
    return "baby-nccl" if device.type == "cuda" else "baby-gloo"


def model_device(model: nn.Module | None) -> torch.device:
    if model is None:
        return torch.device("cpu")
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def make_process_group(backend: str, timeout: timedelta) -> ProcessGroup:
    """The reconfigurable cross-group process group for ``backend`` (one of ``BACKENDS``)."""
    from ftlaunch import process_group as pgs

    classes = {
        "baby-gloo": pgs.ProcessGroupBabyGloo,
        "baby-nccl": pgs.ProcessGroupBabyNCCL,
        "gloo": pgs.ProcessGroupGloo,
        "nccl": pgs.ProcessGroupNCCL,
    }
    if backend.endswith("nccl") and not torch.cuda.is_available():
        raise ConfigurationError(f"backend {backend!r} needs CUDA, and torch.cuda.is_available() is False")
    return classes[backend](timeout=timeout)


_open_lock = threading.Lock()
#: `FaultTolerance` objects of this process, shut down at exit if the script did not (weak: a
#: discarded one is not kept alive by this list).
_open: list[weakref.ref[FaultTolerance]] = []


def _track(ft: FaultTolerance) -> None:
    with _open_lock:
        if not _open:
            # Registered after torch's own exit handlers, so it runs before them (atexit is LIFO).
            atexit.register(_shutdown_at_exit)
        _open[:] = [r for r in _open if r() is not None]
        _open.append(weakref.ref(ft))


def _shutdown_at_exit() -> None:
    """The interpreter is exiting: leave the quorum for every `FaultTolerance` still open.

    Without this, a script that ends without ``ft.shutdown()`` (README's two-line form) just closes
    its lighthouse connection, which the lighthouse must read as a crash ("connection closed without
    leave"). After an *uncaught exception* nothing is sent on purpose: then the closed connection is
    the truth -- the group failed -- and the lighthouse drops it at once.
    """
    if getattr(sys, "last_value", None) is not None:  # set by the interpreter for an uncaught exception
        return
    with _open_lock:
        pending = [ft for ft in (r() for r in _open) if ft is not None]
        _open.clear()
    for ft in pending:
        try:
            ft.shutdown()
        except Exception as e:  # noqa: BLE001 - at exit there is nobody left to raise to
            logging.getLogger(__name__).debug("shutdown at exit failed: %s", e)


def init(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    transport: str | None = None,
    intra_group: bool | None = None,
    min_replica_size: int = 1,
    device: torch.device | str | None = None,
    replica_group_id: int | None = None,
    num_replica_groups: int | None = None,
    lighthouse: str | None = None,
    load_state_dict: Callable[[Any], None] | None = None,
    state_dict: Callable[[], Any] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_last: int | None = None,
    **manager_kwargs: Any,
) -> FaultTolerance:
    """Connect this worker to its ftlaunch job and return a ready :class:`FaultTolerance`.

    - ``model``/``optimizer``: their ``state_dict``/``load_state_dict`` are what a restarted group
      receives from a healthy peer (or pass ``state_dict``/``load_state_dict`` yourself; add more with
      ``ft.manager.register_state_dict_fn``). The model's device picks the default backend.
    - ``timeout``: the one timeout knob (seconds; else ``FTLAUNCH_TIMEOUT``; default 60). The quorum,
      collective, commit, heal and connect timeouts derive from it; explicit overrides go in
      ``quorum_timeout=``, ``connect_timeout=``, ``heal_timeout=``, ``commit_timeout=`` or the
      ``FTLAUNCH_*_TIMEOUT`` variables and are validated together (see docs/timeouts.md).
    - ``backend``: ``baby-nccl`` on CUDA, ``baby-gloo`` on CPU by default (``FTLAUNCH_BACKEND``).
    - ``transport``: ``pg`` (over the cross-group process group, default) or ``http``
      (``FTLAUNCH_TRANSPORT``).
    - ``intra_group``: build (or reuse) the replica group's own process group; default: when the
      group has more than one worker.
    - ``checkpoint_dir``/``checkpoint_every``/``keep_last``: durable checkpoints (else
      ``FTLAUNCH_CHECKPOINT_DIR``/``_EVERY``/``_KEEP``; ``ftlaunch --checkpoint-dir``): every
      ``checkpoint_every`` committed steps (default 100) one replica group writes the committed state
      in the background, in torch.distributed.checkpoint's layout, keeping the newest ``keep_last``
      (default 3); a job started on a directory with a checkpoint resumes from the newest complete
      one (docs/checkpointing.md).
    - Other keyword arguments are the Manager's settings (torchft's names): ``max_retries``,
      ``init_sync``, ``use_async_quorum``, ``quorum_retries``, ``world_size_mode``,
      ``heartbeat_interval`` (see :class:`ftlaunch.Manager`).
    """
    phases.mark("init", process_start=phases.process_start_time())
    install_brief_errors(env.error_file(), env.rendezvous_error_file())  # a bad value: one line
    # The launcher->worker contract, read once: every value below is passed on explicitly.
    job = env.JobEnv.from_environ(
        replica_group_id=replica_group_id,
        num_replica_groups=num_replica_groups,
        lighthouse=lighthouse,
        token=manager_kwargs.pop("token", None),
    )
    group = env.GroupEnv.from_environ()
    tuned = env.WorkerEnv.from_environ()  # what the user tuned: handed to the Manager below
    sync_env = env.SyncEnv.from_environ()  # defaults of ft.local_sgd() / ft.diloco()
    durable_config = _durable_config(checkpoint_dir, checkpoint_every, keep_last)

    # Timeouts: one knob, explicit overrides validated together before anything connects.
    overrides = {
        name: manager_kwargs.pop(f"{name}_timeout")
        for name in ("quorum", "connect", "heal", "commit", "collective")
        if f"{name}_timeout" in manager_kwargs
    }
    timeouts = Timeouts.derive(timeout, **overrides)

    dev = torch.device(device) if device is not None else model_device(model)
    chosen_backend = _choice(backend, BACKENDS, "backend") or tuned.backend or default_backend(dev)
    chosen_transport = _choice(transport, TRANSPORTS, "transport") or tuned.transport or "pg"

    if (load_state_dict is None) != (state_dict is None):
        raise ValueError("pass both load_state_dict and state_dict, or neither")
    registered = InitState(Registered.USER) if load_state_dict else InitState()
    if load_state_dict is None and (model is not None or optimizer is not None):
        load_state_dict, state_dict = model_state_fns(model, optimizer)
        registered = InitState(Registered.MODEL, model, optimizer)

    want_intra = group.world_size > 1 if intra_group is None else intra_group
    intra, owns_intra = _intra_group(want_intra, group, dev, timeouts)

    if chosen_backend != "baby-gloo":
        prestart.release("gloo")  # a child the launcher started early, for the default backend
    pg = make_process_group(chosen_backend, timeouts.as_timedelta("collective"))
    try:
        ckpt = _make_transport(
            chosen_transport, pg, dev, timeouts, job.local_addr or defaults.local_addr(job.lighthouse)
        )
        slot: spare.Slot | None = None
        if job.spares:  # hot spares: which replica group this is, the lighthouse decides
            slot = spare.claim_slot(job, group, timeouts.connect, tuned.lighthouse_outage)
            job = spare.job_for_slot(job, slot)

        manager = Manager.from_parts(
            _manager_parts(
                pg, job, group, timeouts, tuned, ckpt, min_replica_size, load_state_dict, state_dict,
                replica_id=slot.replica_id if slot is not None else job.replica_id, knobs=manager_kwargs,
            )
        )  # fmt: skip
    except BaseException as e:
        release_process_group(pg)
        if owns_intra and dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(e, spare.JobFinished):  # a spare that was never needed: leave quietly
            logging.getLogger(__name__).info("%s", e)
            raise SystemExit(0) from None
        raise
    durable_ckpt = None
    if durable_config is not None:
        # A group that starts with the job resumes from disk; a restarted group, or a hot spare
        # taking a failed group's slot, only when no live peer holds the state (the safety net).
        starts_with_job = group.incarnation == 0 and (slot is None or slot.replaced is None)
        decide = None
        if not starts_with_job:
            decide = resume_unless_a_peer_holds_it(
                job.lighthouse, job.token, timeouts.connect, manager.replica_id, manager.log
            )
        durable_ckpt = _durable(durable_config, manager, group, intra, decide, job.replica_group_id)
    manager.log.info(
        "ftlaunch.init: replica group %d of %d, rank %d of %d, backend %s, transport %s, device %s",
        job.replica_group_id, job.num_replica_groups, group.rank, group.world_size, chosen_backend,
        chosen_transport, dev,
    )  # fmt: skip
    ft = FaultTolerance(
        manager=manager,
        pg=pg,
        replica_group_id=job.replica_group_id,
        num_replica_groups=job.num_replica_groups,
        rank=group.rank,
        world_size=group.world_size,
        device=dev,
        backend=chosen_backend,
        transport=chosen_transport,
        timeouts=timeouts,
        intra_group=intra,
        _owns_intra_group=owns_intra,
        checkpoint_transport=ckpt,
        registered=registered,
        sync_env=sync_env,
        durable=durable_ckpt,
    )
    _track(ft)
    return ft


def _durable_config(directory: str | None, every: int | None, keep_last: int | None) -> DurableConfig | None:
    """Durable checkpoints from ``init``'s arguments, else the environment (None: no directory)."""
    from_env = env.CheckpointEnv.from_environ()
    chosen = directory if directory is not None else from_env.directory
    if not chosen:
        if every is not None or keep_last is not None:
            raise ConfigurationError(
                "checkpoint_every/keep_last need checkpoint_dir (or FTLAUNCH_CHECKPOINT_DIR)"
            )
        return None
    return DurableConfig(
        str(chosen),
        from_env.every if every is None else every,
        from_env.keep_last if keep_last is None else keep_last,
    )


def _durable(
    config: DurableConfig,
    manager: Manager,
    group: env.GroupEnv,
    intra: dist.ProcessGroup | None,
    decide: Callable[[int | None], bool] | None,
    replica_group_id: int,
) -> DurableCheckpoints:
    """Attach durable checkpoints to ``manager``'s commit boundary (`worker.committed`).

    A group of several ranks writes (and reads) its shards over Gloo groups of its own: one for
    DCP on the writer thread, one for the ranks' agreement on the training thread (a process group
    is used by one thread at a time). Every rank builds them here, in the same order.

    The Manager is reached through its committed-state holder, its registry and its last plan:
    the hook lives beside the Manager, not inside its step protocol."""
    dcp_group = agree_group = None
    if group.world_size > 1:
        if intra is None:
            raise ConfigurationError(
                "durable checkpoints of a replica group of several workers need its process group: "
                "leave intra_group on"
            )
        dcp_group = dist.new_group(backend="gloo")
        agree_group = dist.new_group(backend="gloo")
    hook = DurableCheckpoints(
        config,
        manager._state,  # noqa: SLF001 - the registry a heal carries: a checkpoint saves the same
        lambda: manager._round.last_plan,  # noqa: SLF001 - the committed quorum's plan: who writes
        manager.log,
        group_rank=group.rank,
        group_id=replica_group_id,
        dcp_group=dcp_group,
        agree_group=agree_group,
    )
    manager._committed.durable = hook  # noqa: SLF001 - called at every commit boundary
    if manager._progress is not None:  # noqa: SLF001 - the leader's progress reports carry the stats
        manager._progress.durable = hook.stats.report
    hook.resume(decide)  # decide None: the group starts with the job and always resumes
    return hook


#: The Manager's settings ``init`` passes on from its keyword arguments (torchft's names).
MANAGER_KNOBS = ("use_async_quorum", "init_sync", "max_retries", "quorum_retries", "world_size_mode")


def _manager_parts(
    pg: ProcessGroup,
    job: env.JobEnv,
    group: env.GroupEnv,
    timeouts: Timeouts,
    tuned: env.WorkerEnv,
    transport: CheckpointTransport[Any],
    min_replica_size: int,
    load_state_dict: Callable[[Any], None] | None,
    state_dict: Callable[[], Any] | None,
    *,
    replica_id: str,
    knobs: dict[str, Any],
) -> ManagerParts:
    """What the Manager is made of, from what ``init`` read: its settings (with the knobs the script
    passed), the leader's lighthouse client and the replica group's store."""
    unknown = sorted(set(knobs) - {*MANAGER_KNOBS, "heartbeat_interval"})
    if unknown:
        raise TypeError(
            f"ftlaunch.init() got unexpected keyword arguments {unknown}; the Manager's are "
            f"{', '.join((*MANAGER_KNOBS, 'heartbeat_interval'))} and the *_timeout overrides"
        )
    interval = to_seconds(knobs.pop("heartbeat_interval", 0.1), "heartbeat_interval")
    settings = ManagerSettings(
        replica_id=replica_id, group_rank=group.rank, group_world_size=group.world_size, timeouts=timeouts,
        min_replica_size=min_replica_size, heartbeat_interval=interval, worker_env=tuned, **knobs,
    )  # fmt: skip
    # Only the leader talks to the lighthouse; it waits out a lighthouse outage (lighthouse/reconnect.py).
    client = None
    if group.rank == 0:
        client = defaults.lighthouse_client(
            job.lighthouse, job.token, timeouts.connect, tuned.lighthouse_outage
        )
    try:
        store = GroupStore.open(
            None, group.master_addr, group.master_port, replica_id=replica_id, attempt=group.incarnation,
            rank=group.rank, world_size=group.world_size,
            hostname=job.local_addr or defaults.local_addr(job.lighthouse), timeouts=timeouts,
            leader_outage=tuned.lighthouse_outage,
        )  # fmt: skip
    except BaseException:
        if client is not None:
            client.close()
        raise
    return ManagerParts(settings, pg, store, transport, client, load_state_dict, state_dict)


def _intra_group(
    want: bool, group: env.GroupEnv, device: torch.device, timeouts: Timeouts
) -> tuple[dist.ProcessGroup | None, bool]:
    """The replica group's own process group: torch's default group, initialised here if needed
    from torchelastic's environment (``MASTER_ADDR``/``MASTER_PORT`` of the group's store)."""
    if not want:
        return None, False
    if dist.is_initialized():
        return dist.group.WORLD, False
    if group.master_addr is None or group.master_port is None:
        raise ConfigurationError(
            f"an intra-group process group needs {env.MASTER_ADDR}/{env.MASTER_PORT} (set by "
            "torchelastic inside a replica group). " + env.HOW_TO_LAUNCH
        )
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timeouts.as_timedelta("collective")
    )
    return dist.group.WORLD, True


def _make_transport(
    name: str, pg: ProcessGroup, device: torch.device, timeouts: Timeouts, local_addr: str | None
) -> CheckpointTransport[Any]:
    from ftlaunch.checkpointing import HTTPTransport, PGTransport

    if name == "pg":
        return PGTransport(pg, timeout=timeouts.as_timedelta("heal"), device=device)
    # Served on the address the other groups' hosts reach (loopback when the job is on one host).
    return HTTPTransport(timeout=timeouts.as_timedelta("heal"), bind=local_addr or "127.0.0.1")

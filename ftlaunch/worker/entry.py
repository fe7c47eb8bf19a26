"""The worker side of an ftlaunch job: ``ftlaunch.init()`` turns what the launcher published into a
ready fault-tolerant setup, so a training script needs two lines instead of twenty::

    ft = ftlaunch.init(model, optimizer)            # Manager, process groups, state, timeouts
    model, optimizer = ft.wrap(model, optimizer)    # DDP across groups + commit-gated optimizer

All three launch paths (``ftlaunch --replicas N``, ``torchrun --rdzv-backend ftlaunch`` and
``torchx run ftlaunch:hsdp``) publish the same environment: ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``FTLAUNCH_LIGHTHOUSE`` (+ token) and torchelastic's ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` (the replica group's own store). ``init`` reads only that, so it
behaves the same under each, and names the three commands when it finds none of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ftlaunch import env
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import Timeouts
from ftlaunch.worker.data import DistributedSampler
from ftlaunch.worker.manager import Manager, release_process_group

if TYPE_CHECKING:
    from ftlaunch.worker.local_sgd import DiLoCo, LocalSGD

#: Cross-group process-group backends ``init`` can build (argument ``backend=`` or ``FTLAUNCH_BACKEND``).
BACKENDS = ("baby-gloo", "baby-nccl", "gloo", "nccl")
#: Live-recovery transports (argument ``transport=`` or ``FTLAUNCH_TRANSPORT``).
TRANSPORTS = ("pg", "http")


def _choice(value: str | None, env_name: str, allowed: tuple[str, ...], what: str) -> str | None:
    raw = value if value is not None else (os.environ.get(env_name) or None)
    if raw is None:
        return None
    norm = raw.strip().lower().replace("_", "-")
    if norm not in allowed:
        src = f"{what}={raw!r}" if value is not None else f"{env_name}={raw!r}"
        raise ConfigurationError(f"{src} is not one of {', '.join(allowed)}")
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


@dataclass
class FaultTolerance:
    """What ``ftlaunch.init()`` returns: everything a training loop needs, already connected."""

    manager: Manager
    #: The cross-group (replica dimension) process group; reconfigured in place by the Manager.
    pg: ProcessGroup
    replica_group_id: int
    num_replica_groups: int
    #: This worker's rank and the worker count inside its replica group.
    rank: int
    world_size: int
    device: torch.device
    backend: str
    transport: str
    timeouts: Timeouts
    #: The replica group's own process group (its workers only), when asked for or needed.
    intra_group: dist.ProcessGroup | None = None
    _owns_intra_group: bool = field(default=False, repr=False)
    _closed: bool = field(default=False, repr=False)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """DDP across replica groups (averaged inside the group first) and a commit-gated optimizer."""
        from ftlaunch.worker.data_parallel import DistributedDataParallel
        from ftlaunch.worker.optim import Optimizer

        return (
            DistributedDataParallel(self.manager, model, intra_group=self.intra_group),
            Optimizer(self.manager, optimizer),
        )

    def sampler(self, dataset: Any, key: str = "sampler", **kwargs: Any) -> DistributedSampler:
        """A sampler sharding ``dataset`` over replica groups x ranks whose position travels with
        live recovery, so a healed group resumes exactly where its peers are."""
        s = DistributedSampler(
            dataset,
            replica_group_id=self.replica_group_id,
            num_replica_groups=self.num_replica_groups,
            rank=self.rank,
            num_replicas=self.world_size,
            **kwargs,
        )
        s.register(self.manager, key)
        return s

    # ---- periodic synchronisation: LocalSGD, DiLoCo, Streaming DiLoCo (docs/diloco.md) ----------
    def local_sgd(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int | None = None, **kwargs: Any
    ) -> LocalSGD:
        """Average ``model``'s parameters over the replica groups every ``sync_every`` steps of
        ``optimizer`` (default ``FTLAUNCH_SYNC_EVERY``, else 100).

        Returns the `ftlaunch.LocalSGD`, already entered: it has joined the job (this group now has
        its peers' parameters) and ``optimizer.step()`` drives it. Keyword arguments go to it.
        """
        from ftlaunch.worker.local_sgd import LocalSGD

        self._share_within_group(model, optimizer)
        every = sync_every if sync_every is not None else env.get_int(env.FTLAUNCH_SYNC_EVERY, 100) or 100
        algorithm = LocalSGD(self.manager, model, optimizer, every, **kwargs)
        return algorithm.__enter__()

    def diloco(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        sync_every: int | None = None,
        *,
        fragments: int | list[nn.Module] | None = None,
        fragment_sync_delay: int | None = None,
        fragment_update_alpha: float | None = None,
        should_quantize: bool | int | None = None,
        **kwargs: Any,
    ) -> DiLoCo:
        """DiLoCo across the replica groups; Streaming DiLoCo with ``fragments`` > 1.

        ``fragments``: a number (``model``'s parameters split into that many contiguous fragments,
        `ftlaunch.worker.fragments.split_fragments`) or the fragment modules themselves. What is not passed comes from the
        environment (``FTLAUNCH_SYNC_EVERY``, ``FTLAUNCH_FRAGMENTS``, ``FTLAUNCH_FRAGMENT_SYNC_DELAY``,
        ``FTLAUNCH_FRAGMENT_UPDATE_ALPHA``, ``FTLAUNCH_QUANTIZE``: what ``torchx run ftlaunch:diloco``
        sets), else the defaults: 100 steps, 1 fragment, no overlap, alpha 0, full precision.
        Other keyword arguments go to `ftlaunch.DiLoCo`.

        Returns the `ftlaunch.DiLoCo`, already entered: it has joined the job (this group now holds
        the job's global parameters) and ``inner_optimizer.step()`` drives it.
        """
        from ftlaunch.errors import ConfigurationError
        from ftlaunch.worker.fragments import split_fragments
        from ftlaunch.worker.local_sgd import DiLoCo

        every = sync_every if sync_every is not None else env.get_int(env.FTLAUNCH_SYNC_EVERY, 100) or 100
        if fragments is None:
            fragments = env.get_int(env.FTLAUNCH_FRAGMENTS, 1) or 1
        delay = fragment_sync_delay
        if delay is None:
            delay = env.get_int(env.FTLAUNCH_FRAGMENT_SYNC_DELAY, 0) or 0
        alpha = fragment_update_alpha
        if alpha is None:
            raw = os.environ.get(env.FTLAUNCH_FRAGMENT_UPDATE_ALPHA) or "0"
            try:
                alpha = float(raw)
            except ValueError:
                raise ConfigurationError(f"{env.FTLAUNCH_FRAGMENT_UPDATE_ALPHA}={raw!r} is not a number") from None
        quantize = should_quantize
        if quantize is None:
            quantize = env.get_int(env.FTLAUNCH_QUANTIZE, 0) or False
        modules = split_fragments(model, fragments) if isinstance(fragments, int) else fragments
        self._share_within_group(model, inner_optimizer)
        algorithm = DiLoCo(
            self.manager, modules, inner_optimizer, outer_optimizer, every, fragment_sync_delay=delay,
            fragment_update_alpha=alpha, should_quantize=quantize, **kwargs,
        )  # fmt: skip
        return algorithm.__enter__()

    def _share_within_group(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """With several workers per group (and a replicated model): start them from rank 0's
        parameters and average their gradients before each inner step, so they stay identical.
        A sharded model (DTensor parameters: FSDP, HSDP) averages its own gradients."""
        if self.intra_group is None or self.world_size == 1:
            return
        params = list(model.parameters())
        if any(hasattr(p, "device_mesh") for p in params):
            return
        group = self.intra_group
        with torch.no_grad():
            for t in [*params, *model.buffers()]:
                dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)

        def average(*_: Any) -> None:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                return
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat.div_(self.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

        optimizer.register_step_pre_hook(average)

    def shutdown(self) -> None:
        """Leave the quorum and release the process groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.manager.shutdown()
        if self._owns_intra_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> FaultTolerance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


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
    - Other keyword arguments go to :class:`ftlaunch.Manager` (e.g. ``max_retries``, ``init_sync``).
    """
    # The launcher->worker contract, read once: every value below is passed on explicitly.
    job = env.JobEnv.from_environ(
        replica_group_id=replica_group_id,
        num_replica_groups=num_replica_groups,
        lighthouse=lighthouse,
        token=manager_kwargs.pop("token", None),
    )
    group = env.GroupEnv.from_environ()

    # Timeouts: one knob, explicit overrides validated together before anything connects.
    overrides = {
        name: manager_kwargs.pop(f"{name}_timeout")
        for name in ("quorum", "connect", "heal", "commit", "collective")
        if f"{name}_timeout" in manager_kwargs
    }
    timeouts = Timeouts.derive(timeout, **overrides)

    dev = torch.device(device) if device is not None else model_device(model)
    chosen_backend = _choice(backend, env.FTLAUNCH_BACKEND, BACKENDS, "backend") or default_backend(dev)
    chosen_transport = _choice(transport, env.FTLAUNCH_TRANSPORT, TRANSPORTS, "transport") or "pg"

    if (load_state_dict is None) != (state_dict is None):
        raise ValueError("pass both load_state_dict and state_dict, or neither")
    if load_state_dict is None and (model is not None or optimizer is not None):
        load_state_dict, state_dict = _model_state_fns(model, optimizer)

    want_intra = group.world_size > 1 if intra_group is None else intra_group
    intra, owns_intra = _intra_group(want_intra, group, dev, timeouts)

    pg = make_process_group(chosen_backend, timeouts.as_timedelta("collective"))
    try:
        ckpt = _make_transport(chosen_transport, pg, dev, timeouts)

        manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_replica_size,
            timeouts=timeouts,
            rank=group.rank,
            world_size=group.world_size,
            store_addr=group.master_addr,
            store_port=group.master_port,
            lighthouse_addr=job.lighthouse,
            token=job.token,
            replica_id=job.replica_id,
            checkpoint_transport=ckpt,
            **manager_kwargs,
        )
    except BaseException:
        release_process_group(pg)
        if owns_intra and dist.is_initialized():
            dist.destroy_process_group()
        raise
    manager.log.info(
        "ftlaunch.init: replica group %d of %d, rank %d of %d, backend %s, transport %s, device %s",
        job.replica_group_id, job.num_replica_groups, group.rank, group.world_size, chosen_backend,
        chosen_transport, dev,
    )  # fmt: skip
    return FaultTolerance(
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
    )


def _model_state_fns(
    model: nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> tuple[Callable[[Any], None], Callable[[], Any]]:
    """Live-recovery state from the model and optimizer the user passed (the unwrapped objects, so
    keys do not depend on a later DDP wrap)."""

    def save() -> dict[str, Any]:
        sd: dict[str, Any] = {}
        if model is not None:
            sd["model"] = model.state_dict()
        if optimizer is not None:
            sd["optim"] = optimizer.state_dict()
        return sd

    def load(sd: dict[str, Any]) -> None:
        if model is not None:
            model.load_state_dict(sd["model"])
        if optimizer is not None:
            optimizer.load_state_dict(sd["optim"])

    return load, save


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
    name: str, pg: ProcessGroup, device: torch.device, timeouts: Timeouts
) -> CheckpointTransport[Any]:
    from ftlaunch.checkpointing import HTTPTransport, PGTransport

    if name == "pg":
        return PGTransport(pg, timeout=timeouts.as_timedelta("heal"), device=device)
    return HTTPTransport(timeout=timeouts.as_timedelta("heal"))

"""What ``ftlaunch.init()`` returns: `FaultTolerance`, everything a training loop needs, connected.

Split from ``entry.py`` (which builds it): this module is what a script *uses* -- ``ft.wrap``,
``ft.sampler``, ``ft.shard`` (HSDP), ``ft.local_sgd``/``ft.diloco``, ``ft.gangs`` and ``shutdown`` --
while ``entry.py`` reads the environment, waits for a slot when the job has hot spares
(``worker/spare.py``) and connects the pieces.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ftlaunch import env
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import ConfigurationError
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.timeouts import Timeouts
from ftlaunch.worker.data import DistributedSampler
from ftlaunch.worker.exactly_once import ExactlyOnceSampler
from ftlaunch.worker.manager import Manager

if TYPE_CHECKING:
    from ftlaunch.gang import Gang, Gangs
    from ftlaunch.worker.durable import DurableCheckpoints
    from ftlaunch.worker.local_sgd import DiLoCo, LocalSGD


class Registered(enum.Enum):
    """What ``ftlaunch.init`` registered for live recovery."""

    #: Nothing yet: ``ft.wrap`` of a sharded model registers the model and optimizer it is given.
    NOTHING = "nothing"
    #: The state functions the script passed (``load_state_dict=``, ``state_dict=``).
    USER = "user"
    #: The model and optimizer the script passed.
    MODEL = "model"


@dataclass(frozen=True)
class InitState:
    """What ``ftlaunch.init`` registered for live recovery, so that ``ft.wrap`` of a sharded model
    can tell whether it is given the same objects (FSDP2 replaces the parameters: the optimizer must
    be built after sharding)."""

    kind: Registered = Registered.NOTHING
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None

    def other_than(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``init`` registered a model and optimizer other than these."""
        return self.kind is Registered.MODEL and (self.model is not model or self.optimizer is not optimizer)


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
    #: The live-recovery transport the Manager uses (HSDP tells it the device mesh).
    checkpoint_transport: CheckpointTransport[Any] | None = None
    #: What ``init`` registered for live recovery (``wrap`` of a sharded model may register more).
    registered: InitState = field(default_factory=InitState, repr=False)
    _device_mesh: DeviceMesh | None = field(default=None, repr=False)
    #: Defaults of `local_sgd`/`diloco` the environment gave (``init`` reads them with the rest;
    #: None: read them when one of the two is called).
    sync_env: env.SyncEnv | None = field(default=None, repr=False)
    #: `sampler` made an `ExactlyOnceSampler` (`diloco` checks that its syncs leave it usable).
    _exact_sampler: bool = field(default=False, repr=False)
    #: Durable checkpoints (``checkpoint_dir=``), None without a directory.
    durable: DurableCheckpoints | None = field(default=None, repr=False)

    def _sync_defaults(self) -> env.SyncEnv:
        return self.sync_env if self.sync_env is not None else env.SyncEnv.from_environ()

    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """DDP across replica groups (averaged inside the group first) and a commit-gated optimizer.

        A model sharded by FSDP2 (``ft.shard`` or ``fully_shard``) gets fault-tolerant HSDP
        instead: see `_wrap_sharded`.
        """
        from ftlaunch.worker import hsdp

        if hsdp.is_sharded(model):
            return self._wrap_sharded(model, optimizer)
        from ftlaunch.worker.data_parallel import DistributedDataParallel
        from ftlaunch.worker.optim import Optimizer

        return (
            DistributedDataParallel(self.manager, model, intra_group=self.intra_group),
            Optimizer(self.manager, optimizer, self._on_commit()),
        )

    def _on_commit(self) -> Callable[[int], None] | None:
        """What the commit-gated optimizer calls after each committed update (durable checkpoints)."""
        return self.durable.committed if self.durable is not None else None

    def sampler(
        self, dataset: Any, key: str = "sampler", mode: str = "exact", **kwargs: Any
    ) -> ExactlyOnceSampler | DistributedSampler:
        """A sampler for ``dataset`` whose position travels with live recovery (registered under
        ``key``), so a healed group continues exactly where its peers are.

        ``mode="exact"`` (the default): `ExactlyOnceSampler`, every sample trained exactly once
        per epoch by the job whatever fails; the groups of each committed step take consecutive
        slices of what is left. ``mode="shard"``: `DistributedSampler`, a fixed shard per replica
        group x worker (a group that is down skips its shard's samples meanwhile). Keyword
        arguments (``shuffle``, ``seed``, ``drop_last``) go to the sampler. See docs/data.md.
        """
        if mode == "exact":
            s: ExactlyOnceSampler | DistributedSampler = ExactlyOnceSampler(
                dataset, self.manager, rank=self.rank, num_replicas=self.world_size,
                num_replica_groups=self.num_replica_groups, **kwargs,
            )  # fmt: skip
            self._exact_sampler = True
        elif mode == "shard":
            s = DistributedSampler(
                dataset,
                replica_group_id=self.replica_group_id,
                num_replica_groups=self.num_replica_groups,
                rank=self.rank,
                num_replicas=self.world_size,
                **kwargs,
            )
        else:
            raise ConfigurationError(f"ft.sampler(mode={mode!r}): mode is 'exact' (the default) or 'shard'")
        s.register(self.manager, key)
        return s

    # ---- fault-tolerant HSDP: FSDP2 inside the group, averaged across groups (worker/hsdp.py) ----
    @property
    def device_mesh(self) -> DeviceMesh:
        """The replica group's 1-D device mesh (dimension ``dp_shard``) over its own process group;
        a group of one worker gets a private one-rank group."""
        if self._device_mesh is None:
            from ftlaunch.worker import hsdp

            if self.intra_group is None:
                if self.world_size > 1:
                    raise ConfigurationError(
                        "sharding over a replica group of several workers needs its process group: "
                        "do not pass intra_group=False to ftlaunch.init()"
                    )
                self.intra_group, self._owns_intra_group = _solo_group(self.device, self.timeouts)
            self._device_mesh = hsdp.group_mesh(self.intra_group, self.device.type)
        return self._device_mesh

    def shard(self, model: nn.Module, *, units: Any = None, **fully_shard_kwargs: Any) -> nn.Module:
        """Shard ``model`` with FSDP2 over the replica group's workers (`device_mesh`): each unit
        (default: the elements of the model's outermost ``nn.ModuleList``s, a transformer's blocks)
        then the root. ``fully_shard_kwargs`` (``mp_policy``, ``reshard_after_forward``, ...) go to
        every call. Create the optimizer afterwards, then ``ft.wrap(model, optimizer)``."""
        from ftlaunch.worker import hsdp

        return hsdp.shard(model, self.device_mesh, units, **fully_shard_kwargs)

    def _wrap_sharded(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Fault-tolerant HSDP around an FSDP2 model: its gradient shards averaged across replica
        groups through the Manager (an FSDP all-reduce hook, unless the mesh already replicates
        over ftlaunch's dimension), a commit-gated optimizer, model and optimizer shards healed
        rank by rank over the pg transport, and the sharding checked against the other groups'."""
        from ftlaunch.checkpointing import PGTransport
        from ftlaunch.worker import hsdp
        from ftlaunch.worker.optim import Optimizer
        from ftlaunch.worker.recovery import DEFAULT_STATE_KEY

        hsdp.check_optimizer(model, optimizer)
        mesh = hsdp.mesh_of(model)
        if not hsdp.replicates_across_groups(mesh):
            hsdp.average_across_groups(self.manager, model)
        if not isinstance(self.checkpoint_transport, PGTransport):
            raise ConfigurationError(
                "sharded state heals over the pg transport (rank r from rank r); "
                f"transport={self.transport!r} "
                "cannot carry DTensors: use ftlaunch.init(transport='pg') (the default)"
            )
        self.checkpoint_transport.device_mesh = mesh
        if self.registered.kind is Registered.NOTHING:
            if self.durable is not None and self.durable.resuming:
                # The checkpoint's optimizer state loads into the optimizer's own DTensors: create
                # them first (a step with zero gradients and lr 0, torch's own way).
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(optimizer)
            self.manager.register_state_dict_fn(DEFAULT_STATE_KEY, *model_state_fns(model, optimizer))
            self.registered = InitState(Registered.MODEL, model, optimizer)
        elif self.registered.other_than(model, optimizer):
            raise ConfigurationError(
                "ftlaunch.init() was given another model/optimizer than ft.wrap(): for HSDP call "
                "ftlaunch.init() "
                "without them (the optimizer must be created after sharding); ft.wrap registers them "
                "for healing"
            )
        layout = hsdp.layout_of(model)
        self.manager.require_same_layout(layout.digest, layout.text)
        self.manager.log.info("fault-tolerant HSDP: %s", layout.text)
        return model, Optimizer(self.manager, optimizer, self._on_commit())

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
        every = sync_every if sync_every is not None else self._sync_defaults().sync_every
        algorithm = LocalSGD(self.manager, model, optimizer, every, **kwargs)
        algorithm.__enter__()
        algorithm.join()
        return algorithm

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
        `ftlaunch.worker.fragments.split_fragments`) or the fragment modules themselves. What is not passed
        comes from the environment (``FTLAUNCH_SYNC_EVERY``, ``FTLAUNCH_FRAGMENTS``,
        ``FTLAUNCH_FRAGMENT_SYNC_DELAY``,
        ``FTLAUNCH_FRAGMENT_UPDATE_ALPHA``, ``FTLAUNCH_QUANTIZE``: what ``torchx run ftlaunch:diloco``
        sets), else the defaults: 100 steps, 1 fragment, no overlap, alpha 0, full precision.
        Other keyword arguments go to `ftlaunch.DiLoCo`.

        Returns the `ftlaunch.DiLoCo`, already entered: it has joined the job (this group now holds
        the job's global parameters) and ``inner_optimizer.step()`` drives it.
        """
        from ftlaunch.worker.fragments import split_fragments
        from ftlaunch.worker.local_sgd import DiLoCo

        defaults = self._sync_defaults()
        every = sync_every if sync_every is not None else defaults.sync_every
        if fragments is None:
            fragments = defaults.fragments
        delay = defaults.fragment_sync_delay if fragment_sync_delay is None else fragment_sync_delay
        if delay and self._exact_sampler:
            raise ConfigurationError(
                f"fragment_sync_delay={delay} lets the inner steps draw data while a sync is open, which "
                "ft.sampler's exactly-once accounting cannot follow: build it with ft.sampler(dataset, "
                "mode='shard') (docs/data.md)"
            )
        alpha = defaults.fragment_update_alpha if fragment_update_alpha is None else fragment_update_alpha
        quantize = (defaults.quantize or False) if should_quantize is None else should_quantize
        modules = split_fragments(model, fragments) if isinstance(fragments, int) else fragments
        self._share_within_group(model, inner_optimizer)
        algorithm = DiLoCo(
            self.manager, modules, inner_optimizer, outer_optimizer, every, fragment_sync_delay=delay,
            fragment_update_alpha=alpha, should_quantize=quantize, **kwargs,
        )  # fmt: skip
        algorithm.__enter__()
        algorithm.join()
        return algorithm

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
        """Leave the quorum and release the process groups (idempotent).

        Called for you when the ``with`` block ends, and when the interpreter exits normally: a
        script that never calls it still leaves cleanly (`_shutdown_at_exit`).
        """
        if self._closed:
            return
        self._closed = True
        if self.durable is not None:
            if not _failing():  # the finished model on disk, whatever step the training ended at
                self.durable.final(self.manager.current_step())
            self.durable.close(wait=not _failing())  # a save in progress completes on a clean exit
        if _failing():  # called while an exception propagates (``finally:``): a failure, not an end
            self.manager.shutdown(leave=False)
        if self._gangs is not None:
            self._gangs.close()  # the Manager, the group's sub-gangs and its default group
        self.manager.shutdown()
        if self._owns_intra_group and dist.is_initialized():
            dist.destroy_process_group()
        if not dist.is_initialized():
            self.intra_group = None  # destroyed: gloo's threads and sockets live as long as a reference

    def __enter__(self) -> FaultTolerance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- fairseq2's Gang API (docs/gang.md) ----------------------------------------------------
    _gangs: Gangs | None = field(default=None, repr=False)

    def gangs(self, *, tp_size: int = 1) -> Gangs:
        """fairseq2's `Gangs` for this worker, fault tolerant across replica groups.

        ``rdp`` is the replica dimension (``ftlaunch.worker.managed_gang.ManagedGang``): its size
        is the live quorum's, its collectives go through the Manager, and the loop marks each step
        with ``gangs.rdp.begin_step()`` and ``if gangs.rdp.should_commit(): <apply the update>``.
        ``sdp``/``tp``/``pp`` live inside the replica group (``tp_size`` adjacent ranks per tensor
        parallel gang); ``dp`` and ``root`` span the groups. The first call begins the first step
        and builds them (every worker of the group calls it); later calls return the same object.
        ``gangs.close()`` - or ``shutdown()``, the same - tears all of it down.
        """
        from ftlaunch.gang import FakeGang, ProcessGroupGang
        from ftlaunch.worker.managed_gang import fault_tolerant_gangs

        if self._gangs is not None:
            return self._gangs
        if self.world_size == 1:
            group_root: Gang = FakeGang(self.device)
        elif self.intra_group is not None and self.intra_group is dist.group.WORLD:
            group_root = ProcessGroupGang(
                self.intra_group, self.device, timeout=self.timeouts.as_timedelta("collective")
            )
        else:
            raise ConfigurationError(
                "ft.gangs() needs the replica group's own process group: ftlaunch.init(intra_group=True)"
            )
        self._gangs = fault_tolerant_gangs(self.manager, group_root, tp_size=tp_size, release=self.shutdown)
        return self._gangs


def model_state_fns(
    model: nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> tuple[Callable[[Any], None], Callable[[], Any]]:
    """Live-recovery state from the model and optimizer the user passed (the unwrapped objects, so
    keys do not depend on a later DDP wrap). An FSDP2 model's state is read without
    ``model.state_dict()`` (see `hsdp.ShardedState`: the Manager reads it during the forward pass)."""
    from ftlaunch.worker import hsdp

    if model is not None and hsdp.is_sharded(model):
        sharded = hsdp.ShardedState(model, optimizer)
        return sharded.load_state_dict, sharded.state_dict

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


def _solo_group(device: torch.device, timeouts: Timeouts) -> tuple[dist.ProcessGroup, bool]:
    """A one-rank default process group for a replica group of one worker (FSDP needs a mesh)."""
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
            timeout=timeouts.as_timedelta("collective"),
        )  # fmt: skip
    world = dist.group.WORLD
    assert world is not None  # initialized above
    return world, owns


def _failing() -> bool:
    """An exception is propagating through the caller (a ``finally:`` or ``with`` block): the
    training failed. ``SystemExit(0)`` and ``SystemExit(None)`` are clean exits."""
    exc = sys.exc_info()[1]
    if exc is None:
        return False
    return not (isinstance(exc, SystemExit) and exc.code in (0, None))

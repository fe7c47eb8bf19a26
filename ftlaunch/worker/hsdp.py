"""Fault-tolerant HSDP: FSDP2 shards the model inside a replica group, the Manager averages the
gradient shards across groups.

Inside a group, ``fully_shard`` runs over the group's own process group (its workers, from
torchelastic): parameters, gradients and optimizer state are DTensors sharded over the group's
1-D mesh. After each FSDP unit's reduce-scatter, FSDP2 calls an all-reduce hook with this rank's
shard of the group's averaged gradient; the hook averages it across replica groups with
`Manager.allreduce`. Rank r of every group holds the same shard, and the cross-group process group
of rank r joins exactly those ranks: it *is* HSDP's replicate dimension, reconfigured by the
Manager whenever the quorum changes.

Why a hook rather than a 2-D device mesh whose replicate dimension is the cross-group group
(torch's native HSDP; `ft_init_device_mesh` builds that for ported torchft scripts, and it works too):

* Every cross-group collective goes through the Manager, so a failure is recorded and the step
  discarded, never raised out of ``backward``. With the replicate dimension in the mesh, any DTensor
  operation over it (a ``redistribute`` in user code) would talk to the other groups on its own.
* The divisor is the Manager's -- the number of up-to-date groups, a healing group contributing
  zeros -- by construction, instead of a product FSDP computes from group sizes.
* The sharding (mesh, placements) depends on the group alone, so groups can compare layouts
  (`layout_of`) and heal shard by shard whatever the number of live groups.

The cost is that of torch's native HSDP on CPU: both all-reduce synchronously after each unit's
reduce-scatter (on CUDA the hook runs on FSDP's all-reduce stream).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ftlaunch.errors import ConfigurationError
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.process_group.device_mesh import extend_device_mesh
from ftlaunch.worker.managed_pg import ManagedProcessGroup
from ftlaunch.worker.manager import Manager

__all__ = [
    "SHARD_DIM",
    "Layout",
    "ShardedState",
    "average_across_groups",
    "check_optimizer",
    "ft_init_device_mesh",
    "group_mesh",
    "is_sharded",
    "layout_of",
    "mesh_of",
    "replicates_across_groups",
    "shard",
]

#: Name of the group mesh's dimension (torchtitan's name for FSDP's sharding dimension).
SHARD_DIM = "dp_shard"


def group_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The replica group's 1-D mesh over its own process group (no new process group is built)."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(SHARD_DIM,))


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards as units by default: the elements of the model's outermost
    ``nn.ModuleList``s -- a transformer's blocks in most models (torchtitan shards those)."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(model)
    return units


def shard(
    model: nn.Module, mesh: DeviceMesh, units: Iterable[nn.Module] | None = None, **kwargs: Any
) -> nn.Module:
    """``fully_shard`` each unit (default: `default_units`), then the root, over ``mesh``.

    ``kwargs`` go to every ``fully_shard`` call (``mp_policy``, ``reshard_after_forward``,
    ``offload_policy``, ...). Returns ``model``, now an ``FSDPModule``; create the optimizer after
    this (sharding replaces the parameters).
    """
    for unit in default_units(model) if units is None else units:
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards (part of) ``model``."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def mesh_of(model: nn.Module) -> DeviceMesh:
    """The device mesh of the model's sharded parameters; ConfigurationError if there are several
    (live recovery rebuilds received shards on one mesh)."""
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        raise ConfigurationError("nothing in the model is sharded: call fully_shard (or ft.shard) first")
    if len(meshes) != 1:
        raise ConfigurationError(
            f"the model's parameters live on {len(meshes)} device meshes; fault-tolerant HSDP needs "
            "exactly one"
        )
    return next(iter(meshes.values()))


def replicates_across_groups(mesh: DeviceMesh) -> bool:
    """Whether a dimension of ``mesh`` is an ftlaunch cross-group group (`ft_init_device_mesh`,
    `extend_device_mesh`): FSDP2 then averages across groups itself (native HSDP)."""
    return any(isinstance(mesh.get_group(d), ProcessGroup) for d in range(mesh.ndim))


class _CrossGroupAverage:
    """FSDP2's all-reduce hook: average this rank's gradient shard over the replica groups.

    Waits for the result: FSDP reads the tensor right after the hook (post-divide, cast to the
    parameter dtype, views as ``.grad``), and gradients must be final when ``backward`` returns
    (clipping reads them). A failure never raises here: the Manager records it and the step is not
    committed by any group.
    """

    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.manager.allreduce(reduce_output).wait()


def average_across_groups(manager: Manager, model: nn.Module) -> int:
    """Install the cross-group average on every FSDP unit of ``model``; returns how many.

    ConfigurationError when FSDP already averages across groups (its mesh has the cross-group
    dimension: averaging twice would be wrong) or when nothing is sharded.
    """
    if replicates_across_groups(mesh_of(model)):
        raise ConfigurationError(
            "the model's mesh already has ftlaunch's cross-group dimension (ft_init_device_mesh/"
            "extend_device_mesh): FSDP averages across groups itself, do not add the hook"
        )
    hook = _CrossGroupAverage(manager)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_all_reduce_hook(hook)
    return len(units)


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ConfigurationError unless every parameter ``optimizer`` updates is one of the sharded model's.

    ``fully_shard`` replaces the parameters: an optimizer built before would update stale tensors,
    and parameters outside the model would not be averaged across groups (the groups would drift).
    """
    ours = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in ours:
                raise ConfigurationError(
                    "the optimizer updates a parameter that is not one of the sharded model's: create the "
                    "optimizer after sharding (fully_shard replaces the parameters), over model.parameters()"
                )


class ShardedState:
    """The live-recovery state of an FSDP2 model and its optimizer: ``{"model": ..., "optim": ...}``.

    Use it instead of ``model.state_dict()`` in the functions you give the Manager. The Manager may
    read the state on its quorum thread while the forward pass runs (a healer sizing what it will
    receive; LocalSGD and DiLoCo serving their live state), and FSDP2's state-dict pre-hook reshards
    parameters (frees the gathered ones) that the forward pass may be using at that moment. This reads the
    sharded parameters FSDP keeps -- the DTensors the optimizer updates, captured here on the calling thread
    -- and touches nothing; loading goes through
    ``model.load_state_dict`` and runs on the training thread (after the commit vote).
    Build it after sharding, before training.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        keys = list(
            model.state_dict().keys()
        )  # its pre-hook makes sure the sharded parameters are registered
        params = dict(model.named_parameters(remove_duplicate=False))
        self._params = {k: params[k] for k in keys if k in params}
        self._buffer_keys = [k for k in keys if k not in params]

    def state_dict(self) -> dict[str, Any]:
        buffers = dict(self.model.named_buffers(remove_duplicate=False))
        state: dict[str, Any] = {"model": {
            **{k: p.detach() for k, p in self._params.items()},
            **{k: buffers[k].detach() for k in self._buffer_keys}
        }}  # fmt: skip
        if self.optimizer is not None:
            state["optim"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optim"])


@dataclass(frozen=True)
class Layout:
    """How a model is sharded: ``digest`` identifies it, ``text`` says it in a few words."""

    digest: str
    text: str


def layout_of(model: nn.Module) -> Layout:
    """The layout every replica group must share: each parameter's name, global shape, dtype,
    placements and mesh. Equal digests mean rank r of every group holds the same shards."""
    rows: list[list[Any]] = []
    placements: Counter[str] = Counter()
    meshes: set[str] = set()
    numel = 0
    for name, p in model.named_parameters():
        numel += p.numel()
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            where = f"{list(mesh.shape)} {list(mesh.mesh_dim_names or ())}"
            kinds = [str(x) for x in p.placements]
        else:
            where, kinds = "local", ["unsharded"]
        meshes.add(where)
        placements["/".join(kinds)] += 1
        rows.append([name, list(p.shape), str(p.dtype), kinds, where])
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    text = (
        f"{len(rows)} parameters ({numel} elements) on mesh {', '.join(sorted(meshes))}, placements "
        + ", ".join(f"{k} x{n}" for k, n in sorted(placements.items()))
        + f" [layout {digest}]"
    )
    return Layout(digest, text)


def ft_init_device_mesh(
    *,
    device_type: str,
    mesh_shape: tuple[int, ...],
    mesh_dim_names: tuple[str, ...],
    replicate_dim: int,
    manager: Manager,
) -> DeviceMesh:
    """torchft's long form: a mesh whose ``replicate_dim`` is the cross-group dimension, averaged
    through ``manager`` (a `ManagedProcessGroup`), the other dimensions over this group's workers.

    ``fully_shard(model, mesh=mesh)`` then runs torch's native HSDP with the Manager's divisor and
    error handling. The replicate dimension has size 1 in the mesh (DeviceMesh cannot change size;
    ``mesh_shape[replicate_dim]``, the configured group count, is ignored). The default process
    group must be the replica group's own (``init_process_group`` inside the group).
    """
    if not 0 <= replicate_dim < len(mesh_shape) or len(mesh_dim_names) != len(mesh_shape):
        raise ValueError(
            f"replicate_dim {replicate_dim} / mesh_dim_names {mesh_dim_names} do not fit {mesh_shape}"
        )
    shape = [s for d, s in enumerate(mesh_shape) if d != replicate_dim]
    names = [n for d, n in enumerate(mesh_dim_names) if d != replicate_dim]
    inner = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return extend_device_mesh(
        inner, ManagedProcessGroup(manager), name=mesh_dim_names[replicate_dim], dim=replicate_dim
    )

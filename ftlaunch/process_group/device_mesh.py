"""Plug a reconfigurable process group into DeviceMesh-based APIs (FSDP2 hybrid sharding)."""

from __future__ import annotations

import itertools

from torch.distributed.device_mesh import DeviceMesh

from ftlaunch.process_group import _registry
from ftlaunch.process_group.base import ProcessGroup

__all__ = ["extend_device_mesh"]

_NAMES = itertools.count()


def extend_device_mesh(mesh: DeviceMesh, pg: ProcessGroup, name: str = "dp", dim: int = 0) -> DeviceMesh:
    """A new mesh: `mesh` plus a dimension `name` at position `dim` backed by `pg`.

    DeviceMesh cannot change size, so the new dimension has size 1 (only this process's slot);
    the group behind it is `pg`, whose membership changes at every `configure`. Collectives over
    that dimension therefore span all replica groups of the current quorum, and anything that
    scales by the dimension's size must use ``pg.size()`` instead (the Manager does).
    `pg` is registered under a generated name if it is not registered yet (DeviceMesh and
    functional collectives look groups up by name).
    """
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"extend_device_mesh needs an ftlaunch ProcessGroup, got {type(pg).__name__}")
    names = list(mesh.mesh_dim_names or (f"dim_{i}" for i in range(mesh.ndim)))
    if name in names:
        raise ValueError(f"mesh already has a dimension named {name!r}")
    if not 0 <= dim <= mesh.ndim:
        raise ValueError(f"dim {dim} out of range for a {mesh.ndim}-d mesh")
    if not _registry.is_registered(pg):
        pg.register(f"ftlaunch-{name}-{next(_NAMES)}")
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    groups.insert(dim, pg)
    names.insert(dim, name)
    return DeviceMesh.from_group(
        groups,
        mesh.device_type,
        mesh=mesh.mesh.unsqueeze(dim),
        mesh_dim_names=tuple(names),
    )

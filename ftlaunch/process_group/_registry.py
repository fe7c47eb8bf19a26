"""Our groups in torch's process-group registries (``c10d._world`` and the C++ name registry).

Why: like torch's own groups, ours are registered from their first `configure` on. Then
``dist.get_backend(pg)``, ``dist.get_rank(pg)``, functional collectives by ``pg.group_name``,
DeviceMesh and ``destroy_process_group(pg)`` work, and - important for the error model - an
exception raised inside ``dist.all_reduce(..., group=pg)`` reaches the caller instead of being
masked by torch's error logger, which looks the group up there. As with torch's groups, `shutdown`
frees the resources and ``destroy_process_group(pg)`` (or `unregister`) also drops the
registration.

These tables are torch internals; this module is the only place that touches them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["add", "is_registered", "remove"]


def is_registered(pg: dist.ProcessGroup) -> bool:
    return c10d._world.pg_names.get(pg) is not None


def add(pg: dist.ProcessGroup, name: str, backend: str) -> c10d.GroupName:
    """Register ``pg`` (of ``backend``, its backend's name) under ``name`` (ValueError if another
    group has it); returns the name."""
    world = c10d._world
    if name in world.pg_names.values():
        raise ValueError(f"a process group named {name!r} is already registered")
    group_name = c10d.GroupName(name)
    # No c10d Store behind our groups (each configure builds its own). torch annotates the slot
    # as a Store but reads it only for the default group, groups it derives from another (by
    # tag, shrink) and symmetric memory - none of which applies to ours.
    world.pg_map[pg] = (backend, None)  # type: ignore[assignment]
    world.pg_names[pg] = group_name
    # A live read-only Mapping where torch annotates a dict: torch only reads the table
    # ([]/items/keys), never mutates it.
    world.pg_group_ranks[pg] = _LiveRankMap(pg)  # type: ignore[assignment]
    world.pg_backend_config[pg] = backend
    tag = f"ptd:{name}"
    world.pg_to_tag[pg] = tag
    world.tags_to_pg.setdefault(tag, []).append(pg)
    c10d._register_process_group(group_name, pg)
    return group_name


def remove(pg: dist.ProcessGroup) -> None:
    """Drop ``pg`` from every table (what ``destroy_process_group(pg)`` does for torch's groups)."""
    world = c10d._world
    name = world.pg_names.pop(pg, None)
    world.pg_map.pop(pg, None)
    world.pg_group_ranks.pop(pg, None)
    world.pg_backend_config.pop(pg, None)
    world.pg_coalesce_state.pop(pg, None)
    tag = world.pg_to_tag.pop(pg, None)
    if tag is not None and pg in world.tags_to_pg.get(tag, []):
        world.tags_to_pg[tag].remove(pg)
        if not world.tags_to_pg[tag]:
            del world.tags_to_pg[tag]
    if name is not None:
        with contextlib.suppress(Exception):  # already gone from the C++ registry
            c10d._unregister_process_group(name)


class _LiveRankMap(Mapping[int, int]):
    """torch's "global rank -> group rank" table for a group whose rank changes at configure.

    Our groups span replica groups, each with its own default group, so the only global rank
    that means anything here is this process's own; it maps to the current group rank.
    """

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg = weakref.ref(pg)

    @staticmethod
    def _own() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def __getitem__(self, global_rank: int) -> int:
        pg = self._pg()
        if pg is None or global_rank != self._own():
            raise KeyError(global_rank)
        return pg.rank()

    def __iter__(self) -> Iterator[int]:
        return iter([self._own()])

    def __len__(self) -> int:
        return 1

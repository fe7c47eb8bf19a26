"""Sharded tensors (DTensors) in live recovery: each rank sends its own shard, never the whole tensor.

A DTensor is a local tensor (this rank's shard) plus a spec: the device mesh, the placement on
each mesh dimension and the global shape. Healing pairs rank r of a healthy replica group with rank
r of the healing one, so only the local shard has to travel; the spec travels beside it as plain
JSON (`ShardSpec`). The receiver rebuilds the DTensor on *its own* mesh — a DeviceMesh holds
process groups and cannot cross processes — after checking that the sharding is the same: same
mesh shape and dimension names, same position in the mesh, same placements, same global shape
and stride, and a local shard of exactly the shape its own mesh gives it. Anything else means the
groups shard differently, and the shard would land in the wrong place: refused with a
`CheckpointTransportError` naming the tensor and both layouts.

`split` (sender) replaces every DTensor of a state dict by its local tensor and returns the specs;
`join` (receiver) puts DTensors back. Only ``Shard``, ``Replicate`` and FSDP2's strided shard
placements are carried: a ``Partial`` value is a pending reduction, never state to copy.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ftlaunch.errors import CheckpointTransportError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

# torch.distributed.tensor is imported where it is used, never at import: its op registry costs
# about a second of CPU (more on a loaded machine), which every restarting worker paid before it
# could rejoin, while only sharded state needs it. A DTensor can exist only once that
# module is imported, so `_is_dtensor` asks sys.modules first.


def _is_dtensor(t: Any) -> TypeGuard[DTensor]:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


__all__ = ["ShardSpec", "join", "split"]

#: A value's position in a state dict: the keys and indices leading to it.
Path = tuple[str | int, ...]


def encode_placement(p: Placement, where: str) -> list[Any]:
    """JSON form of a placement: ``["shard", dim]``, ``["strided_shard", dim, split_factor]`` or
    ``["replicate"]``; TypeError for anything else (misuse on the sending side)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # before Shard: FSDP2+TP's placement
        return ["strided_shard", int(p.dim), int(p.split_factor)]
    if isinstance(p, Shard):
        return ["shard", int(p.dim)]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise TypeError(f"cannot send the DTensor at {where}: placement {p} is not Shard or Replicate")


def decode_placement(j: Any) -> Placement:
    """The placement `encode_placement` wrote; CheckpointTransportError for anything else."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if j == ["replicate"]:
        return Replicate()
    if isinstance(j, list) and len(j) == 2 and j[0] == "shard" and _is_int(j[1]):
        return Shard(j[1])
    if isinstance(j, list) and len(j) == 3 and j[0] == "strided_shard" and _is_int(j[1]) and _is_int(j[2]):
        return _StridedShard(j[1], split_factor=j[2])
    raise CheckpointTransportError(f"received an unknown DTensor placement {j!r}")


def _is_int(x: Any) -> bool:
    return type(x) is int


@dataclass(frozen=True)
class ShardSpec:
    """What a receiver needs besides the local shard to rebuild and check one DTensor."""

    path: Path
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    #: The sender's position in its mesh (the receiver must sit at the same one).
    coordinate: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: DTensor, path: Path) -> ShardSpec:
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"the DTensor at {_show(path)} lives on a mesh this rank is not part of")
        for p in t.placements:
            encode_placement(p, _show(path))  # refuse Partial here, at the sender
        return cls(
            path=path,
            mesh_shape=tuple(mesh.shape),
            mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            coordinate=tuple(coord),
            placements=tuple(t.placements),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "path": list(self.path),
            "mesh_shape": list(self.mesh_shape),
            "mesh_dim_names": list(self.mesh_dim_names) if self.mesh_dim_names is not None else None,
            "coordinate": list(self.coordinate),
            "placements": [encode_placement(p, _show(self.path)) for p in self.placements],
            "shape": list(self.shape),
            "stride": list(self.stride),
        }

    @classmethod
    def from_json(cls, j: Any) -> ShardSpec:
        """Parse a received spec; CheckpointTransportError when it is malformed."""
        try:
            names = j["mesh_dim_names"]
            spec = cls(
                path=tuple(j["path"]),
                mesh_shape=tuple(j["mesh_shape"]),
                mesh_dim_names=tuple(names) if names is not None else None,
                coordinate=tuple(j["coordinate"]),
                placements=tuple(decode_placement(p) for p in j["placements"]),
                shape=tuple(j["shape"]),
                stride=tuple(j["stride"]),
            )
        except (KeyError, TypeError) as e:
            raise CheckpointTransportError(f"received a malformed DTensor spec: {e!r}") from None
        ints = (*spec.mesh_shape, *spec.coordinate, *spec.shape, *spec.stride)
        if not all(_is_int(x) and x >= 0 for x in ints) or not all(
            isinstance(k, (str, int)) for k in spec.path
        ):
            raise CheckpointTransportError(f"received a malformed DTensor spec for {_show(spec.path)}")
        if len(spec.placements) != len(spec.mesh_shape) or len(spec.coordinate) != len(spec.mesh_shape):
            raise CheckpointTransportError(f"received an inconsistent DTensor spec for {_show(spec.path)}")
        return spec

    def describe(self) -> str:
        names = list(self.mesh_dim_names) if self.mesh_dim_names else None
        return (
            f"mesh {list(self.mesh_shape)} {names} at {list(self.coordinate)}, "
            f"placements {list(self.placements)}, global shape {list(self.shape)}"
        )


def _show(path: Path) -> str:
    return "state_dict" + "".join(f"[{k!r}]" for k in path)


# --------------------------------------------------------------------------------------------------
# walking a state dict (the containers the serialization carries)


def _map(x: Any, path: Path, leaf: Callable[[Any, Path], Any]) -> Any:
    """A copy of ``x`` with ``leaf(value, path)`` applied to every tensor; containers are rebuilt
    with their own type (the caller's state dict is never modified)."""
    if isinstance(x, torch.Tensor):
        return leaf(x, path)
    if type(x) is collections.defaultdict:
        return collections.defaultdict(
            x.default_factory, {k: _map(v, (*path, k), leaf) for k, v in x.items()}
        )
    if type(x) in (dict, collections.OrderedDict):
        return type(x)((k, _map(v, (*path, k), leaf)) for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x)(_map(v, (*path, i), leaf) for i, v in enumerate(x))
    return x


def split(state: Any) -> tuple[Any, list[ShardSpec]]:
    """``state`` with every DTensor replaced by its local shard, and those DTensors' specs.

    TypeError/ValueError (misuse on the sending side) for a DTensor that cannot travel: a
    ``Partial`` placement, or a mesh this rank is not part of.
    """
    specs: list[ShardSpec] = []

    def leaf(t: torch.Tensor, path: Path) -> torch.Tensor:
        if _is_dtensor(t):
            specs.append(ShardSpec.of(t, path))
            return t.to_local()
        return t

    return _map(state, (), leaf), specs


def locals_of(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (a receiver's in-place template)."""
    return split(state)[0]


def join(state: Any, specs: list[ShardSpec], mesh: DeviceMesh | None, template: Any = None) -> Any:
    """Put DTensors back into a received ``state``: the local tensor at each spec's path becomes a
    DTensor on ``mesh`` (or, without one, on the mesh of the template's DTensor at that path).

    Raises `CheckpointTransportError` when the sharding differs from this rank's, when no mesh is
    known, or when a spec's path holds no tensor.
    """
    by_path = {s.path: s for s in specs}
    if len(by_path) != len(specs):
        raise CheckpointTransportError("received two DTensor specs for the same path")
    mine = _template_dtensors(template) if template is not None and specs else {}
    done: set[Path] = set()

    def leaf(t: torch.Tensor, path: Path) -> torch.Tensor:
        spec = by_path.get(path)
        if spec is None:
            return t
        done.add(path)
        return _rebuild(t, spec, mesh, mine.get(path))

    out = _map(state, (), leaf)
    missing = [s.path for s in specs if s.path not in done]
    if missing:
        raise CheckpointTransportError(
            f"received DTensor specs for {_show(missing[0])}, which holds no tensor"
        )
    return out


def _template_dtensors(template: Any) -> dict[Path, DTensor]:
    found: dict[Path, DTensor] = {}

    def leaf(t: torch.Tensor, path: Path) -> torch.Tensor:
        if _is_dtensor(t):
            found[path] = t
        return t

    _map(template, (), leaf)
    return found


def _rebuild(local: torch.Tensor, spec: ShardSpec, mesh: DeviceMesh | None, mine: DTensor | None) -> DTensor:
    from torch.distributed.tensor import DTensor

    # torch's own helper, used by torch.distributed.checkpoint for the same purpose (no public twin).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    where = _show(spec.path)
    if mesh is None:
        if mine is None:
            raise CheckpointTransportError(
                f"received a sharded tensor (DTensor) at {where} but know no device mesh to rebuild it "
                "on: pass device_mesh= to the transport (ftlaunch's FaultTolerance.wrap does)"
            )
        mesh = mine.device_mesh
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    coord = mesh.get_coordinate()
    ours = f"mesh {list(mesh.shape)} {list(names) if names else None} at {list(coord) if coord else None}"
    if (
        tuple(mesh.shape) != spec.mesh_shape
        or names != spec.mesh_dim_names
        or coord is None
        or tuple(coord) != spec.coordinate
    ):
        raise _differs(where, spec, ours)
    if mine is not None and (tuple(mine.placements) != spec.placements or tuple(mine.shape) != spec.shape):
        raise _differs(
            where, spec, f"{ours}, placements {list(mine.placements)}, global shape {list(mine.shape)}"
        )
    expected, _ = compute_local_shape_and_global_offset(spec.shape, mesh, spec.placements)
    if tuple(local.shape) != tuple(expected):
        raise _differs(where, spec, f"{ours}, local shard {list(expected)} (received {list(local.shape)})")
    out = DTensor.from_local(
        local.detach(),
        mesh,
        spec.placements,
        run_check=False,
        shape=torch.Size(spec.shape),
        stride=spec.stride,
    )
    out.requires_grad_(local.requires_grad)
    return out


def _differs(where: str, spec: ShardSpec, ours: str) -> CheckpointTransportError:
    return CheckpointTransportError(
        f"refusing the DTensor at {where}: the replica groups shard it differently "
        f"(sender: {spec.describe()}; here: {ours}). Every group must run the same sharding "
        "(same workers per group, same fully_shard/placements)"
    )


def specs_to_json(specs: list[ShardSpec]) -> list[dict[str, Any]]:
    return [s.to_json() for s in specs]


def specs_from_json(j: Any) -> list[ShardSpec]:
    """Parse received specs; CheckpointTransportError when they are malformed."""
    if not isinstance(j, list) or not all(isinstance(s, Mapping) for s in j):
        raise CheckpointTransportError("received DTensor specs that are not a list of objects")
    return [ShardSpec.from_json(s) for s in j]

"""torch's overloads of a collective's arguments, normalised to one canonical form.

Why: torch reaches a group with several spellings of the same call - ``allreduce([t], opts)`` from
``dist.all_reduce``, ``allreduce(t, ReduceOp.SUM)`` from older code and torchft, C++ callers with
option objects - and each implementation should see exactly one. `base.ProcessGroup`'s public
methods pass their arguments through these and call the ``_do_<op>`` hooks with the result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["configure_args", "plain", "reduce_op", "tensor_list", "with_reduce"]


def reduce_op(op: Any) -> dist.ReduceOp:
    """A ``ReduceOp`` from a ``ReduceOp`` or a ``ReduceOp.RedOpType`` (``ReduceOp.SUM`` is either)."""
    if isinstance(op, dist.ReduceOp):
        return op
    if isinstance(op, dist.ReduceOp.RedOpType):
        return dist.ReduceOp(op)
    raise TypeError(f"expected a ReduceOp or options object, got {type(op).__name__}")


def tensor_list(tensors: Any, what: str) -> list[torch.Tensor]:
    """A list of tensors from one tensor or a list/tuple of them; TypeError naming ``what`` otherwise."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in tensors):
        return list(tensors)
    raise TypeError(f"{what} must be a Tensor or a list of Tensors, got {type(tensors).__name__}")


def with_reduce(opts: Any, cls: type) -> Any:
    """Options of type ``cls`` (which has ``reduceOp``) from None, ``cls`` itself, or a bare reduce op."""
    if opts is None:
        return cls()
    if isinstance(opts, cls):
        return opts
    new = cls()
    new.reduceOp = reduce_op(opts)
    return new


def plain(opts: Any, cls: type) -> Any:
    """Options of type ``cls`` from None or ``cls`` itself; TypeError otherwise."""
    if opts is None:
        return cls()
    if not isinstance(opts, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(opts).__name__}")
    return opts


def configure_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, str | None]:
    """``(rank, world_size, replica_id)`` from either form of `ProcessGroup.configure`'s arguments."""
    unknown = set(kwargs) - {"rank", "world_size", "replica_id"}
    if unknown:
        raise TypeError(f"configure() got unexpected keyword arguments {sorted(unknown)}")
    replica_id = kwargs.get("replica_id")
    rest = list(args)
    if rest and isinstance(rest[0], str):  # torchft 2025: (store_addr, replica_id, rank, world_size)
        if replica_id is not None:
            raise TypeError("configure() got replica_id both positionally and by keyword")
        replica_id = rest.pop(0)
    names = ["rank", "world_size"]
    if len(rest) > len(names):
        raise TypeError(
            f"configure() takes (store_addr, [replica_id,] rank, world_size), got {len(args) + 1} arguments"
        )
    values: dict[str, Any] = dict(zip(names, rest, strict=False))
    for name in names[len(rest) :]:
        if name not in kwargs:
            raise TypeError(f"configure() missing argument {name!r}")
        values[name] = kwargs[name]
    for name in names[: len(rest)]:
        if name in kwargs:
            raise TypeError(f"configure() got {name!r} both positionally and by keyword")
    if replica_id is not None and not isinstance(replica_id, str):
        raise TypeError(f"replica_id must be a str, got {type(replica_id).__name__}")
    return values["rank"], values["world_size"], replica_id

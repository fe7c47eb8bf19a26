"""`ProcessGroupGang`: a gang over a torch ProcessGroup (gloo on CPU, NCCL on CUDA).

Every torch failure of a collective (``RuntimeError``, torch's ``DistError`` family) becomes one
`GangError` naming the operation; argument mistakes are caught by the shared checks before torch
sees them, so they are ``ValueError`` on every rank and never leave a peer waiting.

MEAN is a SUM followed by a division by ``size``: gloo has no AVG, and one rule for every backend
keeps results the same on all of them.

`close` releases the group completely: a sub-gang destroys its group, the default group's gang
closes every sub-gang it created and then destroys every torch group (torch's
``destroy_process_group()``, which also shuts down ftlaunch's registered groups). A closed gang drops
its reference to the group: gloo's threads and sockets go with the last one, and a sub-gang the
caller still holds keeps nothing alive.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.errors import GangError, InvalidOperationError, NotSupportedError
from ftlaunch.gang.base import (
    Gang,
    ReduceOperation,
    broadcast_pickled,
    check_all_gather,
    check_all_gather_list,
    check_objects,
    check_ranks,
    check_reduce_operation,
    check_source_rank,
)

__all__ = ["ProcessGroupGang"]

logger = logging.getLogger(__name__)

#: fairseq2's default timeout of collectives.
DEFAULT_TIMEOUT = timedelta(minutes=15)

_TORCH_OP = {
    ReduceOperation.SUM: dist.ReduceOp.SUM,
    ReduceOperation.MEAN: dist.ReduceOp.SUM,  # then divided by size
    ReduceOperation.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOperation.MIN: dist.ReduceOp.MIN,
    ReduceOperation.MAX: dist.ReduceOp.MAX,
}


@contextlib.contextmanager
def _as_gang_error(op: str) -> Iterator[None]:
    """torch's communication failures -> `GangError` (misuse, ``ValueError``/``TypeError``, passes;
    an op the backend lacks is `NotSupportedError`)."""
    try:
        yield
    except (ValueError, TypeError):
        raise
    except NotImplementedError as e:
        raise NotSupportedError(f"{op}: {e}") from e
    except RuntimeError as e:  # DistError, DistBackendError, DistNetworkError, gloo's RuntimeErrors
        raise GangError(f"{op} failed: {e}") from e


class ProcessGroupGang(Gang):
    """``ProcessGroupGang(pg, device)``: the gang of torch's process group ``pg``."""

    def __init__(
        self, pg: dist.ProcessGroup, device: torch.device, *, timeout: timedelta | None = None
    ) -> None:
        """``timeout`` is given to the sub-groups `create_gang` makes (torch's default otherwise)."""
        self._pg: dist.ProcessGroup | None = pg
        self._device = torch.device(device)
        self._timeout = timeout
        self._rank = pg.rank()
        self._size = pg.size()
        self._is_default = pg is dist.group.WORLD
        self._sub_gangs: weakref.WeakSet[ProcessGroupGang] = weakref.WeakSet()

    @classmethod
    def create_default_process_group(
        cls, device: torch.device, *, timeout: timedelta | None = None, high_priority: bool = False
    ) -> ProcessGroupGang:
        """Initialise torch's default process group from the environment (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``: torchrun's, or a replica group's under ftlaunch) and wrap it.

        Gloo for a CPU ``device``, NCCL for CUDA; ``timeout`` bounds every collective (default 15
        minutes); ``high_priority`` puts NCCL on high-priority CUDA streams (no effect on gloo).

        Raises ``ValueError`` for a device that is neither cpu nor cuda, `NotSupportedError` if
        torch.distributed is unavailable, `InvalidOperationError` if the default group exists
        already, `GangError` if it cannot be initialised (no peers, unreachable store, bad env).
        """
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be of type cpu or cuda, got {device.type}")
        if not dist.is_available():
            raise NotSupportedError("torch.distributed is not available in this build of torch")
        if dist.is_initialized():
            raise InvalidOperationError("the default process group is already initialized")
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            kwargs["device_id"] = device  # eager NCCL initialisation: failures surface here
            if high_priority:
                kwargs["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise GangError(f"the default process group ({backend}) failed to initialize: {e}") from e
        if dist.group.WORLD is None:
            raise GangError("the default process group is missing right after its initialization")
        return cls(dist.group.WORLD, device, timeout=timeout)

    def close(self) -> None:
        """Destroy the process group (the default group's gang: its sub-gangs' first, then every
        torch group). Idempotent."""
        for sub in list(self._sub_gangs):
            sub.close()
        pg, self._pg = self._pg, None
        if pg is None or not dist.is_initialized():
            return  # already closed, or gone with the default group
        try:
            dist.destroy_process_group(None if self._is_default else pg)
        except ValueError:
            logger.debug("process group of %r was already destroyed", self)

    def _group(self, what: str) -> dist.ProcessGroup:
        if self._pg is None:
            raise InvalidOperationError(f"{what}: the gang is closed")
        return self._pg

    def create_gang(self, ranks: Sequence[int]) -> ProcessGroupGang | None:
        """See `Gang.create_gang`. Only the default group's gang creates sub-gangs (torch's
        ``new_group`` is collective over the default group): `InvalidOperationError` otherwise."""
        self._group("create_gang")
        members = check_ranks(ranks, self._size)
        if not self._is_default:
            raise InvalidOperationError("create_gang: sub-gangs are created from the root gang only")
        with _as_gang_error(f"create_gang({members})"):
            pg = dist.new_group(members, timeout=self._timeout)
        if self._rank not in members:
            return None
        sub = ProcessGroupGang(pg, self._device, timeout=self._timeout)
        self._sub_gangs.add(sub)
        return sub

    def as_process_group(self) -> dist.ProcessGroup:
        return self._group("as_process_group")

    def barrier(self) -> None:
        pg = self._group("barrier")
        device_ids = (
            [self._device.index] if self._device.type == "cuda" and self._device.index is not None else None
        )
        with _as_gang_error("barrier"):
            dist.barrier(group=pg, device_ids=device_ids)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        pg = self._group("all_reduce")
        op = check_reduce_operation(op)
        with _as_gang_error(f"all_reduce({op.name})"):
            dist.all_reduce(tensor, _TORCH_OP[op], group=pg)
        if op is ReduceOperation.MEAN:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(self._size)
            else:
                tensor.div_(self._size, rounding_mode="floor")

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        pg = self._group("all_gather")
        check_all_gather(output_tensor, input_tensor, self._size)
        with _as_gang_error("all_gather"):
            # Flat views: torch's gloo path rejects a stack of 0-d inputs, never a concatenation.
            dist.all_gather_single(output_tensor.view(-1), input_tensor.reshape(-1), group=pg)

    def all_gather_to_list(self, output_tensors: list[torch.Tensor], input_tensor: torch.Tensor) -> None:
        pg = self._group("all_gather_to_list")
        check_all_gather_list(output_tensors, input_tensor, self._size)
        with _as_gang_error("all_gather_to_list"):
            dist.all_gather(output_tensors, input_tensor, group=pg)

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        pg = self._group("broadcast")
        check_source_rank(source_rank, self._size)
        with _as_gang_error(f"broadcast(source_rank={source_rank})"):
            dist.broadcast(tensor, group=pg, group_src=source_rank)

    def broadcast_objects(self, objects: list[object], source_rank: int = 0) -> None:
        pg = self._group("broadcast_objects")
        check_objects(objects)
        check_source_rank(source_rank, self._size)

        def send(t: torch.Tensor, src: int) -> None:
            with _as_gang_error(f"broadcast_objects(source_rank={src})"):
                dist.broadcast(t, group=pg, group_src=src)

        broadcast_pickled(send, objects, source_rank, self._rank == source_rank, self._device)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def supports_process_group(self) -> bool:
        return True

"""`FakeGang`: a gang of identical peers, simulated in one process.

fairseq2's ``FakeGang`` and ftlaunch's `FakeProcessGroup` share the idea: every collective returns
what it would return if each of the ``size`` processes had passed exactly what this one passed. So
SUM multiplies by ``size``, PRODUCT raises to the power ``size``, MEAN/MIN/MAX leave the value, the
gathers replicate, a broadcast keeps the tensor, and ``broadcast_objects`` hands a non-source rank a
pickled copy of its objects (and fails, as a real gang does, on objects that cannot be pickled).

It is faithful to `ProcessGroupGang` where a test can see the difference: the same argument checks
and errors (they are shared, in `base`), sub-gangs numbered in rank order, sub-gangs created only
from the gang they came from (torch creates groups collectively over the default group, so a real
sub-gang cannot create another), and a closed gang that refuses further calls.
tests/processes/test_gang.py runs one table of expectations against both.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ftlaunch.errors import InvalidOperationError, NotSupportedError
from ftlaunch.gang.base import (
    Gang,
    ReduceOperation,
    check_all_gather,
    check_all_gather_list,
    check_objects,
    check_ranks,
    check_reduce_operation,
    check_source_rank,
)

__all__ = ["FakeGang"]


class FakeGang(Gang):
    """``FakeGang(device, rank=0, size=1)``: rank ``rank`` of a simulated gang of ``size`` processes."""

    def __init__(self, device: torch.device, *, rank: int = 0, size: int = 1) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank!r}")
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("a gang's device cannot be the meta device")
        self._device = device
        self._rank = rank
        self._size = size
        self._is_root = True
        self._closed = False

    def close(self) -> None:
        """Nothing to release; as a real gang, it refuses collectives afterwards."""
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise InvalidOperationError(f"{what}: the gang is closed")

    def create_gang(self, ranks: Sequence[int]) -> FakeGang | None:
        self._check_open("create_gang")
        members = check_ranks(ranks, self._size)
        if not self._is_root:
            raise InvalidOperationError("create_gang: sub-gangs are created from the root gang only")
        if self._rank not in members:
            return None
        sub = FakeGang(self._device, rank=members.index(self._rank), size=len(members))
        sub._is_root = False
        return sub

    def as_process_group(self) -> dist.ProcessGroup:
        raise NotSupportedError("a FakeGang has no torch ProcessGroup (it communicates with nobody)")

    def barrier(self) -> None:
        self._check_open("barrier")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        self._check_open("all_reduce")
        op = check_reduce_operation(op)
        if op is ReduceOperation.SUM:
            tensor.mul_(self._size)
        elif op is ReduceOperation.PRODUCT:
            tensor.pow_(self._size)
        # MEAN, MIN, MAX of equal values: the value itself.

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        self._check_open("all_gather")
        check_all_gather(output_tensor, input_tensor, self._size)
        output_tensor.copy_(input_tensor.unsqueeze(0).expand_as(output_tensor))

    def all_gather_to_list(self, output_tensors: list[torch.Tensor], input_tensor: torch.Tensor) -> None:
        self._check_open("all_gather_to_list")
        check_all_gather_list(output_tensors, input_tensor, self._size)
        for out in output_tensors:
            out.copy_(input_tensor)

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        self._check_open("broadcast")
        check_source_rank(source_rank, self._size)  # the source holds what this rank holds

    def broadcast_objects(self, objects: list[object], source_rank: int = 0) -> None:
        self._check_open("broadcast_objects")
        check_objects(objects)
        check_source_rank(source_rank, self._size)
        try:
            payload = pickle.dumps(list(objects))
        except Exception as e:  # noqa: BLE001 - as in base.broadcast_pickled
            raise TypeError(
                f"broadcast_objects: the objects of rank {source_rank} cannot be pickled: "
                f"{type(e).__name__}: {e}"
            ) from e
        if source_rank != self._rank:
            objects[:] = pickle.loads(payload)  # noqa: S301 - our own pickle

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
        return False

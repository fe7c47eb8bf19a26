"""`ProductGang`: the gang of an ``outer`` x ``inner`` grid of processes, run as two collectives.

Why: under ftlaunch no torch process group spans the whole job - a group that included every
replica group would die with any of them. The job's data-parallel gang is instead the product of
the replica dimension (``outer``: the fault-tolerant cross-group gang) and the data-parallel gang
inside one replica group (``inner``); likewise the job's root gang. Each collective runs inside the
replica group first and across groups second, and both gangs see exactly the collectives fairseq2
code issues on the product.

Numbering follows fairseq2's HSDP layout (``create_fsdp_gangs``): process (o, i) - rank ``o`` of
``outer``, rank ``i`` of ``inner`` - is rank ``o * inner.size + i``. ``outer`` connects the
processes with the same inner rank, one per outer rank; every ``inner`` has the same size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ftlaunch.errors import NotSupportedError
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

__all__ = ["ProductGang"]


class ProductGang(Gang):
    """``ProductGang(outer, inner)``: the ``outer.size * inner.size`` processes of both gangs."""

    def __init__(self, outer: Gang, inner: Gang) -> None:
        if outer.device != inner.device:
            raise ValueError(
                f"outer and inner gangs are on different devices: {outer.device}, {inner.device}"
            )
        self.outer = outer
        self.inner = inner

    def close(self) -> None:
        """Close both gangs (idempotent: each gang's own close is)."""
        self.outer.close()
        self.inner.close()

    def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        check_ranks(ranks, self.size)
        raise NotSupportedError(
            "a product gang creates no sub-gangs: create them from the gangs it is made of "
            "(inside the replica group) - its outer dimension changes membership at every step"
        )

    def as_process_group(self) -> dist.ProcessGroup:
        raise NotSupportedError(
            "a product gang is two process groups, not one: use its outer and inner gangs"
        )

    def barrier(self) -> None:
        self.inner.barrier()
        self.outer.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        # MEAN of equal-size inner gangs is the mean over inner, then over outer.
        op = check_reduce_operation(op)
        self.inner.all_reduce(tensor, op)
        self.outer.all_reduce(tensor, op)

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor) -> None:
        check_all_gather(output_tensor, input_tensor, self.size)
        part = torch.empty(
            (self.inner.size, *input_tensor.shape), dtype=input_tensor.dtype, device=input_tensor.device
        )
        self.inner.all_gather(part, input_tensor)
        self.outer.all_gather(output_tensor.view(self.outer.size, *part.shape), part)

    def all_gather_to_list(self, output_tensors: list[torch.Tensor], input_tensor: torch.Tensor) -> None:
        check_all_gather_list(output_tensors, input_tensor, self.size)
        whole = torch.empty(
            (self.size, *input_tensor.shape), dtype=input_tensor.dtype, device=input_tensor.device
        )
        self.all_gather(whole, input_tensor)
        for out, row in zip(output_tensors, whole.unbind(0), strict=True):
            out.copy_(row)

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        # Every replica group spreads its member at the source's inner rank; then the source's
        # replica group sends that (the source's tensor) across groups.
        check_source_rank(source_rank, self.size)
        outer_src, inner_src = divmod(source_rank, self.inner.size)
        self.inner.broadcast(tensor, inner_src)
        self.outer.broadcast(tensor, outer_src)

    def broadcast_objects(self, objects: list[object], source_rank: int = 0) -> None:
        check_objects(objects)
        check_source_rank(source_rank, self.size)
        outer_src, inner_src = divmod(source_rank, self.inner.size)
        self.inner.broadcast_objects(objects, inner_src)
        self.outer.broadcast_objects(objects, outer_src)

    @property
    def rank(self) -> int:
        return self.outer.rank * self.inner.size + self.inner.rank

    @property
    def size(self) -> int:
        return self.outer.size * self.inner.size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def supports_process_group(self) -> bool:
        return False

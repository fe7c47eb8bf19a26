"""One tensor averaged across the replica groups in a step: who contributes zeros, where the
division happens, full precision or quantized.

Why apart from the Manager: this is the arithmetic of the fault-tolerant allreduce (the Manager
decides *whether* to take part and records failures); keeping it here lets `manager` read as the
protocol alone. Every group computes the same expression, so committed results stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.worker import quantization
from ftlaunch.worker.plan import StepPlan

__all__ = ["ReduceOpLike", "is_avg", "reduce_across_groups"]

#: What ``allreduce`` accepts as its operation: "avg"/"sum" or a torch ReduceOp.
ReduceOpLike = str | dist.ReduceOp | dist.ReduceOp.RedOpType


def is_avg(op: ReduceOpLike) -> bool:
    """AVG given as a string, a ``ReduceOp`` or a ``ReduceOp.RedOpType`` (which compare equal)."""
    if isinstance(op, str):
        if op.lower() not in ("avg", "sum"):
            raise ValueError(f"reduce_op must be 'avg', 'sum' or a torch ReduceOp, got {op!r}")
        return op.lower() == "avg"
    return bool(op == dist.ReduceOp.AVG)


def torchft_positional(
    reduce_op: ReduceOpLike | bool | int, should_quantize: bool | int | ReduceOpLike
) -> tuple[ReduceOpLike, bool | int]:
    """``(reduce_op, should_quantize)`` from a call in either order.

    torchft's ``Manager.allreduce(tensor, should_quantize=False, reduce_op=ReduceOp.AVG)`` takes
    the flag second; ftlaunch's takes ``reduce_op`` second. A reduce op is never a bool or an int
    (torch's ``ReduceOp`` is neither), so a bool/int in second place is torchft's flag, and code
    written for torchft (``allreduce(t, False)``, ``allreduce(t, True, ReduceOp.SUM)``) keeps working.
    """
    if isinstance(reduce_op, (bool, int)):
        flag = reduce_op
        op = should_quantize if not isinstance(should_quantize, (bool, int)) else "avg"
        return op, flag
    if not isinstance(should_quantize, (bool, int)):
        raise TypeError(f"should_quantize must be a bool or a bit width, got {should_quantize!r}")
    return reduce_op, should_quantize


def check_args(
    tensor: torch.Tensor, reduce_op: ReduceOpLike, should_quantize: bool | int
) -> quantization.Bits | None:
    """Validate the arguments before any waiting: ValueError now, not after the quorum. Returns
    the quantization bit width, or None for full precision."""
    is_avg(reduce_op)
    if not should_quantize:
        return None
    quantization.check_quantizable(tensor, reduce_op)
    return quantization.bits_of(should_quantize)


def reduce_across_groups(
    pg: ProcessGroup,
    plan: StepPlan,
    tensor: torch.Tensor,
    reduce_op: ReduceOpLike,
    bits: quantization.Bits | None,
    contribute_zeros: bool,
    report_error: Callable[[Exception], None],
) -> torch.futures.Future[torch.Tensor] | None:
    """Start the reduction of ``tensor`` (in place) over ``pg``: a future completing with it, or
    None when there is nothing to wait for (alone in the quorum, or the op could not even start:
    then the failure was reported). ``contribute_zeros``: a healing group's gradients come from
    stale weights, and a failed step's are discarded anyway, but every group must still issue the
    same collectives (or peers hang), so it sends zeros and receives the average.
    """
    avg = is_avg(reduce_op)
    divisor = plan.num_participants if avg else 1
    post_divide = False
    if contribute_zeros:
        tensor.zero_()
    elif divisor > 1:
        if tensor.is_floating_point() or tensor.is_complex():
            # Average as sum(x_i / n), dividing here as torch's DDP does, not (sum x_i) / n in the
            # completion callback: that runs on a backend thread holding the GIL, and an 8 MB div_
            # there stalled this thread's next bucket hook by as long.
            tensor.div_(divisor)
        else:
            post_divide = True  # other dtypes: divided after the sum
    if plan.replica_world_size == 1:
        return None  # alone (and so the only source): the average is the tensor
    op = dist.ReduceOp.SUM if avg or reduce_op == "sum" else reduce_op
    try:
        if bits is not None:
            fut = quantization.allreduce_quantized(pg, tensor, bits)
        else:
            fut = pg.allreduce([tensor], op).get_future()
    except Exception as e:  # noqa: BLE001 - reported, the step will not commit
        report_error(e)
        return None

    def finish(f: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            f.value()
            if post_divide:
                tensor.div_(divisor)
        except Exception as e:  # noqa: BLE001 - reported, the step will not commit
            report_error(e)
        return tensor

    return fut.then(finish)

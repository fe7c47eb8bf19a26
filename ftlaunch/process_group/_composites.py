"""The composite operations: what a group without a native implementation of an op runs.

`base.ProcessGroup`'s hooks default to these, so no caller sees a NotImplementedError where a correct
fallback exists: coalesced ops as several ops, reduce_scatter and reduce from an allreduce,
all_gather_single and gather from an allgather, scatter as broadcasts, barrier as a tiny allreduce.
Each builds on the group's own native hooks (``pg._do_allreduce`` ...) and returns a `ComposedWork`
that copies results out once the underlying ops finished.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from ftlaunch.process_group.work import ComposedWork


def collective_device(pg: object) -> torch.device:
    """The device a group's collectives take their tensors on: CUDA's current device for an NCCL
    backend (Baby NCCL, in-process NCCL, torch's own), the CPU for every other.

    Why it is needed: a tensor that ftlaunch itself creates for a collective (the commit vote, a
    barrier's token) must live where the backend can reduce it -- NCCL refuses a CPU tensor. Read
    from the backend's name, so wrappers (which answer with the name of the group they wrap) and
    torch's own groups work alike."""
    name = ""
    for method in ("getBackendName", "name"):
        get = getattr(pg, method, None)
        if callable(get):
            try:
                name = str(get())
            except Exception:  # noqa: BLE001 - a group that cannot name itself is treated as CPU
                continue
            break
    if name.lower().endswith("nccl") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Collectives(Protocol):
    """What a composite needs of its group: rank, size and the native hooks it builds on
    (`_collectives.Collectives` has them all; a backend overrides those it has natively)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def _check_root(self, op: str, root: int) -> None: ...

    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work: ...

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work: ...

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work: ...

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work: ...

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work: ...


def allreduce_coalesced(
    pg: Collectives, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
) -> dist.Work:
    works = []
    for t in tensors:
        single = AllreduceOptions()
        single.reduceOp = opts.reduceOp
        works.append(pg._do_allreduce([t], single))
    return ComposedWork(works, tensors)


def all_gather_single(
    pg: Collectives, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
) -> dist.Work:
    world = pg.size()
    if output.numel() != input.numel() * world:
        raise ValueError(
            f"all_gather_single: output has {output.numel()} elements, expected "
            f"{input.numel()} x world size {world}"
        )
    chunks = list(output.view(world, *input.shape).unbind(0))
    work = pg._do_allgather([chunks], [input], opts)
    return ComposedWork([work], [output])


def all_gather_single_coalesced(
    pg: Collectives, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions
) -> dist.Work:
    if len(outputs) != len(inputs):
        raise ValueError("all_gather_single_coalesced: outputs and inputs differ in length")
    works = [pg._do_all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
    return ComposedWork(works, outputs)


def reduce_scatter(
    pg: Collectives,
    outputs: list[torch.Tensor],
    inputs: list[list[torch.Tensor]],
    opts: ReduceScatterOptions,
) -> dist.Work:
    # Composite: allreduce the concatenated inputs, keep our slice.
    world, rank = pg.size(), pg.rank()
    if len(outputs) != len(inputs):
        raise ValueError("reduce_scatter: outputs and inputs differ in length")
    works, pairs = [], []
    for out, ins in zip(outputs, inputs, strict=True):
        if len(ins) != world:
            raise ValueError(f"reduce_scatter: expected {world} inputs per output, got {len(ins)}")
        flat = torch.cat([t.reshape(-1) for t in ins])
        single = AllreduceOptions()
        single.reduceOp = opts.reduceOp
        works.append(pg._do_allreduce([flat], single))
        pairs.append((out, flat, [t.numel() for t in ins]))

    def _copy_out() -> None:
        for out, flat, sizes in pairs:
            start = sum(sizes[:rank])
            out.copy_(flat[start : start + sizes[rank]].view_as(out))

    return ComposedWork(works, outputs, _copy_out)


def reduce_scatter_single(
    pg: Collectives, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
) -> dist.Work:
    world, rank = pg.size(), pg.rank()
    if input.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter_single: input has {input.numel()} elements, expected "
            f"{output.numel()} x world size {world}"
        )
    flat = input.reshape(-1).clone()
    single = AllreduceOptions()
    single.reduceOp = opts.reduceOp
    work = pg._do_allreduce([flat], single)
    n = output.numel()

    def _copy_out() -> None:
        output.copy_(flat[rank * n : (rank + 1) * n].view_as(output))

    return ComposedWork([work], [output], _copy_out)


def reduce_scatter_single_coalesced(
    pg: Collectives, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions
) -> dist.Work:
    if len(outputs) != len(inputs):
        raise ValueError("reduce_scatter_single_coalesced: outputs and inputs differ in length")
    works = [pg._do_reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
    return ComposedWork(works, outputs)


def barrier(pg: Collectives, opts: BarrierOptions) -> dist.Work:
    token = torch.zeros(1, device=collective_device(pg))
    return ComposedWork([pg._do_allreduce([token], AllreduceOptions())], [token])


# Rooted collectives. Composites over allreduce / allgather / broadcast, so every group has
# them; the backends that have them natively (gloo, NCCL) override these.


def reduce(pg: Collectives, tensors: list[torch.Tensor], opts: ReduceOptions) -> dist.Work:
    # An allreduce leaves the result on every rank; torch leaves non-root buffers unspecified.
    pg._check_root("reduce", opts.rootRank)
    single = AllreduceOptions()
    single.reduceOp = opts.reduceOp
    return ComposedWork([pg._do_allreduce(tensors, single)], tensors)


def gather(
    pg: Collectives, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions
) -> dist.Work:
    # An allgather into scratch buffers everywhere; the root keeps its copy.
    world, root = pg.size(), opts.rootRank
    pg._check_root("gather", root)
    if len(inputs) != 1:
        raise ValueError(f"gather: expected one input tensor, got {len(inputs)}")
    mine = pg.rank() == root
    if mine and (len(outputs) != 1 or len(outputs[0]) != world):
        raise ValueError(f"gather: the root needs one output list of {world} tensors")
    if not mine and any(outputs):
        raise ValueError("gather: only the root passes output tensors")
    scratch = [torch.empty_like(inputs[0]) for _ in range(world)]
    work = pg._do_allgather([scratch], inputs, AllgatherOptions())

    def _copy_out() -> None:
        if mine:
            for out, got in zip(outputs[0], scratch, strict=True):
                out.copy_(got)

    return ComposedWork([work], outputs, _copy_out)


def scatter(
    pg: Collectives, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
) -> dist.Work:
    # One broadcast per destination rank from the root; each rank keeps its own slice.
    world, root, rank = pg.size(), opts.rootRank, pg.rank()
    pg._check_root("scatter", root)
    if len(outputs) != 1:
        raise ValueError(f"scatter: expected one output tensor, got {len(outputs)}")
    out = outputs[0]
    if rank == root:
        if len(inputs) != 1 or len(inputs[0]) != world:
            raise ValueError(f"scatter: the root needs one input list of {world} tensors")
        slices = [t if k != rank else t.clone() for k, t in enumerate(inputs[0])]
    else:
        if any(inputs):
            raise ValueError("scatter: only the root passes input tensors")
        slices = [out if k == rank else torch.empty_like(out) for k in range(world)]
    works = []
    for t in slices:
        b = BroadcastOptions()
        b.rootRank = root
        works.append(pg._do_broadcast([t], b))

    def _copy_out() -> None:
        if rank == root:
            out.copy_(slices[rank])

    return ComposedWork(works, outputs, _copy_out)

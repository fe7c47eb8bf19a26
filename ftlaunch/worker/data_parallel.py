"""Fault-tolerant DistributedDataParallel: torch's DDP with the gradient allreduce routed through
the Manager, so the replica-group dimension can change size every step.

Torch's DDP gives us bucketing and overlap of communication with backward for free; we hand it a
size-1 placeholder group (nothing to sync at construction) and a comm hook that calls
`Manager.allreduce`. The hook never raises: a failed allreduce is reported to the Manager and the
step is simply not committed — a survivor does not crash because a peer died.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import parallel

from ftlaunch.process_group.work import DoneWork
from ftlaunch.worker.manager import Manager


class _SoloGroup(dist.ProcessGroup):
    """World-size-1 placeholder: DDP's construction-time checks pass without any communication."""

    def __init__(self) -> None:
        # torch binds a (rank, size) constructor for Python subclasses; its stub lists only
        # (store, rank, size).
        super().__init__(0, 1)  # type: ignore[call-arg]

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            outs[0].copy_(inp)
        return DoneWork(output_tensors)

    # DDP calls these positionally as (tensors, opts); the stub's keyword/timeout overload forms
    # are not needed here, hence ignore[override].
    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return DoneWork(tensors)

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return DoneWork(tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return DoneWork(None)

    def size(self) -> int:
        return 1

    def getBackendName(self) -> str:
        return "ftlaunch-solo"


class _HookState:
    def __init__(self, manager: Manager, intra_group: dist.ProcessGroup | None) -> None:
        self.manager = manager
        self.intra_group = intra_group


# No `from __future__ import annotations` in this module: DDP checks the hook's annotations at runtime.
def _comm_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    if state.intra_group is not None:
        # Inside the group every worker holds a full replica: average there first (plain torch PG;
        # if it fails the group's agent restarts the group), then across groups.
        # (SUM then divide: gloo has no AVG.)
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=state.intra_group)
            buf.div_(dist.get_world_size(state.intra_group))
        except Exception as e:  # noqa: BLE001
            state.manager.report_error(e)
    return state.manager.allreduce(buf).get_future()


class DistributedDataParallel(parallel.DistributedDataParallel):
    """``DistributedDataParallel(manager, module)``: DDP across replica groups through the Manager."""

    def __init__(
        self, manager: Manager, module: nn.Module, intra_group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> None:
        """``intra_group``: the replica group's own process group when each of its workers holds a
        full replica (plain DDP inside the group); gradients are averaged there, then across groups.

        Unlike torch's DDP, ``gradient_as_bucket_view`` defaults to True: each ``.grad`` is a view
        into its communication bucket, so the averaged bucket is not copied back into the
        gradients (12 MB a step for the benchmark's MLP; about 7% of its plain-DDP step time) and
        ``zero_grad`` frees nothing. Pass ``gradient_as_bucket_view=False`` if your code replaces
        ``.grad`` tensors or calls ``detach_()`` on them (torch's documented limits of the mode).
        """
        kwargs.setdefault("gradient_as_bucket_view", True)
        # Read by _build_params_for_reducer during DDP's constructor (torch sets its own flag later).
        self._ft_static_graph = bool(kwargs.get("static_graph", False))
        super().__init__(module, process_group=_SoloGroup(), **kwargs)
        self.register_comm_hook(_HookState(manager, intra_group), _comm_hook)
        if any(b.numel() for b in module.buffers()):
            # What the groups share is the parameters and the optimizer's state; buffers a forward
            # pass updates (BatchNorm statistics) follow each group's own data, as each replica's
            # do in torch's DDP. The job's final checksum leaves them out.
            manager.set_agreed_state(lambda state: _without_tensors_of(state, module.buffers()))
        # Fix the bucket layout now. Torch's DDP starts with one all-parameter bucket and rebuilds
        # its buckets after the first iteration, in the order gradients became ready; a restarted
        # group would then allreduce a layout its peers no longer use (wrong gradients, or a gloo
        # size-mismatch abort). So we rebuild at construction: the reducer buckets its parameters
        # in index order, and `_build_params_for_reducer` below hands them over in reverse
        # registration order -- torch's own guess of backward order. The first bucket then holds
        # the last layer, whose gradients are ready first, and its allreduce overlaps the rest of
        # backward. The layout is a function of the module's definition and the bucket caps only,
        # so every group (fresh or long-running) uses the same one at every step.
        self.reducer._push_all_rebuilt_params()
        self.reducer._rebuild_buckets()

    def _build_params_for_reducer(self) -> tuple[list[torch.Tensor], list[bool]]:
        params, sparse = super()._build_params_for_reducer()
        if self.find_unused_parameters and not self._ft_static_graph:
            # Torch never rebuilds in this mode: the constructor's layout is final and DDP already
            # orders its buckets for backward.
            return params, sparse
        return params[::-1], sparse[::-1]


def _without_tensors_of(state: Any, tensors: Any) -> Any:
    """``state`` without the tensors whose memory is one of ``tensors``' (a state dict's entries
    are detached views of the module's own buffers)."""
    ptrs = {t.data_ptr() for t in tensors if t.numel()}

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return None if node.numel() and node.data_ptr() in ptrs else node
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        return node

    return walk(state)


class PureDistributedDataParallel(nn.Module):
    """``PureDistributedDataParallel(manager, module)``: torchft's pure-Python DDP.

    One `Manager.allreduce` per parameter, issued from a post-accumulate-grad hook as soon as
    that gradient is ready; no reducer, no buckets. Simpler to reason about than torch's DDP
    (nothing is rebuilt, every group issues the same allreduces in backward order) but one
    collective per parameter: prefer `DistributedDataParallel` for real models. The gradients are
    averaged in place; the optimizer wrapper's ``should_commit`` waits for all of them.
    """

    def __init__(self, manager: Manager, module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def _allreduce_grad(p: torch.Tensor) -> None:
            if p.grad is not None:
                manager.allreduce(p.grad)

        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_allreduce_grad)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

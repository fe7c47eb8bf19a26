"""The torch-named collectives of `base.ProcessGroup` and the per-op hooks they call.

Why apart from `base`: this is torch's calling surface -- every overload torch's Python functions,
DDP's reducer, functional collectives and FSDP2 use (``allreduce(t, op)`` vs ``allreduce([t],
opts)``, ``_allgather_base``, ``alltoall_base``, ...) normalised to one ``_do_<op>`` hook per
operation -- while `base` is the group's identity, lifecycle and error model. A subclass
implements the hooks its backend has natively; the hooks here default to the composites of
`_composites` (reduce_scatter from allreduce, barrier as a tiny allreduce, ...) or raise
NotImplementedError where no correct fallback exists.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from ftlaunch.process_group import _composites
from ftlaunch.process_group._overloads import plain, tensor_list, with_reduce

__all__ = ["Collectives"]


class Collectives(dist.ProcessGroup):
    """torch's collective methods over ``_do_<op>`` hooks (the base of `base.ProcessGroup`)."""

    # ---- public collectives (torch names and overloads) ------------------------------------
    # Typing: one implementation serves all of a method's overloads in torch's stub, taking them
    # positionally and normalising them (the stub's ``op=``/``timeout=`` keyword forms are not
    # supported), hence ``ignore[override]``. The aliases under torch's other names take the same
    # positional arguments; the stub only names the parameters differently (``ignore[assignment]``).
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._do_allreduce(tensor_list(tensors, "tensors"), with_reduce(opts, AllreduceOptions))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._do_allreduce_coalesced(
            tensor_list(tensors, "tensors"), with_reduce(opts, AllreduceCoalescedOptions)
        )

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        if isinstance(input_tensor, torch.Tensor):
            outputs = [tensor_list(output_tensors, "output_tensors")]
            inputs = [input_tensor]
        else:
            inputs = tensor_list(input_tensor, "input_tensors")
            outputs = [tensor_list(o, "output_tensors[i]") for o in output_tensors]
        return self._do_allgather(outputs, inputs, plain(opts, AllgatherOptions))

    def all_gather_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        return self._do_all_gather_single(output_tensor, input_tensor, plain(opts, AllgatherOptions))

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def all_gather_single_coalesced(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._do_all_gather_single_coalesced(
            tensor_list(output_tensors, "output_tensors"),
            tensor_list(input_tensors, "input_tensors"),
            plain(opts, AllgatherOptions),
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(opts, int):
            root, opts = opts, BroadcastOptions()
            opts.rootRank = root
        return self._do_broadcast(tensor_list(tensors, "tensors"), plain(opts, BroadcastOptions))

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        opts = BroadcastOptions()
        opts.rootRank = root
        return self._do_broadcast([tensor], opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        if isinstance(output_tensors, torch.Tensor):
            outputs = [output_tensors]
            inputs = [tensor_list(input_tensors, "input_tensors")]
        else:
            outputs = tensor_list(output_tensors, "output_tensors")
            inputs = [tensor_list(i, "input_tensors[i]") for i in input_tensors]
        return self._do_reduce_scatter(outputs, inputs, with_reduce(opts, ReduceScatterOptions))

    def reduce_scatter_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        return self._do_reduce_scatter_single(
            output_tensor, input_tensor, with_reduce(opts, ReduceScatterOptions)
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._do_reduce_scatter_single_coalesced(
            tensor_list(output_tensors, "output_tensors"),
            tensor_list(input_tensors, "input_tensors"),
            with_reduce(opts, ReduceScatterOptions),
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def all_to_all_single(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        return self._do_all_to_all_single(
            output_tensor,
            input_tensor,
            list(output_split_sizes),
            list(input_split_sizes),
            plain(opts, AllToAllOptions),
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:
        return self._do_alltoall(
            tensor_list(output_tensors, "output_tensors"),
            tensor_list(input_tensors, "input_tensors"),
            plain(opts, AllToAllOptions),
        )

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> dist.Work:
        return self._do_send(tensor_list(tensors, "tensors"), dst_rank, tag)

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> dist.Work:
        return self._do_recv(tensor_list(tensors, "tensors"), src_rank, tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._do_barrier(plain(opts, BarrierOptions))

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None) -> dist.Work:  # type: ignore[override]
        """``reduce([t], opts)`` (``dist.reduce``) or ``reduce(t, root, op=SUM)``."""
        if isinstance(opts, int):
            root, opts = opts, with_reduce(op, ReduceOptions)
            opts.rootRank = root
        return self._do_reduce(tensor_list(tensors, "tensors"), with_reduce(opts, ReduceOptions))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """``gather([[t] * world] at the root else [], [t], opts)`` (``dist.gather``), or
        ``gather([t] * world, t, root)``."""
        if isinstance(opts, int):
            root, opts = opts, GatherOptions()
            opts.rootRank = root
        if isinstance(input_tensors, torch.Tensor):
            outputs = [tensor_list(output_tensors, "output_tensors")] if output_tensors else []
            inputs = [input_tensors]
        else:
            inputs = tensor_list(input_tensors, "input_tensors")
            outputs = [tensor_list(o, "output_tensors[i]") for o in output_tensors]
        return self._do_gather(outputs, inputs, plain(opts, GatherOptions))

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """``scatter([t], [[t] * world] at the root else [], opts)`` (``dist.scatter``), or
        ``scatter(t, [t] * world, root)``."""
        if isinstance(opts, int):
            root, opts = opts, ScatterOptions()
            opts.rootRank = root
        if isinstance(output_tensors, torch.Tensor):
            outputs = [output_tensors]
            inputs = [tensor_list(input_tensors, "input_tensors")] if input_tensors else []
        else:
            outputs = tensor_list(output_tensors, "output_tensors")
            inputs = [tensor_list(i, "input_tensors[i]") for i in input_tensors]
        return self._do_scatter(outputs, inputs, plain(opts, ScatterOptions))

    def _unsupported(self, op: str) -> NotImplementedError:
        """The error of a hook this backend lacks (`base.ProcessGroup` names its backend)."""
        return NotImplementedError(f"{op} is not supported by the {self._backend_name()} backend")

    def _backend_name(self) -> str:
        return "ftlaunch"

    # ---- hooks: native ops (subclasses) -----------------------------------------------------
    def _do_allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> dist.Work:
        raise self._unsupported("allreduce")

    def _do_allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        raise self._unsupported("allgather")

    def _do_broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        raise self._unsupported("broadcast")

    def _do_all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        raise self._unsupported("all_to_all_single")

    def _do_alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllToAllOptions
    ) -> dist.Work:
        raise self._unsupported("alltoall")

    def _do_send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        raise self._unsupported("send")

    def _do_recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        raise self._unsupported("recv")

    # ---- hooks with composite defaults (see `_composites`) -----------------------------------
    def _do_allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        return _composites.allreduce_coalesced(self, tensors, opts)

    def _do_all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions
    ) -> dist.Work:
        return _composites.all_gather_single(self, output, input, opts)

    def _do_all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: AllgatherOptions
    ) -> dist.Work:
        return _composites.all_gather_single_coalesced(self, outputs, inputs, opts)

    def _do_reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions
    ) -> dist.Work:
        return _composites.reduce_scatter(self, outputs, inputs, opts)

    def _do_reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions
    ) -> dist.Work:
        return _composites.reduce_scatter_single(self, output, input, opts)

    def _do_reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: ReduceScatterOptions
    ) -> dist.Work:
        return _composites.reduce_scatter_single_coalesced(self, outputs, inputs, opts)

    def _do_barrier(self, opts: BarrierOptions) -> dist.Work:
        return _composites.barrier(self, opts)

    # Rooted ops: composites here; the backends that have them natively (gloo, NCCL, Baby) override.
    def _do_reduce(self, tensors: list[torch.Tensor], opts: ReduceOptions) -> dist.Work:
        return _composites.reduce(self, tensors, opts)

    def _do_gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: GatherOptions
    ) -> dist.Work:
        return _composites.gather(self, outputs, inputs, opts)

    def _do_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: ScatterOptions
    ) -> dist.Work:
        return _composites.scatter(self, outputs, inputs, opts)

    def _check_root(self, op: str, root: int) -> None:
        if not 0 <= root < self.size():
            raise ValueError(f"{op}: root rank {root} out of range for world size {self.size()}")

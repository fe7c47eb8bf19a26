"""Staging: a copy of a state dict taken off the training tensors, for readers that must see one
step's state while the training goes on.

Why a copy: the tensors a state dict returns *are* the training tensors (``model.state_dict()``
detaches without copying). Whatever reads them after the training thread moved on -- a heal's
source streaming them to a peer while the next forward pass updates BatchNorm statistics in place,
a checkpoint written in the background while the optimizer steps -- reads a state that never
existed. `stage` copies every tensor once, on the calling thread, at a moment the caller knows to
be consistent (the Manager: the commit boundary); the copy then belongs to the readers.

The copy keeps the tree (dicts, lists, tuples; other leaves are shared: numbers, strings and the
like are immutable), copies each distinct tensor once (tied weights stay tied), makes it
contiguous (what every transport sends), keeps ``requires_grad`` and a DTensor's sharding, and
stays on the tensor's device: a CUDA copy is queued on the current stream, ordered before the
next forward pass's kernels, and `StagedState.wait` waits for it before another thread reads it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StagedState", "stage"]


@dataclass
class StagedState:
    """A state dict copied at ``step``: ``state`` has the caller's tree with every tensor copied."""

    step: int
    state: Any
    #: Bytes of tensor data copied, and how long queuing (CPU: doing) the copies took.
    nbytes: int = 0
    seconds: float = 0.0
    _events: list[Any] = field(default_factory=list, repr=False)

    def wait(self) -> None:
        """Block until the device copies are done (at once for CPU tensors). Any thread."""
        for event in self._events:
            event.synchronize()


def stage(state: Any, step: int) -> StagedState:
    """Copy ``state`` (see the module docstring) on the calling thread."""
    t0 = time.perf_counter()
    copier = _Copier()
    staged = copier.node(state)
    events = []
    for device in copier.cuda_devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return StagedState(step, staged, copier.nbytes, time.perf_counter() - t0, events)


class _Copier:
    def __init__(self) -> None:
        self.copies: dict[int, torch.Tensor] = {}
        self.keepalive: list[torch.Tensor] = []  # keeps ids in `copies` unique while copying
        self.nbytes = 0
        self.cuda_devices: set[torch.device] = set()

    def node(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, collections.defaultdict):
            return collections.defaultdict(x.default_factory, ((k, self.node(v)) for k, v in x.items()))
        if type(x) in (dict, collections.OrderedDict):
            return type(x)((k, self.node(v)) for k, v in x.items())
        if type(x) in (list, tuple):
            return type(x)(self.node(v) for v in x)
        return x

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        done = self.copies.get(id(t))
        if done is not None:
            return done
        src = t.detach()
        if callable(getattr(src, "to_local", None)):  # a DTensor: copy its shard, keep its sharding
            copy = src.clone()
            local = copy.to_local()  # type: ignore[attr-defined]
            self.nbytes += local.numel() * local.element_size()
            device = local.device
        else:
            copy = src.clone(memory_format=torch.contiguous_format)
            self.nbytes += copy.numel() * copy.element_size()
            device = copy.device
        if t.requires_grad and copy.is_floating_point():
            copy.requires_grad_(True)
        if device.type == "cuda":
            self.cuda_devices.add(device)
        self.copies[id(t)] = copy
        self.keepalive.append(t)
        return copy

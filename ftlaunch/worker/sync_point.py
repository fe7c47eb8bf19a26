"""What the algorithms that synchronise every few steps (LocalSGD, DiLoCo) share.

- `take_quorum`: a sync point's quorum. Between sync points groups train alone for many steps, so
  a group that reaches its sync point first (or a restarted group waiting to join) may wait longer
  than the quorum timeout for its peers; that is not a failure, so a quorum timeout is asked again.
- `Buckets`: tensors packed into a few flat buffers, so a sync issues a few large collectives
  instead of one per parameter.
- `local_view` / `wait`: a parameter's local tensor (a DTensor's shard), and waiting on whatever
  ``Manager.allreduce`` returns (a torch Future or a Work: both have ``wait``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ftlaunch.errors import QuorumTimeoutError

#: Bucket size when none is given: large enough that per-collective latency does not matter,
#: small enough to bound the extra memory of a sync.
DEFAULT_BUCKET_CAP_MB = 32.0


class _QuorumManager(Protocol):
    def start_quorum(self) -> None: ...

    def wait_quorum(self) -> None: ...


def take_quorum(manager: _QuorumManager, log: logging.Logger | logging.LoggerAdapter) -> None:
    """Start this sync point's quorum and wait for it, asking again after quorum timeouts.

    Fatal lighthouse errors (unreachable, evicted) are raised; a quorum timeout means the live
    peers are still training towards their own sync point (or this group finished early), and the
    lighthouse forms the quorum as soon as they ask. A peer that is gone or silent leaves the live
    set after the heartbeat timeout, so the wait ends without it.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            manager.start_quorum()
            manager.wait_quorum()
            return
        except QuorumTimeoutError as e:
            log.warning("no quorum yet (attempt %d; peers still before their sync point?): %s", attempt, e)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds of ``t``: a DTensor's local shard (a view), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of what this process holds of ``t`` (a DTensor's local shard), without a
    gradient: torchft's helper of the same name, which DiLoCo code outside torchft calls to back
    parameters up."""
    with torch.no_grad():
        out = local_view(t).detach().clone()
    out.grad = None
    return out


def wait(work: Any) -> None:
    """Wait for what ``Manager.allreduce`` returned (a torch Future or a Work)."""
    work.wait()


class Buckets:
    """Flat buffers with room for ``tensors`` (not filled), at most ``cap_mb`` each, one dtype and device
    each.

    ``views[i]`` is tensor ``i``'s place in its buffer, shaped like it. ``cap_mb=None`` gives each
    tensor its own buffer (one collective per tensor, as torchft without bucketization).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], cap_mb: float | None = DEFAULT_BUCKET_CAP_MB) -> None:
        cap = None if cap_mb is None else max(1, int(cap_mb * 1024 * 1024))
        layout: list[list[int]] = []  # indices of `tensors` per bucket
        for i, t in enumerate(tensors):
            if layout:
                first = tensors[layout[-1][0]]
                size = sum(tensors[j].numel() for j in layout[-1]) * first.element_size()
                fits = cap is not None and size + t.numel() * t.element_size() <= cap
                if fits and (first.dtype, first.device) == (t.dtype, t.device):
                    layout[-1].append(i)
                    continue
            layout.append([i])
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for members in layout:
            first = tensors[members[0]]
            buf = torch.empty(
                sum(tensors[j].numel() for j in members), dtype=first.dtype, device=first.device
            )
            offset = 0
            for j in members:
                n = tensors[j].numel()
                self.views[j] = buf[offset : offset + n].view(tensors[j].shape)
                offset += n
            self.buffers.append(buf)

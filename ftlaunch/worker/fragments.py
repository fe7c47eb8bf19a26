"""A DiLoCo model fragment: its global (outer) parameters and its outer step; splitting a model.

A `Fragment` keeps the global parameters of its modules' parameters on a backup device, computes
pseudo-gradients (global - local) into flat buffers, and applies the outer optimizer to them. The
schedule and the fault tolerance around it are `ftlaunch.worker.local_sgd.DiLoCo`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ftlaunch.worker.sync_point import Buckets, local_view


class Fragment:
    """One model fragment: its global (outer) parameters, kept on ``backup_device``, and its
    outer optimizer."""

    def __init__(self, module: nn.Module, outer: torch.optim.Optimizer, backup_device: torch.device,
                 pin_memory: bool) -> None:  # fmt: skip
        named = list(module.named_parameters())
        if not named:
            raise ValueError("a model fragment has no parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.outer = outer
        pin = pin_memory and backup_device.type == "cpu" and torch.cuda.is_available()
        self.backup = [
            torch.empty(local_view(p).shape, dtype=p.dtype, device=backup_device, pin_memory=pin)
            for p in self.params
        ]

    @property
    def original_parameters(self) -> dict[str, torch.Tensor]:
        """The global parameters by name (torchft's ``Fragment.original_parameters``)."""
        return self.state_dict()

    def save_parameters(self) -> None:
        """torchft's name of `save_global`: back the current parameters up as the global ones."""
        self.save_global()

    def locals(self) -> list[torch.Tensor]:
        return [local_view(p.detach()) for p in self.params]

    @torch.no_grad()
    def save_global(self) -> None:
        for b, p in zip(self.backup, self.locals(), strict=True):
            b.copy_(p)

    @torch.no_grad()
    def restore(self) -> None:
        for b, p in zip(self.backup, self.locals(), strict=True):
            p.copy_(b)

    @torch.no_grad()
    def pseudo_gradients(self, bucket_cap_mb: float | None) -> Buckets:
        """Global - local parameters, in flat buffers."""
        local = self.locals()
        grads = Buckets(local, bucket_cap_mb)
        for b, p, g in zip(self.backup, local, grads.views, strict=True):
            torch.sub(b.to(p.device, non_blocking=True), p, out=g)
        return grads

    @torch.no_grad()
    def copy_locals(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.locals()]

    @torch.no_grad()
    def outer_step(self, averaged: Buckets) -> None:
        """Global parameters (already in the model) <- outer optimizer step with ``averaged``."""
        # Only this fragment's parameters may have a gradient during the step: the outer optimizer
        # may span the whole model, whose other parameters still hold the last inner gradient.
        saved = [(q, q.grad) for group in self.outer.param_groups for q in group["params"]]
        for q, _ in saved:
            q.grad = None
        for p, g in zip(self.params, averaged.views, strict=True):
            p.grad = _like_param(p, g)
        self.outer.step()
        for q, grad in saved:
            q.grad = grad
        self.save_global()

    @torch.no_grad()
    def merge(self, local: list[torch.Tensor], alpha: float) -> None:
        """Model <- global + alpha (local - global): Streaming DiLoCo's mixing of the two."""
        for p, mine in zip(self.locals(), local, strict=True):
            p.lerp_(mine, alpha)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.backup, strict=True))

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in sd]
        if missing:
            raise ValueError(f"DiLoCo state has no global parameters {missing}")
        for n, b in zip(self.names, self.backup, strict=True):
            b.copy_(sd[n])


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``p``: a DTensor with ``p``'s placement when ``p`` is one."""
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


def split_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """``model``'s parameters in ``n`` contiguous fragments of about equal size (registration
    order, so roughly by layer), each a module holding them (``nn.ParameterList``)."""
    params = [p for p in model.parameters()]
    if not 1 <= n <= len(params):
        raise ValueError(f"cannot split {len(params)} parameters into {n} fragments")
    total = sum(p.numel() for p in params)
    fragments: list[list[nn.Parameter]] = [[] for _ in range(n)]
    k, done = 0, 0
    for i, p in enumerate(params):
        # The fragment this parameter's middle falls in; fragments stay contiguous, none empty.
        want = min(int((done + p.numel() / 2) * n / total), n - 1)
        k = 0 if i == 0 else min(max(want, k, n - (len(params) - i)), k + 1)
        fragments[k].append(p)
        done += p.numel()
    return [nn.ParameterList(f) for f in fragments]

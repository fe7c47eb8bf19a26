"""ftlaunch DDP in one process: the bucket layout must not depend on how long a group has run."""

from __future__ import annotations

import torch
from torch import nn

from ftlaunch.data_parallel import DistributedDataParallel


class _RecordingManager:
    """Stands in for the Manager when alone: returns each bucket unchanged."""

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return fut

    def report_error(self, e: Exception) -> None:
        raise AssertionError(f"unexpected error {e}")


def _layout_per_iteration(iterations: int) -> list[list[int]]:
    """Sizes of the allreduced buckets, in launch order, for each iteration."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)])
    mgr = _RecordingManager()
    ddp = DistributedDataParallel(mgr, model, bucket_cap_mb=1)  # type: ignore[arg-type]
    seen: list[list[int]] = []
    passthrough = mgr.allreduce

    def record(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        seen[-1].append(tensor.numel())
        return passthrough(tensor)

    mgr.allreduce = record  # type: ignore[method-assign]
    for _ in range(iterations):
        seen.append([])
        ddp(torch.randn(2, 256)).sum().backward()
    return seen


def test_bucket_layout_is_the_same_at_every_iteration() -> None:
    layouts = _layout_per_iteration(3)
    assert len(layouts[0]) > 1, "expected several buckets with a 1 MB cap"
    assert layouts[0] == layouts[1] == layouts[2]


def test_gradients_pass_through_the_manager_unchanged_when_alone() -> None:
    torch.manual_seed(0)
    a = nn.Linear(4, 3)
    b = nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    ddp = DistributedDataParallel(_RecordingManager(), b)  # type: ignore[arg-type]
    x = torch.randn(5, 4)
    a(x).pow(2).sum().backward()
    ddp(x).pow(2).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad)

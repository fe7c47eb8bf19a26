"""ftlaunch DDP in one process: the bucket layout must not depend on how long a group has run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ftlaunch.worker.data_parallel import DistributedDataParallel, _comm_hook
from ftlaunch.worker.managed_work import ManagedWork

_REAL_HOOK = _comm_hook


class _RecordingManager:
    """Stands in for the Manager when alone: returns each bucket unchanged."""

    def allreduce(self, tensor: torch.Tensor) -> ManagedWork:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return ManagedWork(fut, lambda: False, self.report_error)

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

    def record(tensor: torch.Tensor) -> ManagedWork:
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


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


def _named_layouts(
    model: nn.Module, iterations: int, monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> list[list[Any]]:
    """For each iteration, each allreduced bucket in launch order: (its size, its parameter names)."""
    import ftlaunch.worker.data_parallel as dp

    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[list[Any]] = []

    def recording_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations
        seen[-1].append((bucket.buffer().numel(), [names[id(p)] for p in bucket.parameters()]))
        return _REAL_HOOK(state, bucket)

    monkeypatch.setattr(dp, "_comm_hook", recording_hook)  # DDP registers the hook at construction
    ddp = DistributedDataParallel(_RecordingManager(), model, **kwargs)  # type: ignore[arg-type]
    for _ in range(iterations):
        seen.append([])
        ddp(torch.randn(2, 512)).sum().backward()
    return seen


@pytest.mark.parametrize(
    "kwargs", [{}, {"bucket_cap_mb": 1}, {"static_graph": True}, {"find_unused_parameters": True}]
)
def test_fresh_and_long_running_instances_use_the_same_layout(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict
) -> None:
    """A restarted group (fresh DDP) must allreduce exactly the buckets its long-running peers do."""
    long_running = _named_layouts(_mlp(), 5, monkeypatch, **kwargs)
    fresh = _named_layouts(_mlp(), 1, monkeypatch, **kwargs)
    sizes = [[n for n, _ in layout] for layout in long_running + fresh]
    assert all(s == sizes[0] for s in sizes), sizes
    # (With static_graph torch delays the first iteration's allreduce and its GradBucket reports a
    # wrong parameter list, though the buffers are right; the names are compared from then on.)
    named = long_running[1:] if kwargs.get("static_graph") else long_running + fresh
    assert all(layout == named[0] for layout in named), named
    assert sorted(n for _, b in named[0] for n in b) == sorted(n for n, _ in _mlp().named_parameters())


def test_buckets_are_in_backward_order_so_communication_overlaps_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 1 MB cap: each 512x512 float weight (1 MB) closes a bucket.
    (layout,) = _named_layouts(_mlp(), 1, monkeypatch, bucket_cap_mb=1)
    assert len(layout) == 3, layout
    assert set(layout[0][1]) == {"4.weight", "4.bias"}, "the last layer's gradients are ready first"
    assert set(layout[-1][1]) == {"0.weight", "0.bias"}


def test_gradients_are_bucket_views_by_default_and_the_option_is_respected() -> None:
    assert DistributedDataParallel(_RecordingManager(), _mlp()).gradient_as_bucket_view is True  # type: ignore[arg-type]
    ddp = DistributedDataParallel(_RecordingManager(), _mlp(), gradient_as_bucket_view=False)  # type: ignore[arg-type]
    assert ddp.gradient_as_bucket_view is False


def test_a_step_whose_cross_group_pg_failed_is_not_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Manager.allreduce skips an errored PG without reporting; should_commit must still refuse."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from ftlaunch.lighthouse.server import LighthouseServer
    from ftlaunch.process_group import ProcessGroupDummy
    from ftlaunch.worker.manager import Manager

    class FailingDummy(ProcessGroupDummy):
        failure: Exception | None = None

        def errored(self) -> Exception | None:
            return self.failure

    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with LighthouseServer("127.0.0.1:0", min_replicas=2, join_timeout=5.0, quorum_tick=0.05).start() as lh:
        pgs = [FailingDummy(0, 1), FailingDummy(0, 1)]
        managers = [
            Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                replica_id=f"rg{i}",
                lighthouse_addr=lh.address,
                init_sync=False,
                timeout=timedelta(seconds=10),
            )
            for i, pg in enumerate(pgs)
        ]
        try:
            for step in range(2):
                if step == 1:
                    pgs[1].failure = RuntimeError("gloo: connection reset by peer")
                # Together: a first step waits for its quorum (it may heal before its forward pass).
                with ThreadPoolExecutor(2) as pool:
                    list(pool.map(lambda m: m.start_quorum(), managers))
                for m in managers:
                    m.allreduce(torch.ones(4)).wait()
                committed = [m.should_commit() for m in managers]
                assert committed == [True, step == 0], (step, committed)
            assert isinstance(managers[1].errored(), RuntimeError)
        finally:
            for m in managers:
                m.shutdown()


def test_pure_ddp_allreduces_each_gradient_through_the_manager() -> None:
    from ftlaunch import PureDistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    frozen = model[0].bias
    frozen.requires_grad_(False)
    local = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    local.load_state_dict(model.state_dict())
    mgr = _RecordingManager()
    seen: list[tuple[int, ...]] = []
    passthrough = mgr.allreduce

    def record(tensor: torch.Tensor) -> ManagedWork:
        seen.append(tuple(tensor.shape))
        return passthrough(tensor.mul_(0.5))  # the "average" the test can see

    mgr.allreduce = record  # type: ignore[method-assign]
    pure = PureDistributedDataParallel(mgr, model)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    pure(x).sum().backward()
    local(x).sum().backward()
    # one allreduce per trainable parameter, in backward order (last layer first)
    assert seen == [(2,), (2, 5), (5, 4)]
    for (name, p), q in zip(model.named_parameters(), local.parameters(), strict=True):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad * 0.5), name
    assert frozen.grad is None

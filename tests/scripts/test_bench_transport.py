"""scripts/bench_transport.py's baselines move the bytes they are timed on: the memcpy and the bare
loopback connection land exactly the source's tensors (fresh or in place), and each transfer's
figure is printed as a multiple of the memcpy measured beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_transport  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("baseline", [bench_transport.memcpy_seconds, bench_transport.socket_seconds])
def test_a_baseline_lands_the_sources_bytes(baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    src = bench_transport.make_state(1 << 20, 4, seed=2)
    mine = bench_transport.make_state(1 << 20, 4, seed=1)
    assert baseline(src, mine) > 0
    assert all(torch.equal(mine["model"][k], v) for k, v in src["model"].items())
    landed = []
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: landed.append(real_empty_like(t)) or landed[-1])
    assert baseline(src, None) > 0
    assert [torch.equal(a, b) for a, b in zip(landed, src["model"].values(), strict=True)] == [True] * 4


def test_a_figure_is_printed_as_a_multiple_of_its_memcpy() -> None:
    lines = bench_transport._rates_line(
        "HTTP fresh", 10**9, [2.0, 3.0, 4.0], [1.0, 1.0, 1.0], [1.5, 1.5, 1.5]
    )
    assert "0.33 GB/s" in lines[0]
    assert "1.00 GB/s" in lines[1] and "3.00x memcpy's time" in lines[1] and "target <= 2x" in lines[1]
    assert "1.50x memcpy's time" in lines[2]

"""Low-bit codes: the round-trip error bound, the byte format, and the quantized allreduce on a fake
world and on real Gloo processes (different inputs per rank; every rank must end bit-identical)."""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pg_helpers import STATE, WorkerPool

from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupGloo
from ftlaunch.process_group.fake import FakeProcessGroup
from ftlaunch.worker import quantization as q

pytestmark = pytest.mark.timeout(120)


def bound(x: torch.Tensor, bits: q.Bits, block: int = q.BLOCK_SIZE) -> torch.Tensor:
    """Per-element bound of one round trip: half a step of its block, plus float32 rounding."""
    absmax = x.reshape(-1, block).abs().amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)
    return absmax / (2 * q.QMAX[bits]) * (1 + 1e-6) + 1e-30


def signal_with_outliers(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 1, n // q.BLOCK_SIZE).repeat_interleave(q.BLOCK_SIZE)
    x[7] = 1e3  # one outlier: only its block's resolution suffers
    x[q.BLOCK_SIZE : 2 * q.BLOCK_SIZE] = 0  # an all-zero block stays exactly zero
    return x


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_at_most_half_a_step_of_each_block(bits: q.Bits) -> None:
    x = signal_with_outliers(64 * q.BLOCK_SIZE, seed=bits)
    codes, scales = q.quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() * bits // 8
    assert scales.numel() == x.numel() // q.BLOCK_SIZE
    y = q.dequantize(codes, scales, bits)
    assert ((x - y).abs() <= bound(x, bits)).all()
    assert y[q.BLOCK_SIZE : 2 * q.BLOCK_SIZE].eq(0).all()
    # Blocks far from the outlier keep their own resolution (per-block scales).
    far = slice(32 * q.BLOCK_SIZE, 33 * q.BLOCK_SIZE)
    assert (x[far] - y[far]).abs().max() <= x[far].abs().max() / (2 * q.QMAX[bits]) * (1 + 1e-6)
    # The extreme codes are used: the largest element of a block is exact up to float rounding.
    i = int(x[far].abs().argmax()) + far.start
    assert torch.isclose(y[i], x[i], rtol=1e-6, atol=0)


def test_four_bit_codes_use_both_nibbles_and_the_full_range() -> None:
    x = torch.tensor([-7.0, 7.0, 0.0, 3.0] * (q.BLOCK_SIZE // 4))
    codes, scales = q.quantize(x, 4)
    assert scales.tolist() == [1.0] and codes[:2].tolist() == [1 | (15 << 4), 8 | (11 << 4)]
    assert torch.equal(q.dequantize(codes, scales, 4), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_encode_decode_rows_hold_scales_then_codes(bits: q.Bits) -> None:
    x = torch.randn(3 * 2 * q.BLOCK_SIZE)
    rows = q.encode(x, 3, bits)
    assert rows.shape == (3, q.encoded_nbytes(2 * q.BLOCK_SIZE, bits))
    codes, scales = q.quantize(x, bits)
    assert torch.equal(q.decode(rows, bits).reshape(-1), q.dequantize(codes, scales, bits))


def test_argument_checks() -> None:
    assert q.bits_of(True) == 8 and q.bits_of(8) == 8 and q.bits_of(4) == 4
    for bad in (2, 16, False):
        with pytest.raises(ValueError):
            q.bits_of(bad)
    with pytest.raises(ValueError, match="floating point"):
        q.check_quantizable(torch.zeros(3, dtype=torch.int64), "sum")
    with pytest.raises(ValueError, match="only avg and sum"):
        q.check_quantizable(torch.zeros(3), dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="whole blocks"):
        q.quantize(torch.zeros(q.BLOCK_SIZE + 1), 8)
    assert q.padded_numel(1, 3) == 3 * q.BLOCK_SIZE and q.padded_numel(1000, 2) == 2 * 2 * q.BLOCK_SIZE


@pytest.mark.parametrize("bits", [8, 4])
def test_allreduce_on_a_fake_world_sums_within_two_round_trips(bits: q.Bits) -> None:
    # Identical peers gather *our* reduced chunk in every slot, so the tensor fits in chunk 0.
    pg = FakeProcessGroup(world_size=3)
    x = torch.randn(200, dtype=torch.float64).reshape(2, 100)
    out = x.clone()
    assert q.allreduce_quantized(pg, out, bits).wait() is out
    exact = 3 * x.reshape(-1)
    flat = torch.zeros(q.padded_numel(200, 3))
    flat[:200] = x.reshape(-1).float()
    summed = torch.zeros_like(flat)
    summed[:200] = exact.float()
    err = 3 * bound(flat, bits)[:200] + bound(summed, bits)[:200]  # each input's round trip, then the sum's
    assert out.dtype == torch.float64 and ((out.reshape(-1) - exact).abs() <= err * 1.01).all()
    assert [op.name for op in pg.ops] == ["all_to_all_single", "allgather"]


def test_a_failed_collective_fails_the_future_and_leaves_the_tensor() -> None:
    pg = FakeProcessGroup(world_size=2)
    pg.fail_next("allgather", RuntimeError("connection reset"))
    x = torch.ones(10)
    fut = q.allreduce_quantized(pg, x, 8)
    with pytest.raises(Exception, match="connection reset"):
        fut.wait()
    assert x.eq(1).all()


# ------------------------------------------------------------------------------ real Gloo processes


def _join(kind: str, store_addr: str, rank: int, world: int) -> None:
    pg: Any = (
        ProcessGroupGloo(timeout=timedelta(seconds=30))
        if kind == "gloo"
        else ProcessGroupBabyGloo(timeout=30)
    )
    pg.configure(store_addr, rank, world)
    STATE["pg"] = pg


def _reduce(rank: int, bits: q.Bits, n: int) -> tuple[list[float], list[float]]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1)
    out = x.clone()
    q.allreduce_quantized(STATE["pg"], out, bits).wait()
    return x.tolist(), out.tolist()


@pytest.mark.parametrize("kind", ["baby", pytest.param("gloo", marks=pytest.mark.slow)])
def test_allreduce_on_real_gloo_is_bit_identical_everywhere_and_within_the_bound(kind: str) -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    try:
        with WorkerPool(3) as pool:
            addr = f"127.0.0.1:{server.port}/quant-{kind}"
            pool.run([0, 1, 2], _join, [(kind, addr, r, 3) for r in range(3)], timeout=90)
            for bits, n in ((8, 5000), (4, 777)):
                results = pool.run([0, 1, 2], _reduce, [(r, bits, n) for r in range(3)], timeout=60)
                inputs = [torch.tensor(x) for x, _ in results]
                outs = [torch.tensor(o) for _, o in results]
                assert all(torch.equal(outs[0], o) for o in outs[1:])  # every rank: the same bytes
                exact = sum(inputs)
                pad = q.padded_numel(n, 3)
                err = torch.zeros(n)
                for x in [*inputs, exact]:
                    flat = torch.zeros(pad)
                    flat[:n] = x
                    err += bound(flat, bits)[:n]
                assert ((outs[0] - exact).abs() <= err * 1.01).all(), (bits, (outs[0] - exact).abs().max())
                assert (outs[0] - exact).abs().mean() < 0.5 * err.mean()  # rounding errors partly cancel
    finally:
        del server
        gc.collect()

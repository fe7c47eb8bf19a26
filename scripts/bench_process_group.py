#!/usr/bin/env python
"""Benchmark ftlaunch process groups against plain torch gloo (2 processes on this machine).

Prints, per tensor size, the all-reduce time and throughput of
  * plain gloo (``init_process_group("gloo")`` + ``dist.all_reduce(t)``) - the baseline,
  * ftlaunch ``ProcessGroupGloo``      (``dist.all_reduce(t, group=pg)``), target >= 0.95x,
  * ftlaunch ``ProcessGroupBabyGloo``  (``dist.all_reduce(t, group=pg)``), target >= 0.85x at >= 1 MB,
and the reconfigure latency of BabyGloo with its healthy child reused (target <= 100 ms) versus
with a new child, plus ProcessGroupGloo's for reference.

The three groups are measured in many short interleaved rounds (rotating order); the ratio to
plain gloo is the median over rounds of the same-round ratio, so the load of other processes on
a shared machine affects both sides of each ratio alike.

    python scripts/bench_process_group.py [--rounds 5] [--sizes 4K,1M,16M,64M]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}


def _iters(nbytes: int) -> int:
    # Short measurements (~50-150 ms), many rounds: pairs measured close in time see the same load.
    return max(2, min(200, int(48 * (1 << 20) / max(nbytes, 1 << 18))))


def _worker(rank: int, port: int, sizes: list[str], rounds: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupGloo, create_store_client

    world = 2
    addr = f"127.0.0.1:{port}"
    dist.init_process_group("gloo", store=create_store_client(f"{addr}/plain"), rank=rank, world_size=world)
    ft = ProcessGroupGloo(timeout=timedelta(seconds=60))
    ft.configure(f"{addr}/ft0", rank, world)
    baby = ProcessGroupBabyGloo(timeout=60.0)
    baby.configure(f"{addr}/baby0", rank, world)
    groups = {"plain gloo": None, "ftlaunch Gloo": ft, "ftlaunch BabyGloo": baby}

    results: dict[str, dict[str, list[float]]] = {s: {g: [] for g in groups} for s in sizes}
    for size in sizes:
        nbytes = SIZES[size]
        # One tensor per group, as a user would have (Baby moves its tensor to shared memory on
        # first use; plain gloo and ftlaunch Gloo keep ordinary memory).
        tensors = {name: torch.ones(nbytes // 4) for name in groups}
        n = _iters(nbytes)
        for name, g in groups.items():  # warm-up
            for _ in range(3):
                dist.all_reduce(tensors[name], group=g)
        order = list(groups)
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:  # rotate the order
                g, t = groups[name], tensors[name]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t, group=g)
                results[size][name].append((time.perf_counter() - start) / n)

    # Reconfigure latency (both ranks reconfigure together, as a Manager would).
    reconf: dict[str, list[float]] = {"BabyGloo, child reused": [], "BabyGloo, new child": [], "Gloo": []}
    pid = baby.child_pid
    for i in range(10):
        dist.barrier()
        start = time.perf_counter()
        baby.configure(f"{addr}/baby-r{i}", rank, world)
        reconf["BabyGloo, child reused"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        ft.configure(f"{addr}/ft-r{i}", rank, world)
        reconf["Gloo"].append(time.perf_counter() - start)
    reused = baby.child_pid == pid
    for i in range(3):
        dist.barrier()
        start = time.perf_counter()
        baby.abort()  # kills the child: the next configure must start a new one
        baby.configure(f"{addr}/baby-n{i}", rank, world)
        reconf["BabyGloo, new child"].append(time.perf_counter() - start)
    baby.shutdown()
    ft.shutdown()
    dist.destroy_process_group()
    conn.send((results, reconf, reused))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--sizes", default="4K,1M,16M,64M")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    for s in sizes:
        if s not in SIZES:
            parser.error(f"unknown size {s!r}; choose from {','.join(SIZES)}")

    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_worker, args=(r, server.port, sizes, args.rounds, pipes[r][1])) for r in range(2)
    ]
    for p in procs:
        p.start()
    results, reconf, reused = pipes[0][0].recv()
    pipes[1][0].recv()
    for p in procs:
        p.join(60)

    print(f"all-reduce, 2 processes, gloo on loopback, {args.rounds} interleaved rounds (rotating order)")
    print("ratio = median over rounds of (plain time / group time) measured in the same round: pairs")
    print("close in time see the same load from other processes; targets are checked on it")
    print(f"{'size':>5} {'group':<18} {'median time/op':>14} {'throughput':>12} {'ratio':>7}  target")
    for size in sizes:
        plain = results[size]["plain gloo"]
        for name, times in results[size].items():
            med = statistics.median(times)
            ratio = statistics.median(p / t for p, t in zip(plain, times, strict=True))
            target = {
                "ftlaunch Gloo": 0.95,
                "ftlaunch BabyGloo": 0.85 if SIZES[size] >= 1 << 20 else None,
            }.get(name)
            mark = "" if target is None else f">= {target:.2f} {'ok' if ratio >= target else 'MISSED'}"
            gbs = SIZES[size] / med / 1e9
            print(f"{size:>5} {name:<18} {med * 1e3:>11.3f} ms {gbs:>7.3f} GB/s {ratio:>6.2f}x  {mark}")
    print()
    print(f"reconfigure latency (2 ranks), median [min..max]; Baby child reused across configure: {reused}")
    for name, times in reconf.items():
        med = statistics.median(times)
        target = (
            "  target <= 100 ms " + ("ok" if med <= 0.1 else "MISSED")
            if name == "BabyGloo, child reused"
            else ""
        )
        print(f"  {name:<24} {med * 1e3:8.1f} ms  [{min(times) * 1e3:.1f}..{max(times) * 1e3:.1f}]{target}")


if __name__ == "__main__":
    main()

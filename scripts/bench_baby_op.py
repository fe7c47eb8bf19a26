#!/usr/bin/env python
"""What one Baby process-group op costs beside the same op on the backend itself, and where it goes.

Two processes (ranks of one group); each times, in interleaved rounds, an allreduce issued and waited
for -- with ``torch.cuda.synchronize()`` on a GPU -- on

  * the plain backend (torch's NCCL or Gloo group, in the process): the baseline, and
  * ftlaunch's Baby group (the same backend in a child process: CUDA IPC and events on a GPU,
    shared memory on CPU),

for a one-element int32 MIN read back with ``.item()`` (the commit vote's shape) and for a gradient
bucket (16 MiB by default, the same tensor every time, as DDP's buckets are). Then rank 0 profiles
its Baby ops (``cProfile``) and prints the functions with the most time of their own: what the hop
costs per op, by step (the tensor's IPC handle, the events, the pickling, the wait).

    python scripts/bench_baby_op.py [--cpu] [--rounds 15] [--iters 50] [--bucket-mib 16]

On one GPU both ranks share it, each with its own NCCL host id (``scripts/gpu_check.py`` explains
why), so NCCL talks over loopback sockets: the baseline is latency-bound and only the difference
(the Baby hop) is meant to be read. Numbers are per op, medians over rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MARK = "BABYOP"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(rank: int, port: int, cuda: bool, rounds: int, iters: int, bucket_numel: int) -> None:
    if cuda:  # a host id of its own: two NCCL ranks may then share one GPU
        os.environ["NCCL_HOSTID"] = f"ftlaunch-bench-baby-op-{os.getpid()}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupBabyNCCL

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.PrefixStore("plain", store), rank=rank, world_size=2
    )
    plain = dist.group.WORLD
    baby = ProcessGroupBabyNCCL(timeout=60) if cuda else ProcessGroupBabyGloo(timeout=60)
    baby.configure(f"127.0.0.1:{port}/baby", rank, 2)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    vote = torch.ones(1, dtype=torch.int32, device=device)
    bucket = torch.ones(bucket_numel, dtype=torch.float32, device=device)

    def vote_op(pg: Any) -> None:
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=pg)
        vote.item()

    def bucket_op(pg: Any) -> None:
        dist.all_reduce(bucket, group=pg)
        sync()

    def timed(op: Any, pg: Any) -> float:
        dist.barrier(group=plain)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            op(pg)
        return (time.perf_counter() - t0) / iters * 1e3

    for op in (vote_op, bucket_op):  # warm up: communicators, IPC handles, shared memory
        for pg in (plain, baby):
            for _ in range(3):
                op(pg)
    results: dict[str, list[float]] = {
        k: [] for k in ("vote_plain", "vote_baby", "bucket_plain", "bucket_baby")
    }
    for r in range(rounds):
        order = [(plain, "plain"), (baby, "baby")][:: 1 if r % 2 == 0 else -1]
        for op, name in ((vote_op, "vote"), (bucket_op, "bucket")):
            for pg, which in order:
                results[f"{name}_{which}"].append(timed(op, pg))
    profile = ""
    if rank == 0:
        prof = cProfile.Profile()
        dist.barrier(group=plain)
        prof.enable()
        for _ in range(iters):
            vote_op(baby)
            bucket_op(baby)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(14)
        profile = out.getvalue()
    else:
        dist.barrier(group=plain)
        for _ in range(iters):
            vote_op(baby)
            bucket_op(baby)
    sync()
    dist.barrier(group=plain)
    baby.shutdown()
    dist.destroy_process_group()
    medians = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"{MARK} {json.dumps({'rank': rank, 'ms': medians, 'profile': profile, 'iters': iters})}", flush=True
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="Gloo and Baby Gloo even where CUDA is available")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=50, help="ops per timing (and profiled per kind)")
    parser.add_argument("--bucket-mib", type=float, default=16.0)
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, port, cuda, rounds, iters, numel = (int(x) for x in args.worker)
        worker(rank, port, bool(cuda), rounds, iters, numel)
        return 0
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    numel = max(1, int(args.bucket_mib * 2**20 / 4))
    port = _free_port()
    envs = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    cmd = [sys.executable, __file__, "--worker"]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), str(port), str(int(cuda)), str(args.rounds), str(args.iters), str(numel)],
            stdout=subprocess.PIPE,
            text=True,
            env=envs,
        )  # fmt: skip
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode:
            print(f"bench_baby_op: a rank exited {p.returncode}", file=sys.stderr)
            return 1
        outs.append(out)
    rank0 = next(json.loads(line.split(" ", 1)[1]) for line in outs[0].splitlines() if line.startswith(MARK))
    ms = rank0["ms"]
    backend = "NCCL" if cuda else "Gloo"
    print(
        f"per op, median of {args.rounds} rounds x {args.iters} ops, rank 0 "
        f"({backend}, torch {torch.__version__}):"
    )
    for kind, what in (
        ("vote", "1 x int32 MIN + .item()"),
        ("bucket", f"{args.bucket_mib:g} MiB float32 SUM"),
    ):
        plain, baby = ms[f"{kind}_plain"], ms[f"{kind}_baby"]
        print(
            f"  {what:<28} plain {backend} {plain:8.3f} ms   Baby {backend} {baby:8.3f} ms   "
            f"hop +{baby - plain:.3f} ms ({baby / plain:.2f}x)"
        )
    print(f"profile of rank 0's Baby ops ({args.iters} of each kind), by own time:")
    print(rank0["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A small, real fault-tolerant DDP training run (torchft-style long form).

An MLP learns a fixed random linear "teacher" from synthetic batches. Each replica group (and each
worker inside it) draws different batches; gradients are averaged inside the group and across
groups through the Manager. Logs one line per step and, at the end, a checksum of the weights so
runs can check that every group ended bit-identical.

By hand, against a lighthouse (see README)::

    ftlaunch-lighthouse --bind 127.0.0.1:29510 --min-replicas 1 &
    REPLICA_GROUP_ID=0 FTLAUNCH_LIGHTHOUSE=http://127.0.0.1:29510 python scripts/train_ddp.py --steps 50
    REPLICA_GROUP_ID=1 FTLAUNCH_LIGHTHOUSE=http://127.0.0.1:29510 python scripts/train_ddp.py --steps 50
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ftlaunch import env
from ftlaunch.data_parallel import DistributedDataParallel
from ftlaunch.manager import Manager
from ftlaunch.optim import Optimizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="committed steps to train (default 100)")
    p.add_argument("--width", type=int, default=256, help="hidden width of the 3-layer MLP")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--backend", choices=["gloo", "baby-gloo"], default="gloo",
                   help="cross-group process group (default gloo)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (demos, chaos)")
    p.add_argument("--timeout", type=float, default=30.0, help="collective/heal timeout in seconds")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--transport", choices=["http", "pg"], default="http", help="live-recovery transport")
    p.add_argument("--max-seconds", type=float, default=600.0, help="give up after this long (safety net)")
    return p.parse_args(argv)


def make_model(width: int) -> nn.Module:
    torch.manual_seed(int(os.environ.get(env.REPLICA_GROUP_ID, "0")) + 1000)  # groups start different
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8))


def batch(step: int, group: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1_000_003 + group * 1009 + rank)
    x = torch.randn(size, 64, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(64, 8, generator=teacher)
    return x, x @ w


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    group = env.get_int(env.REPLICA_GROUP_ID, 0) or 0
    rank = env.get_int(env.RANK, 0) or 0
    world = env.get_int(env.WORLD_SIZE, 1) or 1
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rg{group}/r{rank}] %(message)s")
    log = logging.getLogger("train_ddp")

    intra = None
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        intra = dist.group.WORLD

    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    pg = (ProcessGroupBabyGloo(timeout=timedelta(seconds=args.timeout)) if args.backend == "baby-gloo"
          else ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)))
    model = make_model(args.width)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    transport = None
    if args.transport == "pg":
        from ftlaunch.checkpointing import PGTransport

        transport = PGTransport(pg, timeout=timedelta(seconds=args.timeout), device=torch.device("cpu"))
    manager = Manager(
        pg=pg, load_state_dict=load_state, state_dict=save_state, min_replica_size=1,
        timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=args.quorum_timeout),
        checkpoint_transport=transport,
    )
    ddp = DistributedDataParallel(manager, model, intra_group=intra)
    opt = Optimizer(manager, inner)
    loss_fn = nn.MSELoss()
    deadline = time.monotonic() + args.max_seconds
    try:
        while manager.current_step() < args.steps:
            if time.monotonic() > deadline:
                log.error("gave up after %.0f s at step %d", args.max_seconds, manager.current_step())
                return 3
            t0 = time.perf_counter()
            opt.zero_grad()
            x, y = batch(manager.current_step(), group, rank, args.batch_size)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            committed = opt.step()
            print(
                f"step={manager.current_step()} committed={committed} participants={manager.num_participants()} "
                f"loss={loss.item():.5f} ms={(time.perf_counter() - t0) * 1e3:.1f}",
                flush=True,
            )
            if args.step_sleep:
                time.sleep(args.step_sleep)
        print(f"final_checksum={checksum(model)} step={manager.current_step()}", flush=True)
    finally:
        manager.shutdown()
        if intra is not None:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

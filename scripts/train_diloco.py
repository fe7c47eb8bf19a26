#!/usr/bin/env python3
"""A small, real fault-tolerant DiLoCo training run, in ftlaunch's two-line form.

An MLP learns a fixed random nonlinear "teacher" from a synthetic dataset drawn by ``ft.sampler``
(every sample once per epoch; its position travels with live recovery). Groups train alone for
``--sync-every`` inner steps and meet only to sync: DiLoCo by default, Streaming DiLoCo with
``--fragments`` > 1 (plus ``--fragment-sync-delay`` to overlap the exchange with inner steps and
``--quantize 8|4`` for low-bit pseudo-gradients), or ``--algorithm local_sgd`` / ``ddp``.

The two lines::

    ft = ftlaunch.init(model, inner_optimizer)                             # what the launcher published
    ft.diloco(model, inner_optimizer, outer_optimizer, sync_every=100)     # joins, hooks
    inner_optimizer.step()

after which the training loop is a plain PyTorch loop. Prints one line per sync point (``step=`` is
the job's inner step count, ``committed=`` whether the sync committed, with the participants and
the mean loss of the interval) and, at the end, ``final_checksum=`` of the global parameters: every
group ends bit-identical, also the ones that were killed, restarted and healed.

Launch::

    ftlaunch --replicas 3 --chaos every=10 scripts/train_diloco.py
    ftlaunch --replicas 2 scripts/train_diloco.py --device cuda   # each worker on its GPU, Baby NCCL
    torchx run -s local_cwd ftlaunch:diloco --replicas 3 --sync_every 20 --script scripts/train_diloco.py
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import sys
import time
from typing import Any

import torch
from torch import nn

import ftlaunch
from ftlaunch import env
from ftlaunch.errors import install_brief_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", choices=["diloco", "local_sgd", "ddp"], default="diloco")
    p.add_argument("--steps", type=int, default=2000, help="inner steps of the job (default 2000)")
    p.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="inner steps per sync of a fragment (default: FTLAUNCH_SYNC_EVERY, else 20)",
    )
    p.add_argument("--fragments", type=int, default=None, help="Streaming DiLoCo fragments (default 1)")
    p.add_argument("--fragment-sync-delay", type=int, default=None, help="inner steps a sync overlaps (tau)")
    p.add_argument("--fragment-update-alpha", type=float, default=None, help="mixing of local and global")
    p.add_argument(
        "--quantize", type=int, choices=[0, 4, 8], default=None, help="pseudo-gradient bits (0: off)"
    )
    p.add_argument("--width", type=int, default=128, help="hidden width of the 3-layer MLP")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--lr", type=float, default=3e-3, help="inner learning rate (AdamW; SGD for ddp/local_sgd)"
    )
    p.add_argument(
        "--inner",
        choices=["adamw", "sgd"],
        default=None,
        help="inner optimizer (default: adamw for diloco, sgd with momentum otherwise)",
    )
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (0: plain SGD)")
    p.add_argument(
        "--same-init",
        action="store_true",
        help="every group starts from the same seed (and init_sync=False): for equivalence tests",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the worker's GPU (LOCAL_RANK, modulo the GPUs visible); Baby NCCL across groups by "
        "default",
    )
    p.add_argument("--backend", choices=["baby-gloo", "gloo", "baby-nccl", "nccl"], default=None)
    p.add_argument("--transport", choices=["pg", "http"], default=None)
    p.add_argument("--timeout", type=float, default=None, help="the one timeout knob in seconds")
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="extra seconds per inner step (demos, chaos)"
    )
    p.add_argument("--max-seconds", type=float, default=900.0, help="give up after this long (safety net)")
    p.add_argument("--dump", default=None, help="directory: save the parameters after every sync (tests)")
    p.add_argument(
        "--count-bytes", action="store_true", help="count the bytes this worker sends (benchmarks)"
    )
    return p.parse_args(argv)


def make_model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8)
    )


def teacher() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random two-layer teacher: learnable, not in one step."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 8, generator=g) / 8


def make_dataset(size: int, seed: int = 8) -> torch.utils.data.TensorDataset:
    w1, w2 = teacher()
    x = torch.randn(size, 32, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w1) @ w2)


def device_of(args: argparse.Namespace) -> torch.device:
    """This worker's device: with ``--device cuda`` its GPU, ``LOCAL_RANK`` modulo the GPUs visible
    (workers share a GPU when there are fewer GPUs than workers, as ``scripts/gpu_check.py`` does)."""
    if args.device == "cuda":
        index = (env.count(env.LOCAL_RANK, 0) or 0) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@torch.no_grad()
def eval_loss(model: nn.Module, params: list[torch.Tensor] | None = None) -> float:
    """Loss on held-out data, with ``params`` (DiLoCo's global parameters) in the model if given."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in make_dataset(2048, seed=99).tensors)
    saved = [p.detach().clone() for p in model.parameters()]
    if params is not None:
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    loss = nn.functional.mse_loss(model(x), y).item()
    for p, v in zip(model.parameters(), saved, strict=True):
        p.copy_(v)
    return loss


def checksum(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()[:16]


class ByteCounter:
    """Bytes this worker sends through the cross-group process group, by each collective's
    standard algorithm: ring all-reduce 2 (W-1)/W x size, all-to-all (W-1)/W, all-gather (W-1)."""

    def __init__(self, pg: Any) -> None:
        self.sent = 0.0
        for name, factor in (
            ("allreduce", lambda w: 2 * (w - 1) / w),
            ("all_to_all_single", lambda w: (w - 1) / w),
            ("all_gather_single", lambda w: float(w - 1)),
        ):
            self._wrap(pg, name, factor)

    def _wrap(self, pg: Any, name: str, factor: Any) -> None:
        original = getattr(pg, name)
        arg = 1 if name == "all_to_all_single" or name == "all_gather_single" else 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensors = args[arg]
            tensors = tensors if isinstance(tensors, list) else [tensors]
            self.sent += factor(pg.size()) * sum(t.numel() * t.element_size() for t in tensors)
            return original(*args, **kwargs)

        setattr(pg, name, counted)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A bad setting (ftlaunch.ConfigurationError, also one this script reads before ftlaunch.init)
    # ends the worker in one line, and the ftlaunch launcher stops the job instead of restarting it.
    install_brief_errors(env.error_file())
    group = env.count(env.REPLICA_GROUP_ID, 0) or 0
    rank = env.count(env.RANK, 0) or 0
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [rg{group}/r{rank}] %(message)s"
    )
    log = logging.getLogger("train_diloco")

    device = device_of(args)
    model = make_model(args.width, seed=1000 if args.same_init else 1000 + group).to(device)
    inner_kind = args.inner or ("adamw" if args.algorithm == "diloco" else "sgd")
    inner: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if inner_kind == "adamw"
        else torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    )
    dataset = make_dataset(args.dataset_size)
    extra = {"init_sync": False} if args.same_init else {}
    ft = ftlaunch.init(
        model, inner, timeout=args.timeout, backend=args.backend, transport=args.transport, **extra
    )
    counter = ByteCounter(ft.pg) if args.count_bytes else None
    delay = args.fragment_sync_delay
    if delay is None:
        delay = (ft.sync_env or env.SyncEnv.from_environ()).fragment_sync_delay
    # Before the join: the healed data position is loaded with it. Exactly once (the default) counts
    # the samples drawn between two syncs; a sync that overlaps the next inner steps
    # (fragment_sync_delay) mixes two intervals' draws, so that needs the fixed shards.
    sampler = ft.sampler(dataset, mode="shard" if delay and args.algorithm == "diloco" else "exact")
    sync_every = args.sync_every or env.count(env.FTLAUNCH_SYNC_EVERY, 20) or 20
    diloco = local_sgd = None
    net = model
    opt: torch.optim.Optimizer = inner
    if args.algorithm == "diloco":
        outer = torch.optim.SGD(
            model.parameters(),
            lr=args.outer_lr,
            momentum=args.outer_momentum,
            nesterov=args.outer_momentum > 0,
        )
        diloco = ft.diloco(
            model,
            inner,
            outer,
            sync_every,
            fragments=args.fragments,
            fragment_sync_delay=args.fragment_sync_delay,
            fragment_update_alpha=args.fragment_update_alpha,
            should_quantize=None if args.quantize is None else (args.quantize or False),
        )
        interval = diloco.sync_interval
    elif args.algorithm == "local_sgd":
        local_sgd = ft.local_sgd(model, inner, sync_every)
        interval = sync_every
    else:
        net, opt = ft.wrap(model, inner)
        interval = 1
    manager = ft.manager

    def job_step() -> int:
        """Inner steps of the job so far (the same in every group at a sync point: healed)."""
        if diloco is not None:
            return diloco.syncs * interval + diloco.local_step
        if local_sgd is not None:
            return (manager.current_step() - 1) * interval + local_sgd.local_step
        return manager.current_step()

    dumps: list[list[float]] = []
    loss_fn = nn.MSELoss()
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    deadline = time.monotonic() + args.max_seconds
    losses: list[float] = []
    inner_steps = 0
    t_start = time.perf_counter()
    try:
        for _epoch in sampler.epochs(1 << 30):
            for x, y in loader:
                if job_step() >= args.steps:
                    break
                if time.monotonic() > deadline:
                    log.error("gave up after %.0f s at job step %d", args.max_seconds, job_step())
                    return 3
                x, y = x.to(device), y.to(device)
                before = manager.current_step()
                opt.zero_grad()
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()  # the inner step; at a sync point also the sync
                inner_steps += 1
                losses.append(loss.item())
                algorithm = diloco or local_sgd
                if algorithm is None or algorithm.local_step == 0:  # a sync point passed
                    committed = manager.current_step() != before
                    report_sync(job_step(), committed, manager.num_participants(), losses, diloco, sampler)
                    losses = []
                    if args.dump is not None and committed:
                        params = (
                            diloco.global_parameters().values() if diloco is not None else model.parameters()
                        )
                        dumps.append(torch.cat([p.detach().reshape(-1) for p in params]).tolist())
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            if job_step() >= args.steps:
                break
        wall = time.perf_counter() - t_start
        final = list(diloco.global_parameters().values()) if diloco is not None else list(model.parameters())
        print(
            f"eval_loss={eval_loss(model, final):.6f} inner_steps={inner_steps} "
            f"ms_per_inner_step={wall / max(inner_steps, 1) * 1e3:.2f}"
            + (f" bytes_sent={counter.sent:.0f}" if counter is not None else ""),
            flush=True,
        )
        print(f"final_checksum={checksum(final)} step={job_step()}", flush=True)
        if args.dump is not None:
            os.makedirs(args.dump, exist_ok=True)
            torch.save(dumps, os.path.join(args.dump, f"rg{group}_r{rank}.pt"))
    finally:
        ft.shutdown()
    return 0


def report_sync(
    step: int, committed: bool, participants: int, losses: list[float], diloco: Any, sampler: Any
) -> None:
    """One line per sync point; with DiLoCo the checksums of the global parameters and the outer
    optimizer state, which every group that committed the sync holds bit-identical."""
    info = ""
    if diloco is not None:
        outer = [
            t
            for sd in diloco.state_dict()["outer_optimizers"]
            for s in sd["state"].values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]
        info = (
            f" syncs={diloco.syncs} global={checksum(diloco.global_parameters().values())} "
            f"outer={checksum(outer)}"
        )
    loss = sum(losses) / len(losses) if losses else float("nan")
    print(
        f"step={step} committed={committed} participants={participants} loss={loss:.5f}{info} "
        f"data={sampler.epoch}:{sampler.position}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

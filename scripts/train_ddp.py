#!/usr/bin/env python3
"""A small, real fault-tolerant DDP training run, in ftlaunch's two-line form.

An MLP learns a fixed random linear "teacher" from a synthetic dataset, drawn by ``ft.sampler``:
every sample trained exactly once per epoch by the job, whatever fails (``--sampler shard``: a fixed
shard per replica group x worker instead). Its position travels with live recovery: a restarted
group continues exactly at its peers' position. Gradients are averaged inside the group and across
groups. Logs one line per step (step, committed, participants, loss, data position; with
``--print-ids`` the ``epoch:index`` of every sample the worker trained in it) and, at the end, a
checksum of the weights so runs can check that every group ended bit-identical.

The two lines::

    ft = ftlaunch.init(model, optimizer)          # reads what the launcher published
    model, optimizer = ft.wrap(model, optimizer)  # DDP across groups + commit-gated optimizer

``--long-form`` runs the same training with torchft-style explicit plumbing (Manager, process
group, transport) to show that a ported torchft script keeps working.

Launch: ``ftlaunch --replicas 2 scripts/train_ddp.py`` (or torchrun/torchx, see README), or by hand
against a lighthouse::

    ftlaunch-lighthouse --bind 127.0.0.1:29510 --min-replicas 1 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 FTLAUNCH_LIGHTHOUSE=http://127.0.0.1:29510 python
    scripts/train_ddp.py
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 FTLAUNCH_LIGHTHOUSE=http://127.0.0.1:29510 python
    scripts/train_ddp.py
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import ftlaunch
from ftlaunch import env
from ftlaunch.errors import install_brief_errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="committed steps to train (default 100)")
    p.add_argument("--width", type=int, default=256, help="hidden width of the 3-layer MLP")
    p.add_argument(
        "--model",
        choices=["mlp", "bn-cnn"],
        default="mlp",
        help="mlp (default) or bn-cnn: a small CNN with BatchNorm, whose forward updates buffers",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the worker's GPU (LOCAL_RANK, modulo the GPUs visible); Baby NCCL across groups by "
        "default",
    )
    p.add_argument(
        "--backend",
        choices=["baby-gloo", "gloo", "baby-nccl", "nccl"],
        default=None,
        help="cross-group process group (default: ftlaunch.init's choice: Baby Gloo on CPU, Baby NCCL on "
        "GPU)",
    )
    p.add_argument(
        "--transport",
        choices=["pg", "http"],
        default=None,
        help="live-recovery transport (default: ftlaunch.init's choice, pg)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="the one timeout knob in seconds (default: FTLAUNCH_TIMEOUT, else 60)",
    )
    p.add_argument("--dataset-size", type=int, default=4096, help="samples in the synthetic dataset")
    p.add_argument(
        "--sampler",
        choices=["exact", "shard"],
        default="exact",
        help="exact: every sample once per epoch, whatever fails (default); shard: fixed shards",
    )
    p.add_argument("--epochs", type=int, default=None, help="stop after this many epochs (default: --steps)")
    p.add_argument(
        "--print-ids",
        action="store_true",
        help="print the epoch:index of every sample a committed step trained on this worker (ids=)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (demos, chaos)")
    p.add_argument(
        "--compute-ms",
        type=float,
        default=0.0,
        help="extra CPU work per step, in milliseconds of this thread's CPU time (a stand-in for a larger "
        "model: a slowed or contended worker takes longer for it, as for real compute; a sleep would not)",
    )
    p.add_argument("--max-seconds", type=float, default=600.0, help="give up after this long (safety net)")
    p.add_argument(
        "--long-form",
        action="store_true",
        help="torchft-style explicit Manager/process group/transport instead of ftlaunch.init",
    )
    return p.parse_args(argv)


def make_model(width: int, kind: str = "mlp") -> nn.Module:
    torch.manual_seed((env.count(env.REPLICA_GROUP_ID, 0) or 0) + 1000)  # groups start different
    if kind == "bn-cnn":  # each sample's 64 features as a 1-channel signal
        return nn.Sequential(
            nn.Unflatten(1, (1, 64)), nn.Conv1d(1, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU(),
            nn.Conv1d(16, 16, 3, padding=1), nn.BatchNorm1d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 64,
                                                                                                    8),
        )  # fmt: skip
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8)
    )


def make_dataset(size: int) -> torch.utils.data.TensorDataset:
    """(index, x, y) samples; the index lets logs and tests see which samples each step used."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(size, 64, generator=g)
    teacher = torch.randn(64, 8, generator=g)
    return torch.utils.data.TensorDataset(torch.arange(size), x, x @ teacher)


def device_of(args: argparse.Namespace) -> torch.device:
    """This worker's device: with ``--device cuda`` its GPU, ``LOCAL_RANK`` modulo the GPUs visible
    (workers share a GPU when there are fewer GPUs than workers, as ``scripts/gpu_check.py`` does)."""
    if args.device == "cuda":
        index = (env.count(env.LOCAL_RANK, 0) or 0) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def burn(ms: float) -> None:
    """Busy work until this thread used ``ms`` milliseconds of CPU time."""
    if ms <= 0:
        return
    until = time.thread_time() + ms / 1e3
    while time.thread_time() < until:
        pass


def checksum(model: nn.Module) -> str:
    """A hash of the weights' bytes (torch only: NumPy is not a dependency)."""
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach().contiguous().cpu()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()[:16]


def long_form(
    args: argparse.Namespace,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    dataset: torch.utils.data.Dataset,
    device: torch.device,
) -> tuple:
    """torchft-style plumbing: every piece spelled out (what ``ftlaunch.init`` does for you)."""
    from ftlaunch import (
        DistributedDataParallel,
        DistributedSampler,
        ExactlyOnceSampler,
        Manager,
        Optimizer,
        ProcessGroupBabyGloo,
        ProcessGroupBabyNCCL,
        ProcessGroupGloo,
        ProcessGroupNCCL,
    )
    from ftlaunch.checkpointing import PGTransport

    timeout = timedelta(seconds=args.timeout or 60.0)
    gpu = device.type == "cuda"
    intra = None
    if (env.count(env.WORLD_SIZE, 1) or 1) > 1:
        dist.init_process_group("nccl" if gpu else "gloo", timeout=timeout)
        intra = dist.group.WORLD
    kinds = {
        "gloo": ProcessGroupGloo,
        "baby-gloo": ProcessGroupBabyGloo,
        "nccl": ProcessGroupNCCL,
        "baby-nccl": ProcessGroupBabyNCCL,
    }
    pg = kinds[args.backend or ("baby-nccl" if gpu else "gloo")](timeout=timeout)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    transport = PGTransport(pg, timeout=timeout, device=device) if args.transport == "pg" else None
    manager = Manager(
        pg=pg,
        load_state_dict=load_state,
        state_dict=save_state,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=2 * timeout,
        checkpoint_transport=transport,
    )
    sampler = DistributedSampler(dataset) if args.sampler == "shard" else ExactlyOnceSampler(dataset, manager)
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    return (
        manager,
        DistributedDataParallel(manager, model, intra_group=intra),
        Optimizer(manager, inner),
        sampler,
        intra,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A bad setting (ftlaunch.ConfigurationError, also one this script reads before ftlaunch.init)
    # ends the worker in one line, and the ftlaunch launcher stops the job instead of restarting it.
    install_brief_errors(env.error_file())
    # No [rgG/rR] tag here: the Manager's lines carry it, and launchers prefix every line with it.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("train_ddp")

    ft = None
    intra = None
    device = device_of(args)
    model = make_model(args.width, args.model).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = make_dataset(args.dataset_size)
    if args.long_form:
        manager, ddp, opt, sampler, intra = long_form(args, model, inner, dataset, device)
    else:
        ft = ftlaunch.init(model, inner, timeout=args.timeout, backend=args.backend, transport=args.transport)
    if ft is not None:
        ddp, opt = ft.wrap(model, inner)
        manager, sampler = ft.manager, ft.sampler(dataset, mode=args.sampler)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.MSELoss()
    deadline = time.monotonic() + args.max_seconds
    try:
        for _epoch in sampler.epochs(args.epochs if args.epochs is not None else 1 << 30):
            for idx, x, y in loader:
                if args.epochs is None and manager.current_step() >= args.steps:
                    break
                if time.monotonic() > deadline:
                    log.error("gave up after %.0f s at step %d", args.max_seconds, manager.current_step())
                    return 3
                if args.print_ids:  # what this batch is: read before the step (a heal moves the position)
                    drawn = (
                        sampler.drawn()
                        if hasattr(sampler, "drawn")
                        else [(sampler.epoch, int(i)) for i in idx]
                    )
                x, y = x.to(device), y.to(device)
                t0 = time.perf_counter()
                opt.zero_grad()
                burn(args.compute_ms)
                loss = loss_fn(ddp(x), y)
                loss.backward()
                committed = opt.step()
                ids = ""
                if args.print_ids:
                    trained = committed and manager.is_participating()
                    ids = " ids=" + (",".join(f"{e}:{i}" for e, i in drawn) if trained else "-")
                print(
                    f"step={manager.current_step()} committed={committed} "
                    f"participants={manager.num_participants()} "
                    f"loss={loss.item():.5f} ms={(time.perf_counter() - t0) * 1e3:.1f} "
                    f"data={sampler.epoch}:{sampler.position} first={int(idx[0])} t={time.time():.4f}{ids}",
                    flush=True,
                )
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            if args.epochs is None and manager.current_step() >= args.steps:
                break
        print(f"final_checksum={checksum(model)} step={manager.current_step()}", flush=True)
    finally:
        if ft is not None:
            ft.shutdown()
        else:
            manager.shutdown()
            if intra is not None:
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

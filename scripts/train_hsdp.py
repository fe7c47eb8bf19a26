#!/usr/bin/env python3
"""A small, real fault-tolerant HSDP training run: a causal-LM transformer sharded with FSDP2 inside
each replica group, averaged across groups by ftlaunch.

The model is a byte-level GPT (token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, a final norm and an output head) learning to continue Python's own
standard library source code, read from the running interpreter: a real corpus that ships with every
Python, no download. Each block is an FSDP2 unit; the embeddings, final norm and head form the root
unit. The samples are drawn by ``ft.sampler`` (every sample once per epoch, ``--sampler shard``: fixed
shards per replica group x worker), whose position travels with live recovery. Logs one line per step and rank
(step, committed, participants, loss, data position) and, at the end, a checksum of the full (gathered)
weights so runs can check that every group ended bit-identical.

The fault-tolerant lines::

    ft = ftlaunch.init()
    model = ft.shard(model, mp_policy=...)          # FSDP2 over the group's workers
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = ft.wrap(model, optimizer)    # averaged across groups, commit-gated, healable

``--long-form`` runs the same training the torchft way (Manager, process group, transport,
``ft_init_device_mesh`` and ``fully_shard`` over the 2-D mesh) to show that a ported script works.
``--reference`` computes, in one process and without any distribution, the losses the sharded
run must log (tests compare them).

Launch: ``ftlaunch --replicas 2 --nproc-per-node 2 scripts/train_hsdp.py`` (or torchrun per group,
or ``torchx run -s local_cwd ftlaunch:hsdp``, see README).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import math
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's convention
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import ftlaunch
from ftlaunch import env
from ftlaunch.errors import install_brief_errors

#: Standard-library modules whose source is the corpus (sorted, fixed: every worker reads the same bytes).
CORPUS_MODULES = (
    "argparse",
    "dataclasses",
    "functools",
    "json/decoder",
    "json/encoder",
    "textwrap",
    "typing",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="committed steps to train (default 100)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sample")
    p.add_argument("--batch-size", type=int, default=8, help="samples per worker and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-grad-norm", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="bf16: FSDP2 computes in bfloat16 and reduces gradients in float32",
    )
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the worker's GPU (LOCAL_RANK, modulo the GPUs visible), NCCL inside and across groups",
    )
    p.add_argument(
        "--backend",
        choices=["baby-gloo", "gloo", "baby-nccl", "nccl"],
        default=None,
        help="cross-group process group (default: ftlaunch.init's choice: Baby Gloo on CPU, Baby NCCL on "
        "GPU)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="the one timeout knob in seconds (default: FTLAUNCH_TIMEOUT, else 60)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (demos, chaos)")
    p.add_argument(
        "--sampler",
        choices=["exact", "shard"],
        default="exact",
        help="exact: every sample once per epoch, whatever fails (default); shard: fixed shards, "
        "what --reference follows",
    )
    p.add_argument("--max-seconds", type=float, default=600.0, help="give up after this long (safety net)")
    p.add_argument(
        "--long-form",
        action="store_true",
        help="torchft-style explicit Manager/process group/transport/2-D mesh instead of ftlaunch.init",
    )
    p.add_argument(
        "--reference",
        metavar="GROUPSxWORKERS",
        default=None,
        help="print the losses a run of GROUPS groups x WORKERS workers must log, computed in one "
        "process without distribution (e.g. 2x2), and exit",
    )
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, layers: int, heads: int, ckpt: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.ckpt = ckpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            # Activation checkpointing: keep only each block's input, recompute the rest in backward.
            h = checkpoint(block, h, use_reentrant=False) if self.ckpt else block(h)
        return self.head(self.norm(h))


def make_model(args: argparse.Namespace) -> TinyGPT:
    torch.manual_seed(1234)  # the same start everywhere (the first step heals from group 0 anyway)
    return TinyGPT(256, args.seq_len, args.d_model, args.layers, args.heads, args.activation_checkpointing)


def make_dataset(seq_len: int) -> torch.utils.data.TensorDataset:
    """(index, input bytes, next bytes) windows of the corpus, one every ``seq_len`` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / f"{name}.py").read_bytes() for name in CORPUS_MODULES)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n = (len(data) - 1) // seq_len
    windows = data[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)[:n]
    return torch.utils.data.TensorDataset(
        torch.arange(n), windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    )


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def full_checksum(model: nn.Module) -> str:
    """Checksum of the full weights: every rank gathers every shard (a collective inside the group)."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        full = full.detach().float().cpu().contiguous()
        h.update(ctypes.string_at(full.data_ptr(), full.numel() * full.element_size()))
    return h.hexdigest()[:16]


def device_of(args: argparse.Namespace) -> torch.device:
    """This worker's device: with ``--device cuda`` its GPU, ``LOCAL_RANK`` modulo the GPUs visible
    (workers share a GPU when there are fewer GPUs than workers, as ``scripts/gpu_check.py`` does)."""
    if args.device == "cuda":
        index = (env.count(env.LOCAL_RANK, 0) or 0) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def mp_policy(args: argparse.Namespace):  # noqa: ANN201 - FSDP's MixedPrecisionPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if args.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


# ------------------------------------------------------------------------------------------ the two forms
def short_form(args: argparse.Namespace, model: nn.Module, dataset: torch.utils.data.Dataset) -> tuple:
    """ftlaunch's form: init, shard, optimizer, wrap."""
    ft = ftlaunch.init(timeout=args.timeout, backend=args.backend, device=device_of(args))
    model = ft.shard(model, mp_policy=mp_policy(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = ft.wrap(model, optimizer)
    return ft, ft.manager, model, optimizer, ft.sampler(dataset, mode=args.sampler)


def long_form(args: argparse.Namespace, model: nn.Module, dataset: torch.utils.data.Dataset) -> tuple:
    """torchft-style plumbing: every piece spelled out (what ``ftlaunch.init``/``shard``/``wrap`` do)."""
    from torch.distributed.fsdp import fully_shard

    from ftlaunch import (
        DistributedSampler,
        ExactlyOnceSampler,
        Manager,
        Optimizer,
        ProcessGroupBabyGloo,
        ProcessGroupBabyNCCL,
        ProcessGroupGloo,
        ProcessGroupNCCL,
        ShardedState,
    )
    from ftlaunch.checkpointing import PGTransport
    from ftlaunch.process_group import ft_init_device_mesh

    timeout = timedelta(seconds=args.timeout or 60.0)
    device = device_of(args)
    gpu = device.type == "cuda"
    dist.init_process_group(
        "nccl" if gpu else "gloo", timeout=timeout
    )  # the replica group's own (torchelastic's env)
    kinds = {
        "gloo": ProcessGroupGloo,
        "baby-gloo": ProcessGroupBabyGloo,
        "nccl": ProcessGroupNCCL,
        "baby-nccl": ProcessGroupBabyNCCL,
    }
    pg = kinds[args.backend or ("baby-nccl" if gpu else "baby-gloo")](timeout=timeout)
    transport: PGTransport = PGTransport(pg, timeout=timeout, device=device)
    # The model's and optimizer's state is registered once they are sharded (below).
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=2 * timeout,
        checkpoint_transport=transport,
    )
    mesh = ft_init_device_mesh(
        device_type=device.type,
        mesh_shape=(env.count(env.NUM_REPLICA_GROUPS, 1) or 1, dist.get_world_size()),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    transport.device_mesh = mesh  # received shards are rebuilt on it
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy(args))
    fully_shard(model, mesh=mesh, mp_policy=mp_policy(args))
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Not model.state_dict(): the Manager reads the state on its quorum thread during the forward
    # pass, and FSDP2's state-dict hook would reshard parameters in use (see ShardedState).
    state = ShardedState(model, inner)
    manager.register_state_dict_fn("default", state.load_state_dict, state.state_dict)
    sampler = DistributedSampler(dataset) if args.sampler == "shard" else ExactlyOnceSampler(dataset, manager)
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    return None, manager, model, Optimizer(manager, inner), sampler


# ------------------------------------------------------------------------------------------ reference
def reference(args: argparse.Namespace, groups: int, workers: int) -> int:
    """The losses a ``groups x workers`` run with ``--sampler shard`` logs, from one process and the
    full model (each worker's batches: its fixed shard's).

    Steps 0 and 1: only group 0's shards count. Every other group heals from it: in step 0 it waits
    while group 0 commits the step and snapshots its end, in step 1 it heals before its forward pass
    but is not a participant yet (a healer's batch was drawn at its old data position), so it
    contributes zeros. Later steps: the mean over all shards.
    """
    from ftlaunch import DistributedSampler

    torch.set_num_threads(1)
    model = make_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = make_dataset(args.seq_len)
    loaders = {
        (g, r): iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch_size,
                                                 sampler=DistributedSampler(
            dataset, replica_group_id=g, num_replica_groups=groups, rank=r, num_replicas=workers)))
        for g in range(groups) for r in range(workers)
    }  # fmt: skip
    for step in range(args.steps):
        optimizer.zero_grad()
        contributing = [k for k in loaders if step > 1 or k[0] == 0]
        for g, r in loaders:
            _, x, y = next(loaders[(g, r)])
            loss = loss_of(model, x, y)
            print(f"reference step={step} group={g} rank={r} loss={loss.item():.6f}", flush=True)
            if (g, r) in contributing:
                (loss / len(contributing)).backward()
        if args.clip_grad_norm:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
    print(f"reference final_checksum={full_checksum(model)}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------ training
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A bad setting (ftlaunch.ConfigurationError, also one this script reads before ftlaunch.init)
    # ends the worker in one line, and the ftlaunch launcher stops the job instead of restarting it.
    install_brief_errors(env.error_file())
    if args.reference:
        groups, workers = (int(n) for n in args.reference.lower().split("x"))
        return reference(args, groups, workers)
    group = env.count(env.REPLICA_GROUP_ID, 0) or 0
    rank = env.count(env.RANK, 0) or 0
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [rg{group}/r{rank}] %(message)s"
    )
    log = logging.getLogger("train_hsdp")
    torch.set_num_threads(1)  # workers share the machine's cores

    device = device_of(args)
    model = make_model(args).to(device)
    dataset = make_dataset(args.seq_len)
    ft, manager, model, optimizer, sampler = (long_form if args.long_form else short_form)(
        args, model, dataset
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    deadline = time.monotonic() + args.max_seconds
    try:
        for _epoch in sampler.epochs(1 << 30):
            for idx, x, y in loader:
                if manager.current_step() >= args.steps:
                    break
                if time.monotonic() > deadline:
                    log.error("gave up after %.0f s at step %d", args.max_seconds, manager.current_step())
                    return 3
                x, y = x.to(device), y.to(device)
                t0 = time.perf_counter()
                optimizer.zero_grad()  # starts the step's quorum
                loss = loss_of(model, x, y)
                loss.backward()  # gradient shards averaged in the group, then across groups
                norm = (
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                    if args.clip_grad_norm
                    else torch.zeros(())
                )
                committed = optimizer.step()  # applied only if every group and rank committed
                print(
                    f"step={manager.current_step()} committed={committed} "
                    f"participants={manager.num_participants()} "
                    f"loss={loss.item():.6f} "
                    f"norm={float(norm.full_tensor() if isinstance(norm, DTensor) else norm):.4f} "
                    f"ms={(time.perf_counter() - t0) * 1e3:.1f} data={sampler.epoch}:{sampler.position} "
                    f"first={int(idx[0])}",
                    flush=True,
                )
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            if manager.current_step() >= args.steps:
                break
        checksum = full_checksum(model)
        print(
            f"final_checksum={checksum} step={manager.current_step()} "
            f"loss_ppl={math.exp(min(loss.item(), 20)):.2f}",
            flush=True,
        )
    finally:
        if ft is not None:
            ft.shutdown()
        else:
            manager.shutdown()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

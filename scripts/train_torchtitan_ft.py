#!/usr/bin/env python3
"""What torchtitan's torchft integration builds, built from ftlaunch (``import ftlaunch as torchft``).

torchtitan's fault-tolerance experiment (``torchtitan/experiments/torchft``) builds, from torchft:
a ``Manager(pg=ProcessGroupGloo(timeout=...), min_replica_size=, load_state_dict=None,
state_dict=None, use_async_quorum=, replica_id=f"torchtitan_ft_{i}")`` whose state functions are
set later (``set_state_dict_fns``, by its checkpointer); for synchronous training a
``process_group.ManagedProcessGroup(manager)`` registered as ``"dp_replicate"``, through which it
all-reduces gradients (FSDP's all-reduce hook) and the loss with ``dist.all_reduce(...,
group=replicate_pg)``, and an ``Optimizer`` (torchft's ``OptimizerWrapper``) around its optimizers
container; for semi-synchronous training ``local_sgd.DiLoCo(manager=, model_fragments=,
inner_optimizer=, outer_optimizer=[one per fragment], sync_every=, should_quantize=,
fragment_sync_delay=, fragment_update_alpha=)`` over model fragments split by module names.
This script builds the same objects the same way on CPU, with a small model instead of Llama
(no FSDP: the all-reduce the hook would issue is issued after backward), and trains.

    ftlaunch --replicas 2 scripts/train_torchtitan_ft.py --steps 30
    ftlaunch --replicas 2 scripts/train_torchtitan_ft.py --semi-sync diloco --steps 40

Every group prints ``final_checksum=`` (``global_checksum=`` for DiLoCo: the global parameters);
they end identical.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import ReduceOp

import ftlaunch as torchft  # torchtitan writes `import torchft`
from ftlaunch import local_sgd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="committed steps (syncs, for diloco)")
    p.add_argument("--semi-sync", choices=["none", "diloco"], default="none")
    p.add_argument("--sync-steps", type=int, default=4, help="DiLoCo: inner steps per sync")
    p.add_argument("--process-group-timeout-ms", type=int, default=10000)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (room for a kill)")
    p.add_argument(
        "--progress-dir",
        default="",
        help="write '<pid> <step>' to DIR/rg<i> after every step (for a test's kill)",
    )
    return p.parse_args()


class Model(nn.Module):
    """A stand-in for torchtitan's decoder: embeddings, a list of layers, an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(8, 16)
        self.layers = nn.ModuleDict({"0": nn.Linear(16, 16), "1": nn.Linear(16, 16)})
        self.output = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.tok_embeddings(x))
        for layer in self.layers.values():
            h = torch.relu(layer(h))
        return self.output(h)


def module_split(model: nn.Module, module_fqns_per_model_fragment: list[list[str]]) -> list[nn.Module]:
    """One module per fragment holding the named submodules (torchtitan's ``module_split``)."""
    named = dict(model.named_modules())
    return [nn.ModuleList([named[fqn] for fqn in fqns]) for fqns in module_fqns_per_model_fragment]


class OptimizersContainer:
    """torchtitan's optimizers container, cut down: one optimizer per model part."""

    def __init__(self, model_parts: list[nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in model_parts]

    def step(self, *args: Any, **kwargs: Any) -> None:
        for o in self.optimizers:
            o.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for o in self.optimizers:
            o.zero_grad(*args, **kwargs)

    def state_dict(self) -> dict:
        return {str(i): o.state_dict() for i, o in enumerate(self.optimizers)}

    def load_state_dict(self, sd: dict) -> None:
        for i, o in enumerate(self.optimizers):
            o.load_state_dict(sd[str(i)])


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    replica_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    use_async_quorum = args.semi_sync == "none"
    torch.manual_seed(0)
    model = Model()
    optimizers = OptimizersContainer([model])

    # TorchFTManager.__init__
    pg = torchft.ProcessGroupGloo(timeout=timedelta(milliseconds=args.process_group_timeout_ms))
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        use_async_quorum=use_async_quorum,
        replica_id=f"torchtitan_ft_{replica_id}",
    )
    replicate_pg = None
    if use_async_quorum:
        replicate_pg = torchft.process_group.ManagedProcessGroup(manager)
        replicate_pg.register("dp_replicate")

    # The checkpointer hands the Manager its state functions afterwards.
    def ft_state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizers.state_dict()}

    def ft_load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optimizers.load_state_dict(sd["optim"])

    manager.set_state_dict_fns(ft_load_state_dict, ft_state_dict)

    def progress() -> None:
        if args.progress_dir:
            path = os.path.join(args.progress_dir, f"rg{replica_id}")
            with open(path + ".tmp", "w") as f:
                f.write(f"{os.getpid()} {manager.current_step()}")
            os.replace(path + ".tmp", path)

    g = torch.Generator().manual_seed(1000 + replica_id)  # each group its own data
    try:
        if use_async_quorum:
            # TorchFTOptimizersContainer: the wrapper starts the quorum and commits the step.
            ft_optimizer = torchft.Optimizer(manager, optimizers)
            while manager.current_step() < args.steps:
                ft_optimizer.zero_grad()
                x = torch.randn(16, 8, generator=g)
                loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                loss.backward()
                for p in model.parameters():  # what FSDP's all-reduce hook issues
                    assert p.grad is not None
                    dist.all_reduce(p.grad, group=replicate_pg, op=ReduceOp.AVG)
                global_loss = loss.detach().clone()
                dist.all_reduce(global_loss, group=replicate_pg, op=ReduceOp.AVG)  # loss_sync_pg
                committed = ft_optimizer.step()
                print(
                    f"step={manager.current_step()} committed={committed} "
                    f"participants={manager.num_participants()} loss={global_loss.item():.5f}",
                    flush=True,
                )
                progress()
                time.sleep(args.step_sleep)
        else:
            # maybe_semi_sync_training: fragments by module names, one outer optimizer each.
            fragments = module_split(model, [["tok_embeddings", "layers.0"], ["layers.1", "output"]])
            outer_optimizers = [
                torch.optim.SGD(
                    [p for p in m.parameters() if p.requires_grad], lr=0.7, momentum=0.9, nesterov=True
                )
                for m in fragments
            ]
            with local_sgd.DiLoCo(
                manager=manager,
                model_fragments=fragments,
                inner_optimizer=optimizers.optimizers[0],
                outer_optimizer=outer_optimizers,
                sync_every=args.sync_steps,
                should_quantize=False,
                fragment_sync_delay=1,
                fragment_update_alpha=0.0,
            ) as diloco:
                inner_step = 0
                while manager.current_step() < args.steps:  # committed syncs
                    inner_step += 1
                    optimizers.zero_grad()
                    x = torch.randn(16, 8, generator=g)
                    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                    loss.backward()
                    optimizers.step()  # DiLoCo's hook syncs every sync_steps inner steps
                    print(
                        f"inner_step={inner_step} local_step={diloco.local_step} "
                        f"step={manager.current_step()} loss={loss.item():.5f}",
                        flush=True,
                    )
                    progress()
                    time.sleep(args.step_sleep)
                # The global parameters are what the groups share (each fragment's local progress
                # since its last sync is the group's own).
                glob = diloco.global_parameters()
                h = hashlib.sha256()
                for k in sorted(glob):
                    h.update(bytes(glob[k].contiguous().view(-1).view(torch.uint8).tolist()))
                print(f"global_checksum={h.hexdigest()[:16]} step={manager.current_step()}", flush=True)
                return 0
        print(f"final_checksum={checksum(model)} step={manager.current_step()}", flush=True)
    finally:
        manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

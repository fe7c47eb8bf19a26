#!/usr/bin/env python3
"""A torchft training script ported to ftlaunch by changing its imports (``torchft`` -> ``ftlaunch``).

It is written the way today's torchft is used, and exercises each torchft API that ftlaunch
follows: the Manager with ``world_size_mode=WorldSizeMode.FIXED_WITH_SPARES``, ``port``,
``set_state_dict_fns``, ``allreduce`` returning a Work, ``wrap_future`` and
``allow``/``disallow_state_dict_read``; ``PureDistributedDataParallel``; ``DistributedSampler``
with torchft's keywords; ``HTTPTransport(timeout, num_chunks=0)``; and, before training, with
``--shared-dir``: a ``ParameterServer`` hosted by replica group 0, the reconfigure family
(``set_rank_info``, ``reconfigure_with_store``) across all groups on that server's store with
``reduce``/``gather``/``scatter`` on the result, and torch's DDP plus ``all_gather_object`` over a
``ProcessGroupDummy``. Only the imports differ from the torchft script.

Run::

    ftlaunch --replicas 3 --min-replicas 2 scripts/train_torchft_port.py --shared-dir /tmp/port

With 3 groups and ``min_replica_size=2`` one group is a *spare* (FIXED_WITH_SPARES): it steps
with the others but its gradients do not count. Every group ends with the same weights
(``final_checksum``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# --- the only lines that differ from the torchft script: `torchft` -> `ftlaunch` -------------
from ftlaunch import DistributedSampler, Manager, Optimizer, ProcessGroupGloo, PureDistributedDataParallel
from ftlaunch.checkpointing import HTTPTransport
from ftlaunch.manager import WorldSizeMode
from ftlaunch.parameter_server import ParameterServer
from ftlaunch.process_group import ProcessGroup, ProcessGroupDummy, reconfigure_with_store

# ----------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--min-replica-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument(
        "--shared-dir", default="", help="a directory every group can read (enables the side demos)"
    )
    return p.parse_args()


class SumServer(ParameterServer):
    """Adds what each client sends to a running total and answers the new total."""

    def __init__(self) -> None:
        super().__init__(port=0)
        self.total = 0.0
        self.lock = threading.Lock()
        self.done = 0

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupGloo(timeout=timedelta(seconds=30))

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        data = torch.zeros(1)
        pg.broadcast_one(data, root=1).wait()  # from the client
        with self.lock:
            self.total += data.item()
            data.fill_(self.total)
        pg.broadcast_one(data, root=0).wait()  # back to it
        with self.lock:
            self.done += 1


def wait_for(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def side_demos(shared: Path, group: int, groups: int, timeout: timedelta) -> None:
    """ParameterServer, the reconfigure family and ProcessGroupDummy, before training."""
    server = None
    info = shared / "ps.json"
    if group == 0:
        server = SumServer()
        tmp = shared / "ps.json.tmp"
        tmp.write_text(json.dumps({"address": server.address(), "store": server.store_host_port}))
        tmp.rename(info)
    published = wait_for(info, timeout.total_seconds())

    # 1. a parameter-server session from every group (group 0 is a client of its own server too)
    client = SumServer.new_session(published["address"])
    data = torch.tensor([float(group + 1)])
    client.broadcast_one(data, root=1).wait()
    client.broadcast_one(data, root=0).wait()
    client.shutdown()
    print(f"parameter_server: rank={client.rank()} session_total={data.item():g}", flush=True)

    # 2. torchft's current set-up API across the groups, on the server's store
    pg = ProcessGroupGloo(timeout=timeout)
    pg.set_rank_info(str(group), 0, 1, group)
    reconfigure_with_store(pg, f"{published['store']}/torchft_port/reconfigure", group, groups, timeout)
    total = torch.tensor([float(group + 1)])
    dist.all_reduce(total, group=pg)
    gathered = [torch.zeros(1) for _ in range(groups)] if group == 0 else None
    dist.gather(torch.tensor([float(group)]), gathered, group=pg, group_dst=0)
    part = torch.zeros(1)
    dist.scatter(
        part, [torch.tensor([10.0 * k]) for k in range(groups)] if group == 0 else None, group=pg, group_src=0
    )
    reduced = torch.ones(1)
    dist.reduce(reduced, group=pg, group_dst=0)
    print(
        f"reconfigure: rank={pg.rank()} size={pg.size()} sum={total.item():g} scatter={part.item():g} "
        f"global_ranks={pg.global_ranks}",
        flush=True,
    )
    if gathered is not None:
        print(f"reconfigure: gathered={[t.item() for t in gathered]} reduced={reduced.item():g}", flush=True)
    pg.shutdown()

    if server is not None:
        deadline = time.monotonic() + timeout.total_seconds()
        while server.done < groups and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"parameter_server: sessions={server.done} total={server.total:g}", flush=True)
        server.shutdown()

    # 3. torch's DDP and all_gather_object over a ProcessGroupDummy
    dummy = ProcessGroupDummy(0, 1)
    aux = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), process_group=dummy)
    aux(torch.randn(3, 4)).sum().backward()
    objs: list = [None]
    dist.all_gather_object(objs, {"group": group}, group=dummy)
    print(f"dummy: ddp_grad={aux.module.weight.grad is not None} gathered={objs}", flush=True)


def checksum(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()[:16]


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", 1))
    timeout = timedelta(seconds=args.timeout)
    if args.shared_dir:
        side_demos(Path(args.shared_dir), group, groups, timeout)

    torch.manual_seed(100 + group)  # groups start different: the first quorum syncs them
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ema = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=0.05)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        for e, v in zip(ema, sd["ema"], strict=True):
            e.copy_(v)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "ema": ema}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=args.min_replica_size,
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES,
        port=int(os.environ.get("TORCHFT_MANAGER_PORT", 0)),
        timeout=timeout,
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0),
    )
    manager.set_state_dict_fns(load_state_dict, state_dict)
    model = PureDistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(
        dataset,
        replica_rank=group,
        num_replica_groups=groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=0,
    )
    manager.register_state_dict_fn("sampler", sampler.load_state_dict, sampler.state_dict)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)

    try:
        while manager.current_step() < args.steps:
            for xb, yb in loader:
                if manager.current_step() >= args.steps:
                    break
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                metric = manager.allreduce(loss.detach().clone())  # a Work, as torchft's
                mean_loss = manager.wrap_future(metric.get_future(), default=torch.full((1,), float("nan")))
                committed = optimizer.step()
                ok = metric.wait()
                if committed:
                    # Outside the optimizer step: keep heals from reading the state meanwhile.
                    manager.disallow_state_dict_read()
                    for e, p in zip(ema, model.parameters(), strict=True):
                        e.mul_(0.9).add_(p.detach(), alpha=0.1)
                    manager.allow_state_dict_read()
                print(
                    f"step={manager.current_step()} committed={committed} "
                    f"participants={manager.num_participants()} "
                    f"participating_rank={manager.participating_rank()} ok={ok} "
                    f"loss={float(mean_loss.wait().reshape(-1)[0]):.5f}",
                    flush=True,
                )
        params = list(model.parameters())
        print(f"final_checksum={checksum(*params, *ema)} step={manager.current_step()}", flush=True)
    finally:
        manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

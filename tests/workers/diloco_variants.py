"""scripts/train_diloco.py run with a test-only twist, chosen by the first argument:

``die-in-sync N``: the worker SIGKILLs itself in the middle of its N-th sync point, right after
issuing its pseudo-gradient all-reduce (a real crash at an exact point of the protocol).

``gate-after-join FILE``: after joining, the worker writes ``FILE.joined`` and waits for ``FILE``
(so a test can make sets of groups start apart, each with its own first quorum).

``pause-at-sync N FILE``: once N syncs have committed, the worker writes ``FILE.reached`` before its
next sync point and waits there for ``FILE`` (so a test can hold the survivors of a kill until the
restarted group, whose new process may take many seconds to start on a loaded host, asks to join).
For LocalSGD the syncs are the Manager's committed steps after the join.

``join-in-step``: ``ft.local_sgd``/``ft.diloco`` do not join at once; the group joins inside its
first training step (at its first forward), as a ``with LocalSGD(...)`` loop does.

``reference``: no ftlaunch at all -- plain single-process DiLoCo on the script's model, data and
data order (one group's sampler), written out here independently of ftlaunch.worker.local_sgd.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import train_diloco  # noqa: E402

from ftlaunch.worker.data import DistributedSampler  # noqa: E402
from ftlaunch.worker.manager import Manager  # noqa: E402


def die_in_sync(n: int) -> None:
    real = Manager.allreduce
    syncs = [0]

    def allreduce(self: Manager, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real(self, tensor, *args, **kwargs)
        if tensor.dtype == torch.int64:  # the agreement that opens a sync point
            syncs[0] += 1
        elif syncs[0] >= n:  # the pseudo-gradients of the n-th sync point (the join is the first)
            print(f"die-in-sync: SIGKILL in sync point {syncs[0]}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    Manager.allreduce = allreduce  # type: ignore[method-assign]


def gate_after_join(gate: str) -> None:
    """After joining, write ``<gate>.joined`` and wait until the file ``gate`` exists."""
    from ftlaunch.worker.local_sgd import DiLoCo

    real = DiLoCo._join

    def join(self: DiLoCo, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        Path(f"{gate}.joined").touch()
        while not Path(gate).exists():
            time.sleep(0.05)

    DiLoCo._join = join  # type: ignore[method-assign]


def pause_at_sync(n: int, gate: str) -> None:
    from ftlaunch.worker.local_sgd import SYNC, DiLoCo, LocalSGD

    def pause() -> None:
        Path(f"{gate}.reached").touch()
        while not Path(gate).exists():
            time.sleep(0.05)

    real = DiLoCo._start

    def start(self: DiLoCo, kind: int) -> Any:
        if kind == SYNC and self.syncs >= n and not Path(gate).exists():
            pause()
        return real(self, kind)

    DiLoCo._start = start  # type: ignore[method-assign]
    real_sync = LocalSGD.sync

    def sync(self: LocalSGD) -> bool:
        if self._manager.current_step() - 1 >= n and not Path(gate).exists():
            pause()
        return real_sync(self)

    LocalSGD.sync = sync  # type: ignore[method-assign]


def join_in_step() -> None:
    from ftlaunch.worker.local_sgd import DiLoCo, LocalSGD

    for cls in (LocalSGD, DiLoCo):
        cls.join = lambda self: None  # type: ignore[method-assign]


def reference(argv: list[str]) -> int:
    args = train_diloco.parse_args(argv)
    model = train_diloco.make_model(args.width, seed=1000)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    outer = torch.optim.SGD(
        model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=args.outer_momentum > 0
    )
    dataset = train_diloco.make_dataset(args.dataset_size)
    sampler = DistributedSampler(dataset, replica_group_id=0, num_replica_groups=1, rank=0, num_replicas=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    params = list(model.parameters())
    global_ = [p.detach().clone() for p in params]
    dumps: list[list[float]] = []
    step = 0
    for _epoch in sampler.epochs(1 << 30):
        for x, y in loader:
            if step >= args.steps:
                break
            inner.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            step += 1
            if step % args.sync_every == 0:
                with torch.no_grad():
                    delta = [g - p for g, p in zip(global_, params, strict=True)]
                    for p, g, d in zip(params, global_, delta, strict=True):
                        p.copy_(g)
                        p.grad = d
                    outer.step()
                    global_ = [p.detach().clone() for p in params]
                dumps.append(torch.cat([g.reshape(-1) for g in global_]).tolist())
        if step >= args.steps:
            break
    print(f"final_checksum={train_diloco.checksum(global_)} step={step}", flush=True)
    os.makedirs(args.dump, exist_ok=True)
    torch.save(dumps, os.path.join(args.dump, "reference.pt"))
    return 0


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "die-in-sync":
        die_in_sync(int(sys.argv[2]))
        sys.exit(train_diloco.main(sys.argv[3:]))
    if mode == "pause-at-sync":
        pause_at_sync(int(sys.argv[2]), sys.argv[3])
        sys.exit(train_diloco.main(sys.argv[4:]))
    if mode == "join-in-step":
        join_in_step()
        sys.exit(train_diloco.main(sys.argv[2:]))
    if mode == "gate-after-join":
        gate_after_join(sys.argv[2])
        sys.exit(train_diloco.main(sys.argv[3:]))
    if mode == "reference":
        sys.exit(reference(sys.argv[2:]))
    raise SystemExit(f"unknown mode {mode!r}")

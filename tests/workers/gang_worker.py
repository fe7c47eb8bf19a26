"""A fairseq2-style training script on ``ft.gangs()``, for tests/processes/test_gang_ft.py (run by the real
``ftlaunch`` launcher, which kills and restarts groups).

Each step: ``gangs.rdp.begin_step()``, a forward/backward on this data-parallel rank's batch, the
gradients averaged over ``gangs.sdp`` (inside the replica group) and ``gangs.rdp`` (across groups,
through the Manager), and the update applied only if ``gangs.rdp.should_commit()``. Prints ``step=N
committed=...`` lines and ``final_checksum=...`` (read by the launcher's report); it trains past ``--steps``
until a step is committed by every group, so a group restarted late still ends identical and writes one JSON
record per incarnation into ``--out``: the table of tests/gang_scenarios.py on the fault-tolerant gangs (first
incarnation only, at the first step both groups are in and up to date), each step's replica gang size, and
what was left after ``gangs.close()``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: gang_scenarios, pg_helpers

import gang_scenarios as sc  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import ftlaunch  # noqa: E402
from ftlaunch.gang import ReduceOperation, all_sum, maybe_get_current_gangs  # noqa: E402


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def batch(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's share of the step's global batch: the same on every group for a given quorum."""
    g = torch.Generator().manual_seed(step * 1009 + dp_rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True) / 4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    group = int(os.environ["REPLICA_GROUP_ID"])
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record: dict = {"group": group, "rank": rank, "restart": restart, "pid": os.getpid()}

    torch.manual_seed(0)  # every group starts from the same weights (init_sync=False below)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    nn.functional.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 1)).backward()  # warm torch's pools up
    opt.zero_grad()
    before = sc.resources()
    out = Path(args.out) / f"rg{group}_r{rank}_restart{restart}_pid{os.getpid()}.json"

    ft = ftlaunch.init(model, opt, timeout=args.timeout, init_sync=False)
    gangs = ft.gangs(tp_size=args.tp_size)  # begins the first step
    tabled = restart > 0  # a restarted incarnation's peers are past the table
    sizes: dict[int, int] = {}
    together = False  # the last step was committed by every group: a restarted one has caught up
    deadline = time.monotonic() + 150
    with gangs:
        assert maybe_get_current_gangs() is gangs
        # Past --steps until a step is committed by all groups (each decides so from the same
        # quorum, so all stop after the same step): a group restarted late still ends identical.
        while (ft.manager.current_step() < args.steps or not together) and time.monotonic() < deadline:
            gangs.rdp.begin_step()
            step = ft.manager.current_step()
            if not tabled and gangs.rdp.size == 2 and ft.manager.num_participants() == 2:
                # The first step both groups are in, up to date (both decide so from the same
                # quorum): the gangs across groups do what the fake says.
                tabled = True
                record["tables"] = {
                    name: sc.run_table(getattr(gangs, name)) for name in ("rdp", "dp", "root")
                }
                record["table_sizes"] = {name: [getattr(gangs, name).rank, getattr(gangs, name).size]
                                         for name in ("rdp", "dp", "root")}  # fmt: skip
                record["table_committed"] = gangs.rdp.should_commit()
                out.write_text(json.dumps(record))  # now: this incarnation may be the one killed
                continue
            x, y = batch(step, gangs.dp.rank, gangs.dp.size)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([gr.reshape(-1) for gr in grads])
            gangs.sdp.all_reduce(flat, ReduceOperation.MEAN)  # inside the replica group
            gangs.rdp.all_reduce(flat, ReduceOperation.MEAN)  # across groups, through the Manager
            torch.nn.utils.vector_to_parameters(flat, grads)  # type: ignore[arg-type]
            total = all_sum(gangs.dp, loss.item())  # a metric over every data-parallel rank
            sizes[step] = gangs.rdp.size
            committed = gangs.rdp.should_commit()
            if committed:
                opt.step()
            together = committed and sizes[step] == ft.num_replica_groups
            # as train_ddp.py: the committed step count (a healed group jumps to its peers')
            print(f"step={ft.manager.current_step()} committed={committed} rdp_size={sizes[step]} "
                  f"loss_sum={total.item():.4f}", flush=True)  # fmt: skip
            if args.step_sleep:
                time.sleep(args.step_sleep)
    record["rdp_sizes"] = sorted(set(sizes.values()))
    record["final_step"] = ft.manager.current_step()
    print(f"final_checksum={checksum(model)} step={record['final_step']}", flush=True)

    gangs.close()  # everything: the Manager, its Baby child, the group's gangs, ft's hold on them
    after = sc.resources()
    ft.shutdown()  # a no-op by now
    record["before"], record["after"] = before, after
    print(f"close_check threads={after['threads'] - before['threads']} sockets={after['sockets']} "
          f"children={len(after['children'])} py_threads={','.join(after['py_threads'])}",
          flush=True)  # fmt: skip
    out.write_text(json.dumps(record))
    return 0 if record["final_step"] >= args.steps else 3


if __name__ == "__main__":
    sys.exit(main())

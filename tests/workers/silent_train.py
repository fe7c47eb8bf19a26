"""README's two-line form on a tiny model, printing nothing at all: the launcher's summary must get
every figure (steps, heals, rejoins, checksums) from the lighthouse.

``--die-after-group G``: group G's first process exits with code 1 after its last step, before it
shuts down (once per job: a marker file in ``--marker-dir``), so its agent restarts it after its
peers have finished -- at step 0 with nobody to heal from, so the job must end it (the lighthouse
refuses it a quorum, or the supervisor stops it), never let it train alone.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import ftlaunch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--die-after-group", type=int, default=-1)
    p.add_argument("--marker-dir", default="")
    args = p.parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ft = ftlaunch.init(model, optimizer, backend="gloo", timeout=20)
    model, optimizer = ft.wrap(model, optimizer)
    g = torch.Generator().manual_seed(group)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    while ft.manager.current_step() < args.steps:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        time.sleep(args.step_sleep)
    if group == args.die_after_group:
        try:
            os.close(os.open(os.path.join(args.marker_dir, "died"), os.O_CREAT | os.O_EXCL))
            os._exit(1)  # after its last step, before shutdown: its agent restarts it
        except FileExistsError:
            pass
    ft.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

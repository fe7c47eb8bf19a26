"""A stand-in training script for launcher tests (no torch import unless asked).

Prints ``step=N committed=True`` lines like scripts/train_ddp.py, records its environment, and fails
on command (exit code, exception, or hanging) at a given step of a given restart.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="", help="directory for one env record per worker incarnation")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--fail-group", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-restarts", default="0", help="restart counts (comma list) on which to fail; 'all' = every")
    p.add_argument("--fail-once", action="store_true",
                   help="fail only the first time in the job (a marker file in --out), whatever the restart count")
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--raise-error", action="store_true", help="fail by raising ValueError instead of exiting")
    p.add_argument("--check-torch", action="store_true")
    p.add_argument("--checksum", default="", help="print final_checksum=<this> at the end")
    p.add_argument("--probe-lighthouse", action="store_true", help="record the lighthouse's status address")
    p.add_argument("--heartbeat", action="store_true", help="rank 0 heartbeats to the lighthouse as rg<group>")
    p.add_argument("--wait-records", type=int, default=0, help="before exiting, wait for this many records")
    args = p.parse_args()

    group = int(os.environ.get("REPLICA_GROUP_ID", "-1"))
    rank = int(os.environ.get("RANK", "-1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.out:
        record = {"pid": os.getpid(), "env": dict(os.environ)}
        if args.check_torch:
            import torch.distributed as dist

            record["is_torchelastic_launched"] = dist.is_torchelastic_launched()
        if args.probe_lighthouse:
            from ftlaunch.lighthouse.client import LighthouseClient

            token = os.environ.get("FTLAUNCH_TOKEN")
            with LighthouseClient(os.environ["FTLAUNCH_LIGHTHOUSE"], connect_timeout=10, token=token) as client:
                record["lighthouse_status_address"] = client.status()["address"]
                # A request that needs the job token and changes nothing: the launch path handed it over.
                client.leave("probe-of-no-group")
                record["lighthouse_token_accepted"] = True
        path = os.path.join(args.out, f"rg{group}_r{rank}_restart{restart}_pid{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    beat = None
    if args.heartbeat and rank == 0:
        from ftlaunch.lighthouse.client import LighthouseClient

        client = LighthouseClient(os.environ["FTLAUNCH_LIGHTHOUSE"], token=os.environ.get("FTLAUNCH_TOKEN"))
        beat = client.start_heartbeat(f"rg{group}", 0.2)

    fail_here = group == args.fail_group and rank == args.fail_rank and (
        args.fail_restarts == "all" or str(restart) in args.fail_restarts.split(",")
    )
    for step in range(args.steps):
        if fail_here and step == args.fail_step and args.fail_once:
            try:
                os.close(os.open(os.path.join(args.out, f"failed-rg{group}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                fail_here = False
        if fail_here and step == args.fail_step:
            print(f"worker rg{group}/r{rank} failing on purpose at step {step}", file=sys.stderr, flush=True)
            if args.raise_error:
                raise ValueError(f"injected failure in rg{group}/r{rank} at step {step}")
            return args.exit_code
        print(f"step={step} committed=True participants=1", flush=True)
        time.sleep(args.step_time)
    deadline = time.monotonic() + 60
    while args.out and len(glob.glob(os.path.join(args.out, "*.json"))) < args.wait_records:
        if time.monotonic() > deadline:
            return 4
        time.sleep(0.05)
    if beat is not None:
        beat.stop()
    if args.checksum:
        print(f"final_checksum={args.checksum} step={args.steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

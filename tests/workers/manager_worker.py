"""A replica-group worker for Manager tests: trains a tiny model and records every step as JSON.

Environment: REPLICA_GROUP_ID, FTLAUNCH_LIGHTHOUSE, and for multi-worker groups RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True (the test hosts the group's store, as
torchelastic's agent would).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ftlaunch.worker.data_parallel import DistributedDataParallel
from ftlaunch.worker.manager import Manager
from ftlaunch.worker.optim import Optimizer


def checksum(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """Parameters, buffers (BatchNorm statistics, counters) and optimizer state: the whole state."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for b in model.buffers():
        h.update(b.detach().numpy().tobytes())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                h.update(v.numpy().tobytes())
    return h.hexdigest()[:16]


class _Slow(nn.Module):
    """Stands for real compute in a forward pass: a window in which buffers are mid-update."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class _Counting(nn.Module):
    """A buffer updated by every forward, in two places: a call counter at the start, a running
    mean of the input at the end (after the slow part)."""

    def __init__(self, features: int, seconds: float) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mean", torch.zeros(features))
        self.slow = _Slow(seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.slow(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x


def make_model(kind: str, forward_seconds: float) -> nn.Module:
    """``mlp`` (no buffers); ``bn-cnn``: convolutions with BatchNorm; ``counter``: a buffer that
    every forward updates. The last two take ``forward_seconds`` in their forward pass."""
    if kind == "bn-cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(),
            _Slow(forward_seconds), nn.Conv1d(4, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(),
            nn.Flatten(), nn.Linear(32, 4),
        )  # fmt: skip
    if kind == "counter":
        return nn.Sequential(nn.Linear(8, 16), _Counting(16, forward_seconds), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _slow_healer(out: str, delay: float, timeout: timedelta):  # noqa: ANN202 - an HTTPTransport
    """HTTP transport whose heals start ``delay`` seconds late and say so in ``out`` (with the source's
    URL), so that a test can kill the receiver or the source in the middle of a heal."""
    from ftlaunch.checkpointing import HTTPTransport

    class SlowHealer(HTTPTransport):
        def recv_checkpoint(self, src_rank, metadata, step, timeout=None):  # noqa: ANN001, ANN202
            with open(out, "a") as f:
                f.write(json.dumps({"healing": True, "t": time.time(), "src": metadata, "step": step}) + "\n")
            time.sleep(delay)
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    transport = SlowHealer(timeout=timeout)
    with open(out, "a") as f:
        f.write(json.dumps({"transport": transport.metadata()}) + "\n")
    return transport


def _tampering_source(out: str, mode: str, from_step: int, times: int, timeout: timedelta):  # noqa: ANN202
    """HTTP transport whose served state is tampered with, from step ``from_step`` on,
    ``times`` times (-1: always), each time said in ``out``:

    * ``poison``: serves other weights (+1) as a valid payload: only the source's claim can tell;
    * ``corrupt``: flips bytes of a served tensor after its checksum was taken;
    * ``truncate``: the body stream stops halfway and the connection closes.
    """
    from ftlaunch.checkpointing import HTTPTransport, _http_server

    left = [times]

    def note(step: int) -> bool:
        if step < from_step or left[0] == 0:
            return False
        left[0] -= 1
        with open(out, "a") as f:
            f.write(json.dumps({"tampered": mode, "t": time.time(), "step": step}) + "\n")
        return True

    class Tampering(HTTPTransport):
        def send_checkpoint(self, dst_ranks, step, state_dict, timeout=None):  # noqa: ANN001, ANN202
            if not note(step):
                return super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            if mode == "poison":
                model = {k: v + 1 for k, v in state_dict["default"]["model"].items()}
                state_dict = {**state_dict, "default": {**state_dict["default"], "model": model}}
                return super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            clone = {
                **state_dict,
                "default": {
                    **state_dict["default"],
                    "model": {k: v.clone() for k, v in state_dict["default"]["model"].items()},
                },
            }
            super().send_checkpoint(dst_ranks, step, clone, timeout)
            if mode == "corrupt":  # after the checksums were taken: the bytes on the wire differ
                for v in clone["default"]["model"].values():
                    v.view(-1)[0] += 1.0
            else:
                original = _http_server.runs

                def half(segments, start, end):  # noqa: ANN001, ANN202
                    from ftlaunch.checkpointing.serialization.layout import Piece

                    _http_server.runs = original  # once
                    first = next(iter(original(segments, start, end)))[0]
                    yield [Piece(first.segment, first.lo, first.lo + (first.hi - first.lo) // 2)]
                    raise ConnectionAbortedError("tampering source: body cut off")

                _http_server.runs = half
            return None

    return Tampering(timeout=timeout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--error-at-step", type=int, default=-1, help="report an error on this step (once)")
    ap.add_argument("--always-error", action="store_true")
    ap.add_argument("--max-retries", type=int, default=None)
    ap.add_argument("--model", choices=["mlp", "bn-cnn", "counter"], default="mlp")
    ap.add_argument("--forward-seconds", type=float, default=0.02, help="forward time of bn-cnn/counter")
    ap.add_argument(
        "--same-data",
        action="store_true",
        help="every group draws the same batches (rank r of each group the same): honest groups then "
        "hold bit-identical state at every step, buffers that the forward updates included",
    )
    ap.add_argument(
        "--hold-file",
        default=None,
        help="while this file exists, every step sleeps a second more (a test keeps a survivor from "
        "finishing before a restarted peer is back, without stopping it)",
    )
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--transport", default="http")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--connect-timeout", type=float, default=10.0)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument(
        "--hang-at-step",
        type=int,
        default=-1,
        help="the training thread hangs after backward at this step (heartbeats go on)",
    )
    ap.add_argument("--hang-seconds", type=float, default=0.0)
    ap.add_argument(
        "--tamper",
        choices=["poison", "corrupt", "truncate"],
        default=None,
        help="serve tampered state when healing others (see _tampering_source)",
    )
    ap.add_argument("--tamper-from-step", type=int, default=1)
    ap.add_argument("--tamper-times", type=int, default=1, help="-1: always")
    ap.add_argument(
        "--heal-delay",
        type=float,
        default=0.0,
        help="a heal (HTTP) waits this long before fetching, and records that it started",
    )
    ap.add_argument(
        "--sync",
        choices=["ddp", "managed-pg"],
        default="ddp",
        help="gradient sync: ftlaunch DDP, or dist.all_reduce over a ManagedProcessGroup",
    )
    ap.add_argument(
        "--child-start-delay",
        type=float,
        default=0.0,
        help="Baby children sleep this long before importing torch (a slow start)",
    )
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )

    group = int(os.environ["REPLICA_GROUP_ID"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    intra = None
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        intra = dist.group.WORLD
    rank = int(os.environ.get("RANK", "0"))

    from ftlaunch.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    if args.child_start_delay:
        from ftlaunch.bootstrap import prestart

        prestart.CHILD_ARGV = [
            "-c",
            (
                f"import runpy, time; time.sleep({args.child_start_delay}); "
                f"runpy.run_module({prestart.CHILD_MODULE!r}, run_name='__main__', alter_sys=True)"
            ),
        ]
    if args.backend == "baby-gloo":
        pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=args.timeout))
    else:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(100 + group)  # groups start with different weights: init_sync must fix that
    model = make_model(args.model, args.forward_seconds)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    transport = None
    if args.heal_delay > 0:
        transport = _slow_healer(args.out, args.heal_delay, timedelta(seconds=args.timeout))
    if args.tamper:
        transport = _tampering_source(
            args.out, args.tamper, args.tamper_from_step, args.tamper_times, timedelta(seconds=args.timeout)
        )
    if args.transport == "pg":
        from ftlaunch.checkpointing import PGTransport

        transport = PGTransport(pg, timeout=timedelta(seconds=args.timeout), device=torch.device("cpu"))
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=args.connect_timeout),
        max_retries=args.max_retries,
        checkpoint_transport=transport,
    )
    if args.sync == "managed-pg":
        from ftlaunch.worker.managed_pg import ManagedProcessGroup

        mpg = ManagedProcessGroup(manager)
        ddp = model
    else:
        ddp = DistributedDataParallel(manager, model, intra_group=intra)
    opt = Optimizer(manager, inner)
    deadline = time.monotonic() + args.max_seconds
    out = open(args.out, "a", buffering=1)
    errored_once = False
    try:
        while manager.current_step() < args.steps and time.monotonic() < deadline:
            opt.zero_grad()
            step = manager.current_step()
            g = torch.Generator().manual_seed(step * 7919 + (0 if args.same_data else group * 31) + rank)
            x = torch.randn(4, 8, generator=g)
            loss = ddp(x).pow(2).mean()
            loss.backward()
            if args.sync == "managed-pg":
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=mpg)
            if step == args.hang_at_step and args.hang_seconds > 0:
                out.write(json.dumps({"hang": True, "t": time.time(), "step": step}) + "\n")
                time.sleep(args.hang_seconds)  # stuck like a hung intra-group collective
                args.hang_seconds = 0
            if args.always_error or (step == args.error_at_step and not errored_once):
                errored_once = True
                manager.report_error(RuntimeError(f"injected failure at step {step}"))
            t = time.time()
            committed = opt.step()
            out.write(
                json.dumps(
                    {
                        "t": t,
                        "step": step,
                        "committed": committed,
                        "after": manager.current_step(),
                        "participants": manager.num_participants(),
                        "checksum": checksum(model, inner),
                        "pid": os.getpid(),
                        "rank": rank,
                    }
                )
                + "\n"
            )
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.hold_file and os.path.exists(args.hold_file):
                time.sleep(1.0)
        out.write(
            json.dumps(
                {
                    "final": True,
                    "step": manager.current_step(),
                    "checksum": checksum(model, inner),
                    "rank": rank,
                }
            )
            + "\n"
        )
    except Exception as e:  # reported to the test as a line, then re-raised for the exit code
        out.write(json.dumps({"exception": type(e).__name__, "message": str(e)}) + "\n")
        raise
    finally:
        manager.shutdown()
        if intra is not None:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The built-in health check: ``python -m ftlaunch.health`` (docs/launcher.md, *Health checks*).

Give it to ``--health-check`` (or the rendezvous's ``health_check`` key, the torchx components'
``--health_check``): each group's agent runs it before the group's workers start or restart, and a
failure keeps the group out until it passes. It checks what a node can get wrong before training
starts, each check one line of output, then a verdict line (the line ftlaunch reports):

- ``device``: every visible GPU answers a small CUDA computation correctly (and says its free
  memory); skipped, with the reason, where no GPU is visible (a CPU run);
- ``checkpoint``: ``--checkpoint-dir`` takes a file (written, synced, read back, removed); skipped
  when none is given;
- ``memory``: at least ``--min-free-memory`` GiB of host memory available;
- ``lighthouse``: the job's lighthouse answers (``FTLAUNCH_LIGHTHOUSE``, which the rendezvous sets
  before the check runs, or ``--lighthouse``); skipped when none is known;
- each ``--hook MODULE:FUNCTION``: your own check in Python, called without arguments; it passes
  when it returns None or True, fails when it returns False or a string (the reason) or raises.

Exit status 0 when nothing failed, 1 otherwise, 2 for a usage error. `run_checks` is the same as a
function, for a hook of your own that wants the built-ins too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil

from ftlaunch import env

OK, SKIP, FAIL = "ok", "skip", "FAIL"
#: Host memory a node needs free by default (GiB).
DEFAULT_MIN_FREE_GIB = 1.0
#: Device nodes that say an NVIDIA GPU is attached (without importing torch: a CPU node skips fast).
_NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia0")


@dataclass(frozen=True)
class Result:
    """One check's outcome: `OK`, `SKIP` or `FAIL`, and why."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}"


def check_device() -> Result:
    """Every visible GPU computes a small sum correctly; skipped where none is visible."""
    if env.gpus_hidden():
        return Result("device", SKIP, f"no GPU visible ({env.CUDA_VISIBLE_DEVICES} hides them): a CPU run")
    if not any(os.path.exists(p) for p in _NVIDIA_NODES):
        return Result("device", SKIP, "no GPU on this machine (no /dev/nvidia*): a CPU run")
    import torch

    if torch.version.cuda is None:
        return Result("device", SKIP, f"torch {torch.__version__} is built without CUDA: a CPU run")
    try:
        count = torch.cuda.device_count()
        if count == 0 or not torch.cuda.is_available():
            return Result("device", FAIL, "the machine has an NVIDIA GPU but CUDA sees none (driver?)")
        seen = []
        for i in range(count):
            dev = torch.device("cuda", i)
            x = torch.arange(1 << 16, dtype=torch.float64, device=dev)
            got = float((x * 2).sum().item())
            want = float((1 << 16) * ((1 << 16) - 1))
            if got != want:
                return Result("device", FAIL, f"cuda:{i} computed {got!r} for a sum of {want!r}")
            free, total = torch.cuda.mem_get_info(dev)
            seen.append(
                f"cuda:{i} {torch.cuda.get_device_name(dev)} ({free / 2**30:.1f}/{total / 2**30:.1f} "
                "GiB free)"
            )
        return Result("device", OK, "; ".join(seen))
    except Exception as e:  # noqa: BLE001 - a sick GPU fails in many ways: each is the verdict
        return Result(
            "device", FAIL, f"CUDA error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        )


def check_checkpoint_dir(path: str | None) -> Result:
    """``path`` takes a file: written, synced, read back and removed; skipped without a path."""
    if not path:
        return Result("checkpoint", SKIP, "no --checkpoint-dir given")
    if not os.path.isdir(path):
        return Result("checkpoint", FAIL, f"{path} is not a directory")
    payload = os.urandom(4096)
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ftlaunch-health-", delete=True) as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            if f.read() != payload:
                return Result("checkpoint", FAIL, f"{path}: a file written there read back different")
    except OSError as e:
        return Result("checkpoint", FAIL, f"{path} is not writable: {e.strerror or e}")
    return Result("checkpoint", OK, f"{path} is writable")


def check_memory(min_free_gib: float) -> Result:
    """At least ``min_free_gib`` GiB of host memory available."""
    free = psutil.virtual_memory().available / 2**30
    if free < min_free_gib:
        return Result("memory", FAIL, f"{free:.2f} GiB of host memory available, under {min_free_gib:g} GiB")
    return Result("memory", OK, f"{free:.1f} GiB of host memory available")


def check_lighthouse(address: str | None, timeout: float, token: str | None) -> Result:
    """The lighthouse answers ``GET /status`` within ``timeout``; skipped when none is known."""
    if not address:
        return Result("lighthouse", SKIP, f"no lighthouse known (${env.FTLAUNCH_LIGHTHOUSE} unset)")
    from ftlaunch.lighthouse.client import LighthouseClient

    try:
        with LighthouseClient(address, connect_timeout=timeout, token=token) as client:
            client.status()
    except Exception as e:  # noqa: BLE001 - unreachable, refused, not a lighthouse: all the verdict
        return Result("lighthouse", FAIL, f"{address} does not answer: {e}")
    return Result("lighthouse", OK, f"{address} answers")


def run_hook(spec: str) -> Result:
    """Call ``MODULE:FUNCTION`` (see the module docstring for what passes)."""
    module, _, name = spec.partition(":")
    try:
        fn: Callable[[], object] = getattr(importlib.import_module(module), name)
        got = fn()
    except Exception as e:  # noqa: BLE001 - the user's check failed: that is its verdict
        return Result(spec, FAIL, f"{type(e).__name__}: {e}")
    if got is None or got is True:
        return Result(spec, OK, "passed")
    if got is False:
        return Result(spec, FAIL, "returned False")
    return Result(spec, FAIL, str(got))


def run_checks(
    *,
    checkpoint_dir: str | None = None,
    min_free_gib: float = DEFAULT_MIN_FREE_GIB,
    lighthouse: str | None = None,
    lighthouse_timeout: float = 5.0,
    hooks: Sequence[str] = (),
    device: bool = True,
) -> list[Result]:
    """Every check, in order (device, checkpoint, memory, lighthouse, hooks)."""
    results = [check_device()] if device else []
    results += [
        check_checkpoint_dir(checkpoint_dir),
        check_memory(min_free_gib),
        check_lighthouse(lighthouse, lighthouse_timeout, env.job_token()),
    ]
    return results + [run_hook(h) for h in hooks]


def verdict(results: Sequence[Result]) -> str:
    """The last line: what failed (the first failure, and how many more), or what passed."""
    failed = [r for r in results if r.status == FAIL]
    if failed:
        more = f" (and {len(failed) - 1} more check(s) failed)" if len(failed) > 1 else ""
        return f"unhealthy: {failed[0].name}: {failed[0].detail}{more}"
    skipped = sum(1 for r in results if r.status == SKIP)
    return f"healthy: {len(results) - skipped} check(s) passed, {skipped} skipped"


def _hook_spec(text: str) -> str:
    module, sep, name = text.partition(":")
    if not sep or not module or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not MODULE:FUNCTION")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ftlaunch.health",
        description="Check this node before a replica group's workers start (ftlaunch --health-check).",
    )
    p.add_argument("--checkpoint-dir", metavar="DIR", help="a directory that must take a file")
    p.add_argument(
        "--min-free-memory",
        type=float,
        default=DEFAULT_MIN_FREE_GIB,
        metavar="GIB",
        help=f"host memory that must be available (default {DEFAULT_MIN_FREE_GIB:g} GiB)",
    )
    p.add_argument(
        "--lighthouse", metavar="ADDR", help=f"the lighthouse to reach (default ${env.FTLAUNCH_LIGHTHOUSE})"
    )
    p.add_argument("--lighthouse-timeout", type=float, default=5.0, metavar="SECONDS", help="default 5")
    p.add_argument("--no-device", action="store_true", help="skip the GPU check")
    p.add_argument(
        "--hook",
        action="append",
        default=[],
        type=_hook_spec,
        metavar="MODULE:FUNCTION",
        help="a check of your own (None/True: passed; False, a string or an exception: failed); repeatable",
    )
    args = p.parse_args(argv)
    if args.min_free_memory < 0 or args.lighthouse_timeout <= 0:
        p.error("--min-free-memory must be >= 0 and --lighthouse-timeout > 0")
    results = run_checks(
        checkpoint_dir=args.checkpoint_dir,
        min_free_gib=args.min_free_memory,
        lighthouse=args.lighthouse or env.lighthouse_address(),
        lighthouse_timeout=args.lighthouse_timeout,
        hooks=args.hook,
        device=not args.no_device,
    )
    for r in results:
        print(r.line())
    print(verdict(results))
    return 1 if any(r.status == FAIL for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Start a worker's Baby Gloo child before the training script imports torch, and hand it over.

Why: a restarted worker is ready to rejoin only when its Baby process group's child -- a second
interpreter that must import torch too -- serves requests. Started by ``ftlaunch.init`` it begins
after the script's own imports and model building, and the two imports run one after the other
(about 2 s on a loaded 2-core machine). Started here, first thing in the worker process, the child
imports torch *while* the script does.

The ``ftlaunch`` launcher runs each worker as ``python -u -m ftlaunch.prestart SCRIPT ARGS...``
(or ``... -m ftlaunch.prestart -m MODULE ARGS...``): `main` starts the child and then runs the
script exactly as ``python SCRIPT`` would (``__main__``, ``sys.argv``, ``sys.path[0]``). The first
``ProcessGroupBabyGloo`` the script builds (``ftlaunch.init`` builds it) adopts the child through
`take`; one nobody adopts is killed at exit (and dies with the worker anyway: PDEATHSIG, its
watchdog, the closed socket). ``torchrun --rdzv-backend ftlaunch`` and torchx run the user's
command line unchanged: there the child starts in ``ftlaunch.init``.

Nothing here imports torch: that is the point. The child is skipped when the job chose another
backend (``FTLAUNCH_BACKEND``) or the machine has an NVIDIA GPU (the default is Baby NCCL there).
"""

from __future__ import annotations

import atexit
import os
import runpy
import socket
import subprocess
import sys
import threading

from ftlaunch import env, phases, streams

__all__ = ["main", "release", "spawn", "start", "take", "wanted"]

#: The module the child runs (a string: importing it would import torch).
CHILD_MODULE = "ftlaunch.process_group._baby_child"
#: The interpreter arguments that run it (tests replace them to start a slow child).
CHILD_ARGV = ["-m", CHILD_MODULE]

_lock = threading.Lock()
_started: dict[str, tuple[subprocess.Popen[bytes], socket.socket]] = {}


def spawn(backend: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start a Baby child for ``backend``: (its process, this end of its private socketpair)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    use_pdeathsig = threading.current_thread() is threading.main_thread()  # PDEATHSIG is per thread
    cmd = [
        sys.executable, *CHILD_ARGV,
        "--fd", str(child_sock.fileno()),
        "--parent-pid", str(os.getpid()),
        "--backend", backend,
        "--pdeathsig", "1" if use_pdeathsig else "0",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL)
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    phases.mark("baby_child_spawn", child=proc.pid)
    return proc, parent_sock


def start(backend: str = "gloo") -> None:
    """Start one child for ``backend`` now, for the first process group of that backend to take."""
    with _lock:
        if backend in _started:
            return
        _started[backend] = spawn(backend)
        if len(_started) == 1:
            atexit.register(_discard_all)


def take(backend: str) -> tuple[subprocess.Popen[bytes], socket.socket] | None:
    """The child started for ``backend``, once (None if none was, or it already died)."""
    with _lock:
        started = _started.pop(backend, None)
    if started is None:
        return None
    if started[0].poll() is not None:
        _discard(*started)
        return None
    return started


def release(backend: str) -> None:
    """Stop the child started for ``backend`` if nobody adopted it (the job chose another backend)."""
    started = take(backend)
    if started is not None:
        _discard(*started)


def _discard(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
    sock.close()  # the child exits when its socket closes; make sure
    try:
        proc.kill()
        proc.wait(timeout=5.0)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _discard_all() -> None:
    with _lock:
        left = list(_started.values())
        _started.clear()
    for started in left:
        _discard(*started)


def wanted() -> bool:
    """Whether this worker will likely build a Baby Gloo group (the default on a machine without
    an NVIDIA GPU, or chosen explicitly)."""
    backend = (os.environ.get(env.FTLAUNCH_BACKEND) or "").strip().lower().replace("_", "-")
    if backend:
        return backend == "baby-gloo"
    gpus_hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    return gpus_hidden or not os.path.exists("/dev/nvidiactl")


def main(argv: list[str] | None = None) -> None:
    """``python -m ftlaunch.prestart [-m MODULE | SCRIPT] ARGS...``: start the child, run the script."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m ftlaunch.prestart [-m MODULE | SCRIPT] [ARGS...]")
    streams.guard_std_streams()  # a full log disk must not end training (ftlaunch/streams.py)
    if wanted():
        try:
            start("gloo")
        except OSError as e:  # the script still runs; ftlaunch.init starts a child itself
            print(f"ftlaunch.prestart: could not start the Baby child early: {e}", file=sys.stderr)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file, as python -m does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts first
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy's: `take` (called from the process
    # group) must see the children started here.
    from ftlaunch import prestart

    prestart.main()

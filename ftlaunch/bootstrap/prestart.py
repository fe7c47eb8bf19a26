"""Start a worker's Baby child (Gloo, or NCCL on a GPU machine) before the script runs, and hand it over.

Why: a restarted worker is ready to rejoin only when its Baby process group's child -- a second
process that needs torch too -- serves requests. Started by ``ftlaunch.init`` it begins after the
script's own imports and model building. Started here, first thing in the worker process, it is up
long before the script needs it.

The ``ftlaunch`` launcher runs each worker as ``python -u -m ftlaunch.bootstrap.prestart SCRIPT ARGS...``
(or ``... -m ftlaunch.bootstrap.prestart -m MODULE ARGS...``): `main` starts the child and then runs the
script exactly as ``python SCRIPT`` would (``__main__``, ``sys.argv``, ``sys.path[0]``). The first
Baby group of that backend the script builds (``ftlaunch.init`` builds it) adopts the child through
`take`; one nobody adopts is killed at exit (and dies with the worker anyway: PDEATHSIG, its
watchdog, the closed socket). The torchx components run every worker this way too; under plain
``torchrun`` the user asks for it with ``-m ftlaunch.run`` (`ftlaunch.run`, this module's public
name) in front of the script. A worker run otherwise starts its child in ``ftlaunch.init``.

**One torch import, not two** (`fork`): by default `main` imports torch here -- the script would
import it first thing anyway -- and forks the child from this process, so the child starts with
torch already imported instead of importing it again (on a loaded 2-core machine the second
import competed with the first for the CPU and cost the restart about a second). A fork is only
safe from a process running no other thread: right after the fork the parent looks, and keeps
the child only if no other thread was alive at the fork (the only thread ``import torch`` starts,
NumPy's OpenBLAS pool, is stopped by OpenBLAS's own at-fork handler); otherwise the child, still
blocked before its first instruction of its own, is killed and an interpreter is started instead
(`spawn`). Children started later (a replacement after a lost child) are always `spawn`ed: by then
the worker runs threads. ``FTLAUNCH_PRESTART_FORK=0`` turns the early import off (for a script that
must set something in its environment before torch is imported): the child is then its own
interpreter importing torch while the script does.

**No import at all where a warm standby is announced** (`ftlaunch.bootstrap.zygote`): the ``ftlaunch``
launcher's agent, and the ``ftlaunch`` rendezvous inside torchrun's, keep per group node an
interpreter that has imported torch already. `main` first
hands the script over to it (`ftlaunch.bootstrap.zygote_proxy.hand_over`): the standby forks, the fork runs
`run` with this process's argv, cwd, environment and standard streams, and this process stays as
its proxy until it ends. Without a standby, or if it refuses, this process runs the script itself.

The child's backend is the one the job will likely use (`wanted`): Baby NCCL on a machine with an
NVIDIA GPU, Baby Gloo elsewhere, or what ``FTLAUNCH_BACKEND`` chose; none for another backend. On a
GPU the child waits with CUDA untouched and creates its own context when first configured, with
the worker's environment of that moment (the script may set ``NCCL_*`` variables after this fork).
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn, Union

from ftlaunch import env, phases, streams
from ftlaunch.errors import ConfigurationError

__all__ = [
    "ChildProcess",
    "ForkedChild",
    "fork",
    "fork_wanted",
    "main",
    "release",
    "run",
    "spawn",
    "start",
    "take",
    "wanted",
]

#: The module the child runs (a string: importing it would import torch).
CHILD_MODULE = "ftlaunch.process_group.baby.child"
#: The interpreter arguments that run it (tests replace them to start a slow child).
CHILD_ARGV = ["-m", CHILD_MODULE]

#: The byte a forked child waits for before it runs anything of its own (`fork`).
_GO = b"g"


class ForkedChild:
    """A child made by `fork`, with the part of ``subprocess.Popen``'s interface the Baby handle
    uses (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._waitpid_lock = threading.Lock()  # one reaper at a time; poll() never blocks on it

    def poll(self) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(blocking=False):
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as subprocess does
                self.returncode = 0
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired([f"forked baby child {self.pid}"], timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # never signal a pid that was reaped (and maybe reused)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


#: A Baby child: an interpreter of its own (`spawn`) or a fork of the worker (`fork`).
ChildProcess = Union[subprocess.Popen[bytes], ForkedChild]  # noqa: UP007 - a runtime alias

_lock = threading.Lock()
_started: dict[str, tuple[ChildProcess, socket.socket]] = {}
#: Children forked beside the first (`start`), for the process group's later children to take.
_spares: dict[str, list[tuple[ChildProcess, socket.socket]]] = {}
#: How many spare children `start` forks beside the first. Why: an abort (a hung peer,
#: worker/hang_abort.py) kills the child, and its replacement, spawned then, imported torch for
#: seconds (3.5 s seen in the soak at load 4) while the group's peers waited for its configure. A
#: fork of this process costs milliseconds and, idle, little memory (its pages are shared with the
#: worker until written); later forks are not possible (the worker runs threads by then).
FORKED_SPARES = 1


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


def _live_threads() -> int:
    """Threads of this process now, as the kernel counts them (Python's count misses native ones)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def fork(backend: str, *, spare: bool = False) -> tuple[ChildProcess, socket.socket]:
    """Fork a Baby child for ``backend`` from this process (which should have imported torch and
    run no thread); an interpreter of its own (`spawn`) where the fork is not provably safe.

    The forked child first waits for one byte. Right after the fork the parent counts its
    threads: one (itself) means no other thread was alive at the fork -- none could have held a
    lock the child inherits locked -- and the child is let go; more, and the child is killed
    before it ran anything of its own. A ``spare`` is let go only when taken (`take`): until then
    it waits, blocked, costing no CPU while the worker starts (and exits when the worker does:
    its socket then reads EOF)."""
    if not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"):
        return spawn(backend)
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    parent_pid = os.getpid()
    try:
        pid = os.fork()
    except BaseException:
        parent_sock.close()
        child_sock.close()
        raise
    if pid == 0:
        _forked_child(parent_sock, child_sock, backend, parent_pid)
    child_sock.close()
    proc = ForkedChild(pid)
    threads = _live_threads()
    if threads != 1:
        parent_sock.close()  # EOF instead of the go byte: the child exits at once
        proc.kill()
        proc.wait(timeout=5.0)
        phases.mark("baby_child_fork_refused", threads=threads)
        return spawn(backend)
    if spare:
        phases.mark("baby_child_spare", child=pid, forked=True)
        return proc, parent_sock  # let go when taken
    if not _let_go(proc, parent_sock):
        return spawn(backend)
    phases.mark("baby_child_spawn", child=pid, forked=True)
    return proc, parent_sock


def _let_go(proc: ChildProcess, parent_sock: socket.socket) -> bool:
    """Send a forked child its go byte; False (and the child gone) when it cannot be sent."""
    try:
        parent_sock.sendall(_GO)
    except OSError:
        parent_sock.close()
        proc.kill()
        proc.wait(timeout=5.0)
        return False
    return True


def _forked_child(
    parent_sock: socket.socket, child_sock: socket.socket, backend: str, parent_pid: int
) -> NoReturn:
    """The forked child: wait for the parent's go, then run the Baby child's module as ``python -m``
    would; never return into the worker's code (``os._exit``: no atexit, no buffers flushed twice)."""
    code = 1
    try:
        parent_sock.close()
        fd = child_sock.detach()  # the child's Connection owns (and closes) the descriptor
        if os.read(fd, 1) == _GO:
            devnull = os.open(os.devnull, os.O_RDONLY)  # as `spawn`'s child: never the worker's stdin
            os.dup2(devnull, 0)
            os.close(devnull)
            sys.argv = [CHILD_MODULE, "--fd", str(fd), "--parent-pid", str(parent_pid), "--backend", backend,
                        "--pdeathsig", "1"]  # fmt: skip
            runpy.run_module(CHILD_MODULE, run_name="__main__", alter_sys=True)
            code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - report and leave; never unwind into the worker's code
        traceback.print_exc()
    finally:
        os._exit(code)


def fork_wanted() -> bool:
    """Whether `main` may import torch and fork the child (``FTLAUNCH_PRESTART_FORK``, default on)."""
    return env.prestart_fork()


def start(backend: str = "gloo", forked: bool = False) -> None:
    """Start one child for ``backend`` now, for the first process group of that backend to take
    (with ``forked``, by `fork`: the caller has imported torch and runs no thread)."""
    with _lock:
        if backend in _started:
            return
    started = fork(backend) if forked else spawn(backend)  # outside the lock: a fork must not copy it held
    spares = []
    if isinstance(started[0], ForkedChild):  # still provably single-threaded: fork the spares too
        spares = [fork(backend, spare=True) for _ in range(FORKED_SPARES)]
    with _lock:
        if backend in _started:
            for extra in (started, *spares):
                _discard(*extra)
            return
        _started[backend] = started
        _spares.setdefault(backend, []).extend(s for s in spares if isinstance(s[0], ForkedChild))
        if len(_started) == 1:
            atexit.register(_discard_all)
    for extra in spares:
        if not isinstance(extra[0], ForkedChild):  # the fork was refused: no spare, not a spawn's import
            _discard(*extra)


def take(backend: str) -> tuple[ChildProcess, socket.socket] | None:
    """The child started for ``backend``, once, then each spare forked with it, once (None when
    none is left alive)."""
    while True:
        spare = False
        with _lock:
            started = _started.pop(backend, None)
            if started is None and _spares.get(backend):
                started, spare = _spares[backend].pop(0), True
        if started is None:
            return None
        if started[0].poll() is None and (not spare or _let_go(*started)):
            if spare:
                phases.mark("baby_child_spawn", child=started[0].pid, forked=True, spare=True)
            return started
        _discard(*started)


def release(backend: str) -> None:
    """Stop the children started for ``backend`` that nobody adopted (the job chose another backend)."""
    with _lock:
        first = _started.pop(backend, None)
        left = ([first] if first is not None else []) + _spares.pop(backend, [])
    for started in left:  # a spare is never let go: it exits when its socket closes
        _discard(*started)


def _discard(proc: ChildProcess, sock: socket.socket) -> None:
    sock.close()  # the child exits when its socket closes; make sure
    try:
        proc.kill()
        proc.wait(timeout=5.0)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _discard_all() -> None:
    with _lock:
        left = [*_started.values(), *(s for spares in _spares.values() for s in spares)]
        _started.clear()
        _spares.clear()
    for started in left:
        _discard(*started)


def wanted() -> str | None:
    """The Baby backend this worker will likely build, whose child to start now: ``"gloo"`` on a
    machine without an NVIDIA GPU (or with the GPUs hidden), ``"nccl"`` on one with (the default
    there, as for a model on the GPU), or the one chosen by ``FTLAUNCH_BACKEND``; None for a backend
    with no child. A child nobody adopts (a CPU model on a GPU machine) is stopped at exit.

    An NCCL child forked here starts with torch imported and CUDA untouched -- nothing here touches
    it -- and creates its own CUDA context at its first configure, which also hands it the
    worker's environment as it is then (an ``NCCL_*`` variable the script set after this fork)."""
    try:
        backend = env.backend()
    except ConfigurationError:
        return None  # ftlaunch.init reports the bad value; no child for it meanwhile
    if backend:
        return {"baby-gloo": "gloo", "baby-nccl": "nccl"}.get(backend)
    return "gloo" if env.gpus_hidden() or not os.path.exists("/dev/nvidiactl") else "nccl"


def _import_torch() -> bool:
    """Import torch now (the script's own ``import torch`` then finds it); False if it cannot be
    imported here (the script reports that itself)."""
    try:
        import torch  # noqa: F401 - the one import the worker and its Baby child share
    except ImportError:
        return False
    return True


#: The script's globals, kept until the interpreter exits. `python SCRIPT` keeps ``__main__``'s
#: globals alive through the atexit handlers; runpy hands back a copy and drops its own, so without
#: this a script's objects (README's two-line form: its `FaultTolerance`, which leaves the quorum at
#: exit) could be collected before the atexit handler that still needs them runs.
_script_globals: list[dict[str, object]] = []


def main(
    argv: list[str] | None = None, prog: str = "ftlaunch.bootstrap.prestart", description: str | None = None
) -> None:
    """``python -m ftlaunch.bootstrap.prestart [-m MODULE | SCRIPT] ARGS...`` (public name:
    ``ftlaunch.run``, ``prog``, whose ``description`` is its ``--help``): hand the script to the
    agent's warm standby interpreter if there is one (`ftlaunch.bootstrap.zygote_proxy`: this
    process then stays as its proxy), else start the child and run the script here."""
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: python -m {prog} [-m MODULE | SCRIPT] [ARGS...]"
    if argv[:1] in (["-h"], ["--help"]):  # only in front: after the script, the flags are the script's
        print(
            description
            or f"{usage}\n\nRun SCRIPT (or MODULE) as `python SCRIPT` would, as an ftlaunch worker."
        )
        raise SystemExit(0)
    if not argv or argv == ["-m"]:
        raise SystemExit(f"{usage}\n(python -m {prog} --help says more)")
    streams.guard_std_streams()  # a full log disk must not end training (ftlaunch/streams.py)
    if fork_wanted():  # FTLAUNCH_PRESTART_FORK=0: the script must run before torch is imported
        from ftlaunch.bootstrap import zygote_proxy

        why_not = zygote_proxy.hand_over(argv)  # returns only if the standby was not used
        if why_not:
            print(
                f"ftlaunch.bootstrap.prestart: {why_not}; starting the worker here",
                file=sys.stderr,
                flush=True,
            )
    run(argv, forked=fork_wanted())


def run(argv: list[str], forked: bool) -> None:
    """Start the Baby child (with ``forked``, from this process once torch is imported) and run
    ``argv`` (``-m MODULE ...`` or ``SCRIPT ...``) as ``python`` would, in this process."""
    backend = wanted()
    if backend is not None:
        try:
            start(backend, forked=forked and _import_torch())
        except OSError as e:  # the script still runs; ftlaunch.init starts a child itself
            print(f"ftlaunch.bootstrap.prestart: could not start the Baby child early: {e}", file=sys.stderr)
    phases.mark("script_start")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file, as python -m does
        _script_globals.append(runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts first
        _script_globals.append(runpy.run_path(script, run_name="__main__"))


if __name__ == "__main__":
    # Run the importable module's main, not this __main__ copy's: `take` (called from the process
    # group) must see the children started here.
    from ftlaunch.bootstrap import prestart

    prestart.main()

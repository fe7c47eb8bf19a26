"""A warm standby interpreter per replica group: torch imported once, forked for every (re)start.

Why: from a worker's death to its replacement's first committed step, most of the seconds are the
new interpreter's imports -- ``import torch`` and, at the first optimizer, ``torch._dynamo`` -- not
ftlaunch. The process that starts a group node's workers starts this one once (``python -u -m
ftlaunch.bootstrap.zygote SOCKET --fd FD --parent-pid AGENT``; `ftlaunch.launcher.standby`: the
``ftlaunch`` launcher's agent, or the ``ftlaunch`` rendezvous inside torchrun's agent): it imports
what every training script imports, then waits on a Unix socket. It listens from its first instant
(the socket comes bound and listening), so a worker that starts while it warms up (the group's
first start, or the first after its agent was respawned) waits for it instead of importing torch
beside it; the warm-up runs at a lower CPU priority where it can be raised back afterwards
(`_lower_priority`: it competes with the groups that train). With ``--on-demand`` (torchrun's agent,
which cannot tell whether its workers will ask) it warms up only when the first worker connects,
at full priority (that worker waits for it). A worker started by torchelastic (``python -u -m
ftlaunch.run SCRIPT ...``, or ``-m ftlaunch.bootstrap.prestart``) connects (`ftlaunch.bootstrap.zygote_proxy`)
and sends its argv, cwd, environment, ``sys.path`` and its fds 0/1/2; this process forks, and the child takes
all of them over and runs the script exactly as
``python -u SCRIPT`` would (`ftlaunch.bootstrap.prestart.run`, which forks the Baby child from there too).
The worker stays as the child's proxy.

This process watches both ends (single-threaded: a fork is only safe from a process running no
other thread, which is checked after every fork as `ftlaunch.bootstrap.prestart.fork` does):

* the child's end (``waitpid``, woken by SIGCHLD) goes to its proxy, which ends the same way;
* a proxy's socket closing (it was SIGKILLed) SIGKILLs the child's process group (the child is
  its own session, its Baby child with it) at once;
* a stopped proxy (chaos' SIGSTOP) stops the child within ``_POLL_S``, and a continued one
  continues it; a child stopped directly stops its proxy (so the agent, which watches the proxy,
  sees the hang).

Torch reads a few environment variables when it is imported; the child applies
``OMP_NUM_THREADS`` (``torch.set_num_threads``), the rest are the agent's (docs/launcher.md).
The agent's death takes this process down (PDEATHSIG), and the children with it (theirs).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import resource
import select
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

from ftlaunch import env, phases, streams
from ftlaunch.bootstrap import zygote_proxy
from ftlaunch.bootstrap.zygote_proxy import read_message, send_message
from ftlaunch.lifetime import die_with_parent

__all__ = ["Job", "Zygote", "main", "warm_up"]

#: How often the stopped/continued state of the proxies is compared with their workers' (seconds).
_POLL_S = 0.05
#: Modules imported ahead, by name: a preload list, not a dependency of this module (the layer rule
#: is about what a module uses; the zygote uses none of them itself).
PRELOAD = ("torch.distributed", "torch.nn.parallel", "torch.utils.data", "ftlaunch")
#: The byte the forked child waits for before it runs anything of its own.
_GO = b"g"
#: How much lower the warm-up's CPU priority is (nice), where it can be raised back (`_lower_priority`).
WARM_UP_NICE = 10


def warm_up() -> None:
    """Import what a training script's start costs, script-independent: torch, its optimizers and
    ``torch._dynamo`` (the first ``torch.optim`` call imports it), and ftlaunch. No tensor op runs
    on a thread pool: this process must stay single-threaded."""
    import torch
    import torch._dynamo  # noqa: F401 - what the first optimizer step would import
    import torch.nn
    import torch.optim

    for name in PRELOAD:
        importlib.import_module(name)
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # lazy imports of the first optimizer


@dataclass
class _Pair:
    """A real worker (forked here) and its proxy."""

    pid: int
    proxy_pid: int
    conn: socket.socket
    #: Which end was stopped first ("proxy" or "worker"; None: neither). Only that end's continue
    #: continues the other: a stop sent to the other end takes effect later (when it is next
    #: scheduled), and reading its state before then must not count as a continue.
    stopped_by: str | None = None


@dataclass
class Job:
    """What a forked child runs: the proxy's request, with its descriptors for 0/1/2."""

    request: dict[str, Any]
    fds: list[int]

    def run(self) -> None:
        """Become the worker the proxy stands for, then run its script (in the forked child)."""
        req = self.request
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        for fd in self.fds:
            if fd > 2:
                os.close(fd)
        streams.guard_std_streams()  # as prestart's main does: a full log disk must not end training
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("proxy_pid"):
            env.publish({env.FTLAUNCH_WORKER_PID: str(req["proxy_pid"])})
        sys.path[:] = list(req["path"])
        threads = env.omp_num_threads()
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        phases.mark(
            "zygote_forked",
            proxy=req.get("proxy_pid"),
            process_start=phases.process_start_time(req.get("proxy_pid")),
        )
        from ftlaunch.bootstrap import prestart

        prestart.run(list(req["argv"]), forked=True)


def _live_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` ('' when gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :][:1].decode()
    except (OSError, ValueError):
        return ""


class Zygote:
    """The server: accepts proxies, forks workers, relays their ends. `serve` returns only in a
    forked child (the `Job` it must run) or when told to stop (None)."""

    def __init__(
        self, path: str, parent_pid: int | None = None, listener: socket.socket | None = None
    ) -> None:
        """Listen on ``path``, or on ``listener``: a socket bound to ``path`` and listening already,
        handed over by the process that starts this one (`ftlaunch.launcher.standby`)."""
        self.path = path
        self._parent_pid = parent_pid
        self._pairs: dict[int, _Pair] = {}  # real worker pid -> pair
        self._conns: dict[socket.socket, int] = {}
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._saved = {sig: signal.getsignal(sig) for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)}
        if listener is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            listener.bind(path)
            # Listening before the warm-up: a worker that starts meanwhile connects and waits in the
            # backlog for the fork (`zygote_proxy.hand_over`) instead of importing torch itself.
            listener.listen(64)
        self._listener = listener
        self._sel = selectors.DefaultSelector()

    def wait_for_a_worker(self) -> None:
        """Block until a worker connects (it then waits in the backlog while this process warms
        up), or end this process once its parent is gone."""
        while True:
            readable, _, _ = select.select([self._listener], [], [], 1.0)
            if readable:
                return
            if self._parent_pid is not None and os.getppid() != self._parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent is gone (PDEATHSIG should have said so)

    def serve(self) -> Job | None:
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector (set_wakeup_fd)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.set_wakeup_fd(self._wake_w)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        phases.mark("zygote_ready")
        try:
            while not self._stopping:
                for key, _ in self._sel.select(_POLL_S if self._pairs else 1.0):
                    if key.fileobj is self._listener:
                        job = self._accept()
                        if job is not None:
                            return job
                    elif key.fileobj == self._wake_r:
                        self._drain_wakeups()
                    else:
                        assert isinstance(key.fileobj, socket.socket)
                        self._proxy_readable(key.fileobj)
                self._reap()
                self._mirror_stops()
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    break  # the agent is gone (PDEATHSIG should have said so already)
        finally:
            if not self._in_child():
                self._shutdown()
        return None

    # ----------------------------------------------------------------- accepting and forking
    def _accept(self) -> Job | None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return None
        conn.settimeout(zygote_proxy.HANDSHAKE_TIMEOUT_S)
        fds: list[int] = []
        try:
            request, fds = read_message(conn, bytearray(), max_fds=3)
            if request is None:
                conn.close()
                return None
            pid_bytes = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            proxy_pid, uid = (
                int.from_bytes(pid_bytes[0:4], sys.byteorder),
                int.from_bytes(pid_bytes[4:8], sys.byteorder),
            )
            request["proxy_pid"] = proxy_pid
            refused = self._refusal(request, fds, uid)
            if refused:
                send_message(conn, {"refused": refused})
                raise _Refused()
            return self._fork(conn, request, fds, proxy_pid)
        except (_Refused, OSError, ValueError) as e:
            if not isinstance(e, _Refused):
                print(
                    f"ftlaunch.bootstrap.zygote: bad request: {type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
            for fd in fds:
                os.close(fd)
            conn.close()
            return None

    def _refusal(self, request: dict[str, Any], fds: list[int], uid: int) -> str:
        if uid != os.getuid():
            return "the worker runs as another user"
        if len(fds) != 3:
            return f"expected the worker's 3 standard descriptors, got {len(fds)}"
        if request.get("interpreter") != zygote_proxy.interpreter_identity():
            return "the worker's interpreter or its flags differ from the standby's"
        return ""  # threads: checked right after the fork (OpenBLAS parks its pool at the fork)

    def _fork(
        self, conn: socket.socket, request: dict[str, Any], fds: list[int], proxy_pid: int
    ) -> Job | None:
        go_r, go_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            return self._become_child(go_r, conn, request, fds, me)
        os.close(go_r)
        threads = _live_threads()
        if threads != 1:  # a thread was alive at the fork: the child must not run
            os.close(go_w)
            os.waitpid(pid, 0)
            send_message(conn, {"refused": f"the standby ran {threads} threads at the fork"})
            raise _Refused()
        os.write(go_w, _GO)
        os.close(go_w)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        pair = _Pair(pid, proxy_pid, conn)
        self._pairs[pid] = pair
        self._conns[conn] = pid
        self._sel.register(conn, selectors.EVENT_READ)
        try:
            send_message(conn, {"pid": pid})
        except OSError:  # the proxy is gone already
            self._proxy_gone(conn)
        return None

    def _become_child(
        self, go_r: int, conn: socket.socket, request: dict[str, Any], fds: list[int], zygote_pid: int
    ) -> Job:
        """In the forked child: drop everything of the server, wait for the go, own session."""
        self._child = True
        try:
            signal.set_wakeup_fd(-1)  # before its pipe closes: a signal must not write to a reused fd
            go = os.read(go_r, 1)
            os.close(go_r)
            if go != _GO:
                os._exit(1)
            os.setsid()  # its own process group: the zygote kills its whole tree in one call
            die_with_parent(signal.SIGKILL, expected_parent=zygote_pid)
            self._sel.close()
            self._listener.close()
            conn.close()
            for other in self._conns:
                other.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            for sig, handler in self._saved.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        except BaseException:  # noqa: BLE001 - never unwind into the server loop in the child
            traceback.print_exc()
            os._exit(1)
        return Job(request, fds)

    def _in_child(self) -> bool:
        return getattr(self, "_child", False)

    # ------------------------------------------------------------------ both ends of every pair
    def _proxy_readable(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:  # the proxy died (nothing else closes it): its worker goes at once
            self._proxy_gone(conn)

    def _proxy_gone(self, conn: socket.socket) -> None:
        pid = self._conns.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if pid is not None and pid in self._pairs:
            _kill_group(pid)

    def _reap(self) -> None:
        while self._pairs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:
                return
            if pid == 0:
                return
            pair = self._pairs.get(pid)
            if pair is None:
                continue
            if os.WIFSTOPPED(status):
                if pair.stopped_by is None:  # stopped directly: the agent watches the proxy
                    pair.stopped_by = "worker"
                    _signal(pair.proxy_pid, signal.SIGSTOP)
            elif os.WIFCONTINUED(status):
                if pair.stopped_by == "worker":
                    pair.stopped_by = None
                    _signal(pair.proxy_pid, signal.SIGCONT)
            else:
                del self._pairs[pid]
                _kill_group(pid)  # its Baby child and anything else it left in its group
                message = (
                    {"signal": os.WTERMSIG(status)}
                    if os.WIFSIGNALED(status)
                    else {"exit": os.waitstatus_to_exitcode(status)}
                )
                if pair.conn in self._conns:
                    try:
                        send_message(pair.conn, message)
                    except OSError:
                        pass
                    self._conns.pop(pair.conn, None)
                    try:
                        self._sel.unregister(pair.conn)
                    except (KeyError, ValueError):
                        pass
                    pair.conn.close()

    def _mirror_stops(self) -> None:
        for pair in list(self._pairs.values()):
            if pair.stopped_by == "worker":
                continue  # the worker's own continue ends it (`_reap`)
            state = _proc_state(pair.proxy_pid)
            if state in ("T", "t") and pair.stopped_by is None:
                pair.stopped_by = "proxy"
                _signal(pair.pid, signal.SIGSTOP)
            elif state and state not in ("T", "t", "Z") and pair.stopped_by == "proxy":
                pair.stopped_by = None
                _signal(pair.pid, signal.SIGCONT)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    # ------------------------------------------------------------------------------ the end
    def _stop(self, _signum: int, _frame: object) -> None:
        self._stopping = True

    def _shutdown(self) -> None:
        """Stop serving; the workers forked here die (their proxies, if any, end as killed)."""
        self._sel.close()
        self._listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        for pid in list(self._pairs):
            _kill_group(pid)
        deadline = time.monotonic() + 5.0
        while self._pairs and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)
        for conn in list(self._conns):
            conn.close()


class _Refused(Exception):
    """A request the zygote answered with a refusal (the proxy starts cold)."""


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(pid: int) -> None:
    """SIGKILL the process group of a worker forked here (it is its leader; `setsid`)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _signal(pid, signal.SIGKILL)


def _lower_priority() -> int | None:
    """Lower this process's CPU priority by `WARM_UP_NICE` for the warm-up, where it may raise it
    back afterwards (root, or an ``RLIMIT_NICE`` that allows it): the warm-up is seconds of CPU (an
    agent respawned mid-training starts it beside the groups that train) and nothing waits for it
    but its group's own start, while a worker forked from here must train at the priority it would
    have had. Returns the priority to restore, or None where it was left alone."""
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
        if not (os.geteuid() == 0 or soft == resource.RLIM_INFINITY or 20 - soft <= base):
            return None
        os.setpriority(os.PRIO_PROCESS, 0, min(19, base + WARM_UP_NICE))
    except (OSError, AttributeError, ValueError):
        return None
    return base


def _forget_socket(path: str, with_dir: bool, exit_now: bool = False) -> None:
    """Remove the socket file (and its directory, where this process's starter made it for it);
    with ``exit_now``, then end this process (a SIGTERM before serving: no worker to stop yet)."""
    for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path) if with_dir else "")):
        if target:
            try:
                remove(target)
            except OSError:
                pass
    if exit_now:
        os._exit(0)


def main(argv: list[str] | None = None) -> NoReturn:
    ap = argparse.ArgumentParser(description="ftlaunch's warm standby interpreter (started by the agent)")
    ap.add_argument("socket")
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--fd", type=int, default=None, help="a listening socket bound to SOCKET, inherited")
    ap.add_argument(
        "--on-demand", action="store_true", help="warm up when the first worker connects, not at start"
    )
    args = ap.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(signal.SIGTERM, expected_parent=args.parent_pid)
    try:
        listener = None if args.fd is None else socket.socket(fileno=args.fd)
        server = Zygote(args.socket, args.parent_pid, listener)
    except OSError as e:
        print(
            f"ftlaunch.bootstrap.zygote: cannot listen on {args.socket} ({e}); workers start cold",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    # The socket goes with this process, however it ends (its agent's death: PDEATHSIG's SIGTERM),
    # and with it the directory made for it by the starter that handed it over (``--fd``). Set
    # only now: the forked workers restore the handlers saved when the server was built.
    own_dir = args.fd is not None
    signal.signal(signal.SIGTERM, lambda *_: _forget_socket(args.socket, own_dir, exit_now=True))
    if args.on_demand:
        # Its starter cannot tell whether its workers will ask (`ftlaunch.launcher.standby`): until
        # one does, this is a bare interpreter. The one that asked waits for the warm-up, so it runs
        # at the priority that worker would have imported torch at.
        server.wait_for_a_worker()
    t0 = time.monotonic()
    restore = None if args.on_demand else _lower_priority()
    try:
        warm_up()
    except Exception as e:  # noqa: BLE001 - no standby then: workers start cold (their connections are reset)
        print(
            f"ftlaunch.bootstrap.zygote: cannot warm up ({type(e).__name__}: {e}); workers start cold",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    if restore is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, restore)  # the workers forked from here train at full priority
        except OSError as e:  # checked by _lower_priority; never fork workers at the lowered priority
            print(
                f"ftlaunch.bootstrap.zygote: cannot restore its priority ({e}); workers start cold",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
    # What is imported now lives as long as any worker: keep the cyclic GC off it (gc.freeze, made for
    # fork servers), so a worker's collections neither walk torch's objects nor copy their pages.
    gc.freeze()
    phases.mark("zygote_warm", seconds=round(time.monotonic() - t0, 3), niced=restore is not None)
    job = server.serve()
    if job is None:
        # Stopped (its agent ended or died: PDEATHSIG): end without the interpreter's teardown, which
        # takes 0.8-0.9 s with torch imported on a loaded 2-core machine -- while this process still
        # holds the agent's stdout/stderr, which its supervisor waits on. Nothing is left to clean up.
        _forget_socket(args.socket, own_dir)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)
    # The forked child: run the script as `python SCRIPT` would -- an uncaught exception prints its
    # traceback and exits 1, SystemExit its code, atexit handlers run, buffers are flushed.
    job.run()
    sys.exit(0)


if __name__ == "__main__":
    main()

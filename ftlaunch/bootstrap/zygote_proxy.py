"""A worker's side of the warm standby interpreter (`ftlaunch.bootstrap.zygote`): hand the script over to it,
then stand in for the real worker.

Why: a restarted worker spends most of its start-up importing torch (and its first optimizer,
``torch._dynamo``). The launcher's agent keeps one interpreter per group that has done that already
(`ftlaunch.bootstrap.zygote`); `hand_over` asks it to fork a copy that runs this worker's script. torchelastic
still started *this* process and watches it, so it stays, as a thin proxy: it forwards the catchable
signals (TERM, INT, HUP, QUIT, USR1, USR2) to the real worker and exits as the real worker did (the
same exit code, or dying by the same signal). If the proxy is SIGKILLed, the zygote sees its socket
close and kills the real worker's process group at once; if it is SIGSTOPped, the zygote stops the
real worker too (and continues it with the proxy). So whoever signals or watches "the worker" --
chaos, the agent's watcher, ``--kill-stopped``, a test -- may keep using the proxy's pid.

Everything here imports no torch: the point is to not pay for it. Anything unexpected returns a
reason, and ``ftlaunch.bootstrap.prestart`` starts the script itself (today's cold start).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any, NoReturn

from ftlaunch import env, phases

__all__ = [
    "FORWARDED",
    "announced",
    "enabled",
    "hand_over",
    "interpreter_identity",
    "read_message",
    "send_message",
]

#: Signals the proxy forwards to the real worker (what torchelastic and users send a worker).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: Seconds to connect and to send the request (the fork takes milliseconds; it serves one at a time).
HANDSHAKE_TIMEOUT_S = 5.0
#: Seconds to wait for the zygote's answer: it listens while it warms up (seconds of imports, longer
#: on a loaded machine), and a worker waiting for it costs less than one importing torch beside it.
#: A zygote that dies meanwhile resets the connection at once (the worker then starts cold).
ANSWER_TIMEOUT_S = 60.0
#: The longest message on the wire (environments are a few KiB).
MAX_MESSAGE = 1 << 20


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether the zygote may be used (``FTLAUNCH_ZYGOTE``, a flag, default on)."""
    return env.zygote_wanted(environ)


def announced() -> str | None:
    """The zygote's socket path the agent gave its workers (None: no zygote)."""
    return env.zygote_socket()


def interpreter_identity() -> dict[str, Any]:
    """What must match between the proxy's interpreter and the zygote's for the fork to run the
    script as ``python -u SCRIPT`` would have (same Python, same flags)."""
    return {
        "executable": sys.executable,
        "version": list(sys.version_info),
        "flags": [
            getattr(sys.flags, name)
            for name in (
                "optimize",
                "dont_write_bytecode",
                "no_user_site",
                "no_site",
                "ignore_environment",
                "isolated",
                "bytes_warning",
                "dev_mode",
                "safe_path",
            )
            if hasattr(sys.flags, name)
        ],
        "warnoptions": list(sys.warnoptions),
        "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()},
    }


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One JSON line (with ``fds`` attached, SCM_RIGHTS)."""
    data = (json.dumps(message) + "\n").encode()
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:
        sock.sendall(data)


def read_message(
    sock: socket.socket, buffer: bytearray, max_fds: int = 0
) -> tuple[dict[str, Any] | None, list[int]]:
    """The next JSON line from ``sock`` (None at EOF) and any descriptors that came with it.
    ``buffer`` keeps what was read past the line."""
    fds: list[int] = []
    while b"\n" not in buffer:
        if max_fds and not fds:
            data, got, _, _ = socket.recv_fds(sock, 65536, max_fds)
            fds.extend(got)
        else:
            data = sock.recv(65536)
        if not data:
            for fd in fds:
                os.close(fd)
            return None, []
        buffer.extend(data)
        if len(buffer) > MAX_MESSAGE:
            for fd in fds:
                os.close(fd)
            raise ValueError("zygote message too long")
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line), fds


def hand_over(argv: list[str]) -> str | None:
    """Have the announced zygote run ``argv`` (prestart's arguments) and proxy for it: never returns
    then. Returns why it was not used (the caller starts cold and says so), or None where that is
    nothing to report: no zygote announced, or a group's first start that found it not listening yet.
    A zygote still warming up is waited for (`ANSWER_TIMEOUT_S`)."""
    path = announced()
    if path is None:
        return None
    if not enabled():
        return f"the standby interpreter is off ({env.FTLAUNCH_ZYGOTE})"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    buffer = bytearray()
    try:
        sock.connect(path)
        request = {
            "argv": argv,
            "cwd": os.getcwd(),
            "env": env.inherited(),  # the worker becomes this process: its whole environment
            "path": list(sys.path),
            "interpreter": interpreter_identity(),
        }
        send_message(sock, request, [0, 1, 2])
        sock.settimeout(ANSWER_TIMEOUT_S)
        answer, _ = read_message(sock, buffer)
    except (OSError, ValueError) as e:
        sock.close()
        phases.mark("zygote_not_used", reason=f"{type(e).__name__}: {e}")
        first_start = env.ProcessMarks.from_environ().restart_count == 0
        if first_start and isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
            return None  # the usual first start: the standby warms up while the first workers start
        return f"standby interpreter not ready ({type(e).__name__}: {e})"
    if answer is None or "pid" not in answer:
        sock.close()
        refused = (answer or {}).get("refused", "it closed the connection")
        return f"standby interpreter refused: {refused}"
    _proxy(sock, buffer, int(answer["pid"]))


def _proxy(sock: socket.socket, buffer: bytearray, pid: int) -> NoReturn:
    """Forward signals to the real worker ``pid`` until the zygote reports its end; end the same way."""
    done = False

    def forward(signum: int, _frame: object) -> None:
        if not done:  # once the status came, the pid may have been reaped (and reused)
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    phases.mark("zygote_handover", worker=pid)
    sock.settimeout(None)
    try:
        while True:
            message, _ = read_message(sock, buffer)
            if message is None or "exit" in message or "signal" in message:
                break
    except (OSError, ValueError):
        message = None
    done = True
    sock.close()
    if message is None:  # the zygote died (and its PDEATHSIG took the worker): end as killed
        _die_by(signal.SIGKILL)
    if "signal" in message:
        _die_by(int(message["signal"]))
    os._exit(int(message["exit"]))


def _die_by(signum: int) -> NoReturn:
    """End this process by ``signum``, as the real worker did (its parent sees the same status)."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL/SIGSTOP cannot be caught or reset
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not end a process (it was ignored): as a shell reports it

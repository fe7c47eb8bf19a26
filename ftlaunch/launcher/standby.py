"""A group node's warm standby interpreter (`ftlaunch.bootstrap.zygote`), as the process that
starts the node's workers keeps it: started, announced to the workers, stopped.

Two owners, one class: the ``ftlaunch`` launcher's agent (`ftlaunch.launcher.agent`), which knows
its workers run through ``ftlaunch.bootstrap.prestart`` and starts the standby warming up at once;
and the ``ftlaunch`` rendezvous handler (`ftlaunch.launcher.rendezvous`) inside a ``torchrun`` agent
(plain torchrun or a torchx group role), which cannot see the workers' command line and so starts
it *on demand*: a bare interpreter that imports torch only once the first worker asks for it
(``torchrun ... -m ftlaunch.run train.py``). A job whose workers never ask pays one idle Python
process (about 18 MB RSS), no torch import.

This process binds and listens on the standby's Unix socket itself and hands the listening socket
to the standby: a worker started a moment later always finds it listening, and waits in its
backlog for the fork instead of starting cold. This process then closes its copy, so a standby
that dies resets its waiting workers at once (they start cold) instead of leaving them waiting
on a socket nobody accepts on.

The standby is its own session (a Ctrl-C in torchrun's terminal reaches torchrun, which stops its
workers gracefully; the standby then follows, instead of killing the forked workers first). It
ends with `stop`, at this process's exit (``atexit``), or with the thread that started it
(``PR_SET_PDEATHSIG``: a SIGKILLed agent): its forked workers go with it, and their proxies end as
killed.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile

from ftlaunch import env
from ftlaunch.launcher import procs

logger = logging.getLogger("ftlaunch.launcher.standby")

#: Connections the standby's socket queues while it warms up or forks (a node's workers, with room).
BACKLOG = 64
#: Seconds `stop` waits for the standby to end after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 10.0


def wanted() -> bool:
    """Whether a standby may be used (``FTLAUNCH_ZYGOTE`` and ``FTLAUNCH_PRESTART_FORK``, both
    default on: without the early import there is nothing for it to give a worker)."""
    return env.zygote_wanted() and env.prestart_fork()


class Standby:
    """One running standby interpreter and its socket's directory."""

    def __init__(self, proc: subprocess.Popen[bytes], directory: str, path: str) -> None:
        self.proc = proc
        self.directory = directory
        #: The socket the workers are told of (``FTLAUNCH_ZYGOTE_SOCKET``).
        self.path = path
        self._stopped = False

    @classmethod
    def start(cls, *, on_demand: bool = False) -> Standby | None:
        """Start the standby and announce it in this process's environment, which the workers
        started afterwards inherit. ``on_demand``: it imports torch only when the first worker
        connects (see the module docstring). None when it is off or cannot be started (the workers
        then start cold)."""
        if not wanted():
            return None
        # A Unix socket's path has at most 107 bytes: a long TMPDIR falls back to /tmp.
        directory = tempfile.mkdtemp(
            prefix="ftlaunch-zygote-", dir="/tmp" if len(tempfile.gettempdir()) > 60 else None
        )
        path = os.path.join(directory, "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(BACKLOG)
            fd = listener.fileno()
            command = [sys.executable, "-u", "-m", procs.STANDBY_MODULE, path, "--fd", str(fd),
                       "--parent-pid", str(os.getpid()), *(["--on-demand"] if on_demand else [])]  # fmt: skip
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(fd,), start_new_session=True)
        except OSError as e:
            logger.warning("no standby interpreter (%s): workers start cold", e)
            shutil.rmtree(directory, ignore_errors=True)
            return None
        finally:
            listener.close()  # the standby's copy is the only one now
        env.publish({env.FTLAUNCH_ZYGOTE_SOCKET: path})
        standby = cls(proc, directory, path)
        atexit.register(standby.stop)
        return standby

    def stop(self) -> None:
        """Stop announcing it and end it (its forked workers with it); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if env.zygote_socket() == self.path:
            env.unpublish(env.FTLAUNCH_ZYGOTE_SOCKET)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
        atexit.unregister(self.stop)

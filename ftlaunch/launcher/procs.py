"""Process-tree teardown: finding a replica group's processes and killing whole trees.

torchelastic starts every worker in a new session, so killing an agent does not kill its workers:
they are re-parented and keep running. The supervisor therefore makes itself a *child subreaper*
(Linux; the prctl calls live in `ftlaunch.lifetime`): orphans of its agents are re-parented to it
instead of to init, stay visible in its process tree, and are found by the replica group their
environment names (``REPLICA_GROUP_ID``) and killed by walking that tree.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable

import psutil

from ftlaunch import env

#: The warm standby's module (`ftlaunch.bootstrap.zygote`), as its command line names it: the
#: processes forked from it keep that command line.
STANDBY_MODULE = "ftlaunch.bootstrap.zygote"

logger = logging.getLogger(__name__)


def descendants(pid: int) -> list[psutil.Process]:
    """All live descendants of ``pid`` (empty when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def signal_procs(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def kill_procs(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    """SIGKILL (and SIGCONT, so stopped ones die too) then wait; returns the ones still alive."""
    signal_procs(procs, signal.SIGKILL)
    signal_procs(procs, signal.SIGCONT)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def terminate_tree(
    roots: list[psutil.Process],
    grace: float,
    extra: list[psutil.Process] | None = None,
    sig: int = signal.SIGTERM,
) -> list[psutil.Process]:
    """Send ``sig`` (SIGTERM) to the roots, wait up to ``grace`` for them to exit, then SIGKILL every
    survivor in their trees.

    ``extra`` are processes known to belong to the trees even if already re-parented (e.g. workers).
    Returns processes that could not be killed (should be empty).
    """
    members: dict[int, psutil.Process] = {}
    for root in roots:
        members[root.pid] = root
        for child in descendants(root.pid):
            members[child.pid] = child
    for p in extra or []:
        members[p.pid] = p
    signal_procs(roots, sig)
    signal_procs(roots, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in roots):
            break
        time.sleep(0.05)
    # New processes may have appeared (a restart in flight): collect them too.
    for root in roots:
        for child in descendants(root.pid):
            members[child.pid] = child
    survivors = [p for p in members.values() if _alive(p)]
    return kill_procs(survivors) if survivors else []


def end_descendants(grace: float) -> None:
    """This process lost its parent (an agent whose supervisor died): its whole tree goes, stopped
    processes included, within ``grace`` seconds.

    ``PR_SET_PDEATHSIG`` only starts torchelastic's graceful shutdown (SIGTERM to the workers, then
    SIGKILL 30 s later); a SIGSTOPped worker keeps that SIGTERM pending and would outlive the
    supervisor by that long. So: SIGCONT everything (pending signals are delivered), give the
    graceful path ``grace`` seconds, then SIGKILL what is left.
    """
    tree = descendants(os.getpid())
    signal_procs(tree, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.05)
    left = [p for p in {p.pid: p for p in tree + descendants(os.getpid())}.values() if _alive(p)]
    if left:
        logger.warning("supervisor gone: killing %d process(es) left after %.1fs", len(left), grace)
        kill_procs(left, timeout=grace)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_zombies(exclude: set[int]) -> list[int]:
    """Reap our zombie children except ``exclude`` (children owned by ``subprocess.Popen``).

    Called every supervisor tick: it first asks the kernel, without reaping, whether any child
    has exited at all (one ``waitid`` call), and lists the children only then. Listing them
    (psutil reads every process's ``/proc/PID/stat`` to find whose parent we are) cost the
    launcher about a millisecond a tick on a machine running a few hundred processes -- most of
    its CPU while a job trains."""
    if not _any_child_exited():
        return []
    reaped = []
    for child in psutil.Process().children():
        if child.pid in exclude:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                continue
            pid, _ = os.waitpid(child.pid, os.WNOHANG)
            if pid:
                reaped.append(pid)
        except (psutil.Error, ChildProcessError):
            continue
    return reaped


def child_pids() -> list[int]:
    """This process's children (of all its threads), from the kernel's per-thread lists
    (``/proc/self/task/TID/children``: two small reads) rather than psutil's scan of every
    process on the machine (~2 ms of CPU per call with a few hundred processes). Falls back to
    the scan where the kernel has no such file. For polling: the kernel may miss a child being
    created or re-parented at that instant, and the next look finds it."""
    try:
        pids: list[int] = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children") as f:
                    pids.extend(int(x) for x in f.read().split())
            except FileNotFoundError:
                if not os.path.isdir(f"/proc/self/task/{tid}"):
                    continue  # the thread ended meanwhile
                raise
        return pids
    except OSError:
        return [c.pid for c in psutil.Process().children()]


def _any_child_exited() -> bool:
    """Whether a child of this process (of any of its threads) is a zombie, leaving it unreaped."""
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # no children at all
        return False


def marks_of(p: psutil.Process) -> env.ProcessMarks:
    """What ``p``'s environment says about it (which replica group, rank; nothing if unreadable)."""
    try:
        return env.ProcessMarks.from_environ(p.environ())
    except psutil.Error:
        return env.ProcessMarks.from_environ({})


def group_processes(gid: int, worker_pids: Iterable[int], agents: set[int]) -> list[psutil.Process]:
    """Live processes of replica group ``gid`` other than the ``agents``: its known workers, every
    process of ours whose environment names the group (workers re-parented to us when their agent
    died), and all their descendants (e.g. Baby process-group children)."""
    found: dict[int, psutil.Process] = {}
    for pid in worker_pids:
        try:
            found[pid] = psutil.Process(pid)
        except psutil.Error:
            continue
    for child in psutil.Process().children(recursive=True):
        if child.pid in agents or child.pid in found:
            continue
        if marks_of(child).replica_group_id == gid:
            found[child.pid] = child
    for p in list(found.values()):
        for d in descendants(p.pid):
            found.setdefault(d.pid, d)
    return list(found.values())


def _stdio(pid: int) -> tuple[str, str] | None:
    """What ``pid``'s stdout and stderr are (the kernel's names: a file's path, ``pipe:[inode]``);
    None when unreadable."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1"), os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return None


def _is_standby(p: psutil.Process) -> bool:
    """Whether ``p`` runs the warm standby's code (the standby itself, or a process forked from it)."""
    try:
        return STANDBY_MODULE in p.cmdline()
    except psutil.Error:
        return False


def worker_processes(worker_pids: Iterable[int], agent_pid: int | None) -> list[psutil.Process]:
    """The processes that run the workers' code: each of ``worker_pids`` (the pids torchelastic
    knows), or, for a worker forked from the agent's warm standby (`ftlaunch.bootstrap.zygote`), the
    fork that stands behind that pid (its proxy). Why: a signal the proxy cannot forward (SIGSTOP)
    reaches the fork only once the standby notices, within 50 ms, and the proxy itself only waits.

    How the fork is found: the proxy hands its standard streams to the standby, so the fork writes
    to the very files (or pipes) the proxy holds -- the agent's per-rank logs. The fork is the
    child of a standby, among ``agent_pid``'s descendants, with the proxy's stdout and stderr (its
    own children, the Baby process-group child, are forks of the fork: grandchildren). Its environment
    cannot tell: ``/proc/PID/environ`` is what a process was exec'd with, and a fork is never
    exec'd. Where no fork or several match (ranks sharing one stdout), the pid itself is slowed."""
    pids = list(worker_pids)
    family = descendants(agent_pid) if agent_pid is not None else []
    parents = {}
    for p in family:
        if _is_standby(p):
            try:
                parents[p.pid] = p.ppid()
            except psutil.Error:
                continue
    roots = {pid for pid, parent in parents.items() if parent not in parents}  # the standbys themselves
    forks: dict[tuple[str, str], list[psutil.Process]] = {}
    for p in family:
        if parents.get(p.pid) in roots and (streams := _stdio(p.pid)) is not None:
            forks.setdefault(streams, []).append(p)
    found = []
    for pid in pids:
        mine = _stdio(pid)
        behind = forks.get(mine, []) if mine is not None else []
        if len(behind) == 1 and behind[0].pid != pid:
            found.append(behind[0])
            continue
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


def stop_job(
    agents: list[subprocess.Popen], extra: list[psutil.Process], grace: float, sig: int = signal.SIGTERM
) -> None:
    """Stop a whole job: ``sig`` (SIGTERM) to the ``agents``, ``grace`` seconds, then SIGKILL whatever is
    left of their trees, of ``extra`` and of any process of ours that belongs to a replica group."""
    roots = []
    for agent in agents:
        if agent.poll() is None:
            try:
                roots.append(psutil.Process(agent.pid))
            except psutil.Error:
                continue
    if roots or extra:
        left = terminate_tree(roots, grace, extra, sig)
        if left:
            logger.error("could not stop processes: %s", [p.pid for p in left])
    for agent in agents:
        try:
            agent.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
    # Anything re-parented to us that is still around (workers of a killed agent) goes too.
    leftovers = [
        p for p in psutil.Process().children(recursive=True) if marks_of(p).replica_group_id is not None
    ]
    if leftovers:
        kill_procs(leftovers)
    reap_zombies(set())

#!/usr/bin/env python3
"""A real Slurm cluster of N nodes on this machine, for tests and benchmarks; torn down leaving nothing.

    python scripts/slurm_cluster.py up --nodes 5        # start it; prints how to use it
    python scripts/slurm_cluster.py run 2 -- hostname   # a command on node 2 (its address, its name)
    python scripts/slurm_cluster.py kill-node 2         # SIGKILL every process of node 2 (slurmd too)
    python scripts/slurm_cluster.py down                # stop everything and remove every trace

Each node is a network namespace with its own address on a private bridge (``10.231.0.0/24`` by
default), its
own host name (a UTS namespace) and an ``/etc/hosts`` that names every node and an
``/etc/resolv.conf`` without a reachable name server (a mount namespace, so the machine's own files
are untouched), running Debian's ``slurmd -N nodeK``; ``slurmctld`` and
``munged`` run on this machine, on the bridge's address, and ``sbatch``/``squeue``/``torchx run -s
slurm`` from here submit to it (`Cluster.env` gives the ``SLURM_CONF`` to use). The file system is
this machine's, so the submission directory is shared by every node, as on a real cluster.

What it takes (learnt the hard way):

* a node is entered with ``nsenter --net=/run/netns/X`` then ``unshare --uts --mount``, not with
  ``ip netns exec``, which remounts ``/sys``: slurmd 22.05 then no longer finds ``/sys/fs/cgroup``;
* ``proctrack/linuxproc`` and ``task/none`` (no cgroups per node), no accounting;
* heterogeneous jobs (what torchx submits) are started by the backfill scheduler only:
  ``SchedulerParameters=bf_interval=1`` starts them within a second;
* ``SlurmdParameters=config_overrides`` lets every node declare more CPUs and memory than this
  machine has, so that the jobs' requests fit;
* Slurm puts each component of a heterogeneous job on a node of its own: torchx's
  ``ftlaunch:ddp --replicas 2`` needs 3 nodes, ``ftlaunch:hsdp --replicas 2 --nnodes_per_replica 2`` 5.

Slurm and munge are installed with ``apt-get`` when missing. Needs root (namespaces, veths, daemons).
``down`` (and leaving ``with Cluster(...)``) removes every namespace, link, daemon and job process
of the cluster, also after a crash of the process that started it: everything is named with the
cluster's prefix and found again from it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DIR = "/tmp/ftlaunch-slurm"
DEFAULT_PREFIX = "ftsl"
#: The bridge's network (a /24): the controller is .1, node k is .(NODE_BASE + k).
DEFAULT_SUBNET = "10.231.0"
CONTROLLER_NAME = "ftctl"
NODE_BASE = 10
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
#: How long a node may be silent before Slurm declares it down (Slurm's default is 300 s).
SLURMD_TIMEOUT_S = 10
#: How long a requeued job waits before it may start again: the job credential's lifetime
#: (``AuthInfo=cred_expire``; Slurm's default is 120 s).
CRED_EXPIRE_S = 10


class ClusterError(RuntimeError):
    """The cluster could not be started (the message says what is missing or failed)."""


def node_name(k: int) -> str:
    return f"node{k}"


def missing_capability() -> str | None:
    """Why a cluster cannot be built here (None: it can): root and network namespaces are needed."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links, Slurm daemons)"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    probe = f"{DEFAULT_PREFIX}-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ensure_installed() -> None:
    """Debian's ``slurm-wlm`` and ``munge``, installed with apt-get when a daemon is missing."""
    needed = ("slurmctld", "slurmd", "sbatch", "munged")
    if all(shutil.which(t) or os.path.exists(f"/usr/sbin/{t}") for t in needed):
        return
    if shutil.which("apt-get") is None:
        raise ClusterError("Slurm and munge are not installed and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")


def _sbin(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


@dataclass
class Cluster:
    """N Slurm nodes, each its own network namespace; use as a context manager or up()/down()."""

    nodes: int = 3
    root: str = DEFAULT_DIR
    prefix: str = DEFAULT_PREFIX
    #: CPUs and memory (MB) every node declares (more than the machine has: config_overrides).
    cpus: int = 16
    memory_mb: int = 64000
    #: Extra environment for the daemons and everything submitted (e.g. PYTHONPATH).
    extra_env: dict[str, str] = field(default_factory=dict)
    #: The first three octets of the cluster's /24 (two clusters at once need two).
    subnet: str = DEFAULT_SUBNET
    #: slurmctld's port on this machine (two clusters at once need two).
    ctld_port: int = SLURMCTLD_PORT
    #: The daemons this object started (reaped by `down`).
    _started: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def ip(self, k: int) -> str:
        """Node ``k``'s address."""
        return f"{self.subnet}.{NODE_BASE + k}"

    @property
    def controller_ip(self) -> str:
        return f"{self.subnet}.1"

    # -- names --------------------------------------------------------------------------------
    @property
    def conf(self) -> str:
        return os.path.join(self.root, "slurm.conf")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br0"

    def netns(self, k: int) -> str:
        return f"{self.prefix}-{node_name(k)}"

    def _veth_host(self, k: int) -> str:
        return f"{self.prefix}{k}h"

    def _veth_node(self, k: int) -> str:
        return f"{self.prefix}{k}n"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's commands (and torchx) run on this machine."""
        return {**os.environ, **self.extra_env, "SLURM_CONF": self.conf}

    # -- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout: float = 60.0) -> None:
        why = missing_capability()
        if why:
            raise ClusterError(why)
        ensure_installed()
        self.down(remove_dir=True)  # a previous cluster of this prefix, crashed or not torn down
        for sub in ("log", "state", "spool", "munge", "run"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        self._network()
        self._hosts_file()
        self._munge()
        self._slurm_conf()
        # The controller runs on this machine's network under a host name of its own (Slurm
        # checks that it runs on SlurmctldHost).
        self._start(
            ["unshare", "--uts", "sh", "-c", f'hostname {CONTROLLER_NAME} && exec "$@"', "sh",
             _sbin("slurmctld"), "-D", "-f", self.conf, "-i"],
            os.path.join(self.root, "log", "slurmctld.out"),
        )  # fmt: skip
        for k in range(1, self.nodes + 1):
            self._start(
                self.node_argv(k, [_sbin("slurmd"), "-D", "-N", node_name(k), "-f", self.conf]),
                os.path.join(self.root, "log", f"slurmd-{node_name(k)}.out"),
            )
        self.wait_idle(timeout)

    def down(self, remove_dir: bool = False) -> None:
        """Stop every process of the cluster and remove its namespaces and links (idempotent)."""
        namespaces = self._our_netns()
        for _ in range(50):
            pids = [p for ns in namespaces for p in self.pids_in_netns(ns)] + self._daemon_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for proc in self._started:  # ours are reaped here, not left as zombies until we exit
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._started.clear()
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self._our_links():
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if remove_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of the cluster is still there (empty after `down`)."""
        out = [f"netns {ns}" for ns in self._our_netns()]
        out += [f"link {link}" for link in self._our_links()]
        out += [f"pid {pid}" for pid in self._daemon_pids()]
        return out

    # -- pieces of up() -------------------------------------------------------------------------
    def _run(self, *cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def _network(self) -> None:
        self._run("ip", "link", "add", self.bridge, "type", "bridge")
        self._run("ip", "addr", "add", f"{self.controller_ip}/24", "dev", self.bridge)
        self._run("ip", "link", "set", self.bridge, "up")
        for k in range(1, self.nodes + 1):
            ns, host, peer = self.netns(k), self._veth_host(k), self._veth_node(k)
            self._run("ip", "netns", "add", ns)
            self._run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            self._run("ip", "link", "set", peer, "netns", ns)
            self._run("ip", "link", "set", host, "master", self.bridge)
            self._run("ip", "link", "set", host, "up")
            self._run("ip", "-n", ns, "addr", "add", f"{self.ip(k)}/24", "dev", peer)
            self._run("ip", "-n", ns, "link", "set", peer, "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            self._run("ip", "-n", ns, "route", "add", "default", "via", self.controller_ip)

    def _hosts_file(self) -> None:
        lines = ["127.0.0.1 localhost", f"{self.controller_ip} {CONTROLLER_NAME}"]
        lines += [f"{self.ip(k)} {node_name(k)}" for k in range(1, self.nodes + 1)]
        Path(self.root, "hosts").write_text("\n".join(lines) + "\n")
        # No name server is reachable from the bridge: without this every reverse lookup (torch's
        # TCPStore does one per connection) waits for the machine's resolver to time out.
        Path(self.root, "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def _munge(self) -> None:
        d = os.path.join(self.root, "munge")
        os.chmod(d, 0o700)
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._run(
            _sbin("munged"),
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={os.path.join(d, 'munged.pid')}",
            f"--log-file={os.path.join(self.root, 'log', 'munged.log')}",
            f"--seed-file={os.path.join(d, 'munged.seed')}",
        )
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            if time.monotonic() > deadline:
                raise ClusterError("munged did not create its socket")
            time.sleep(0.05)

    @property
    def munge_socket(self) -> str:
        return os.path.join(self.root, "munge", "munge.socket.2")

    def _slurm_conf(self) -> None:
        r = self.root
        nodes = "\n".join(
            f"NodeName={node_name(k)} NodeAddr={self.ip(k)} NodeHostname={node_name(k)} "
            f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
            for k in range(1, self.nodes + 1)
        )
        text = f"""# written by scripts/slurm_cluster.py
ClusterName=ftlaunch
SlurmctldHost={CONTROLLER_NAME}({self.controller_ip})
SlurmctldPort={self.ctld_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
SlurmctldTimeout=30
MessageTimeout=10
InactiveLimit=0
MinJobAge=600
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        Path(self.conf).write_text(text)

    def _start(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, "SLURM_CONF": self.conf},
                start_new_session=True,
            )
        self._started.append(proc)
        return proc

    def wait_idle(self, timeout: float) -> None:
        """Wait until every node is idle in ``sinfo`` (raises `ClusterError` with the logs' tail)."""
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            got = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=self.env
            )
            states = got.stdout.strip() or got.stderr.strip()
            lines = [line.split() for line in got.stdout.splitlines() if line.strip()]
            if got.returncode == 0 and len(lines) == self.nodes and all(s == "idle" for _, s in lines):
                return
            time.sleep(0.3)
        raise ClusterError(f"nodes not idle after {timeout:g}s: {states!r}\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(Path(self.root, "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(out)

    # -- using it -------------------------------------------------------------------------------
    def node_argv(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on node ``k``: its network, its host name, its ``/etc/hosts``."""
        setup = (
            f"hostname {node_name(k)} && mount --bind {self.root}/hosts /etc/hosts && "
            f'mount --bind {self.root}/resolv.conf /etc/resolv.conf && exec "$@"'
        )
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns(k)}",
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            setup,
            "sh",
            *argv,
        ]

    def popen(self, k: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` on node ``k`` (``env`` defaults to the cluster's)."""
        kwargs.setdefault("env", self.env)
        return subprocess.Popen(self.node_argv(k, argv), **kwargs)  # type: ignore[call-overload]

    def run(self, k: int, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.node_argv(k, argv), **kwargs)  # type: ignore[call-overload]

    def slurm(self, *argv: str, check: bool = True) -> str:
        """A Slurm command (``squeue``, ``scontrol``, ...) against this cluster; its stdout."""
        done = subprocess.run(list(argv), capture_output=True, text=True, env=self.env)
        if check and done.returncode != 0:
            raise ClusterError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def kill_node(self, k: int, *, slurmd: bool = True, sig: int = signal.SIGKILL) -> list[int]:
        """A lost node (with ``slurmd``): its link goes down first -- its peers get no FIN or RST,
        as from a machine that lost power -- then every process of it is signalled, Slurm's daemons
        too. With ``slurmd=False`` only its jobs' processes are (an OOM kill of a job's whole tree):
        ``slurmd`` and ``slurmstepd`` stay, and so does the link. Returns the pids signalled."""
        if slurmd:
            subprocess.run(["ip", "link", "set", self._veth_host(k), "down"], capture_output=True)
        keep = set() if slurmd else set(self._daemons_of(k))
        hit = []
        for pid in self.pids_in_netns(self.netns(k)):
            if pid in keep:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                hit.append(pid)
        return hit

    def node_pids(self) -> dict[int | None, list[int]]:
        """Every node's processes (node number -> pids)."""
        return {k: self.pids_in_netns(self.netns(k)) for k in range(1, self.nodes + 1)}

    def job_pids(self) -> list[int]:
        """Every process on the nodes that is not one of Slurm's daemons: jobs' and yours."""
        return [
            pid
            for k in range(1, self.nodes + 1)
            for pid in set(self.pids_in_netns(self.netns(k))) - set(self._daemons_of(k))
        ]

    def drain(self, k: int, reason: str = "not for jobs") -> None:
        """Keep Slurm's jobs off node ``k`` (it still runs what is started on it by hand)."""
        self.slurm("scontrol", "update", f"nodename={node_name(k)}", "state=drain", f"reason={reason}")

    def restart_node(self, k: int) -> None:
        """Bring node ``k`` back after `kill_node`: its link up, its slurmd started; Slurm returns
        it to service (``ReturnToService=2``)."""
        subprocess.run(["ip", "link", "set", self._veth_host(k), "up"], capture_output=True)
        self._start(
            self.node_argv(k, [_sbin("slurmd"), "-D", "-N", node_name(k), "-f", self.conf]),
            os.path.join(self.root, "log", f"slurmd-{node_name(k)}.out"),
        )

    # -- finding what is ours ---------------------------------------------------------------------
    def _our_netns(self) -> list[str]:
        got = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        names = [line.split()[0] for line in got.stdout.splitlines() if line.strip()]
        return [n for n in names if n.startswith(f"{self.prefix}-")]

    def _our_links(self) -> list[str]:
        got = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        out = []
        for line in got.stdout.splitlines():
            parts = line.split(":", 2)
            if len(parts) > 1:
                name = parts[1].strip().split("@")[0]
                if name.startswith(self.prefix):
                    out.append(name)
        return out

    @staticmethod
    def pids_in_netns(ns: str) -> list[int]:
        """Every process in network namespace ``ns`` (named, under /run/netns)."""
        try:
            target = os.stat(f"/run/netns/{ns}").st_ino
        except OSError:
            return []
        me = os.getpid()
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
                    out.append(int(entry))
            except OSError:
                continue
        return out

    def _daemon_pids(self) -> list[int]:
        """slurmctld and munged of this cluster (found by the cluster's directory in their command)."""
        out = []
        needle = self.root.encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if needle in cmd and (b"slurmctld" in cmd or b"munged" in cmd or b"slurmd" in cmd):
                out.append(int(entry))
        return out

    def _daemons_of(self, k: int) -> list[int]:
        """Node ``k``'s Slurm daemons (slurmd, slurmstepd)."""
        out = []
        for pid in self.pids_in_netns(self.netns(k)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0")[0]
            except OSError:
                continue
            if argv0.endswith((b"slurmd", b"slurmstepd")) or argv0.startswith(b"slurmstepd"):
                out.append(pid)
        return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"the cluster's directory (default {DEFAULT_DIR})")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="prefix of its namespaces and links")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster (tearing down one left from before)")
    up.add_argument("--nodes", type=int, default=5)
    up.add_argument("--cpus", type=int, default=16, help="CPUs each node declares")
    sub.add_parser("down", help="stop it and remove every trace")
    sub.add_parser("status", help="sinfo and squeue, and what of the cluster exists")
    run = sub.add_parser("run", help="run a command on node K")
    run.add_argument("node", type=int)
    run.add_argument("argv", nargs=argparse.REMAINDER)
    kill = sub.add_parser("kill-node", help="lose node K: its link down, every process SIGKILLed")
    kill.add_argument("node", type=int)
    kill.add_argument("--keep-slurmd", action="store_true", help="only the job's processes (link stays up)")
    back = sub.add_parser("restart-node", help="bring node K back (link up, slurmd started)")
    back.add_argument("node", type=int)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    nodes = getattr(args, "nodes", 0) or len(
        [n for n in Cluster(prefix=args.prefix)._our_netns()]  # noqa: SLF001 - same module
    )
    c = Cluster(nodes=nodes, root=args.dir, prefix=args.prefix, cpus=getattr(args, "cpus", 16))
    if args.cmd == "up":
        try:
            c.up()
        except ClusterError as e:
            print(f"slurm_cluster: error: {e}", file=sys.stderr)
            c.down()
            return 1
        print(f"{nodes} nodes up: node1..node{nodes} at {c.ip(1)}..{c.ip(nodes)}")
        print(f"export SLURM_CONF={c.conf}")
        return 0
    if args.cmd == "down":
        c.down(remove_dir=True)
        left = c.leftovers()
        if left:
            print(f"slurm_cluster: still there: {', '.join(left)}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "status":
        print(c.slurm("sinfo", "-N", check=False) + c.slurm("squeue", check=False))
        print("namespaces:", ", ".join(c._our_netns()) or "none")  # noqa: SLF001
        return 0
    if args.cmd == "run":
        rest = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(c.node_argv(args.node, rest), env=c.env)
    if args.cmd == "kill-node":
        print(" ".join(map(str, c.kill_node(args.node, slurmd=not args.keep_slurmd))))
        return 0
    if args.cmd == "restart-node":
        c.restart_node(args.node)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

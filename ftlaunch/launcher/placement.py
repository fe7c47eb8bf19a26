"""Where a role of ``torchx run ftlaunch:hsdp`` runs, and what follows from it.

A torchx component is built before the scheduler is known (``torchx run -s local_cwd`` and
``-s slurm`` call the same function), so the spec itself is the same everywhere and each role
decides at start-up, from what its scheduler tells it:

* **torchx's ``${rank0_env}`` macro** names the environment variable holding the host of the
  first role's first replica -- the lighthouse role, which the component always puts first. Every
  scheduler fills it its own way: ``TORCHX_RANK0_HOST=localhost`` on ``local_cwd``, the container
  name on ``local_docker``, ``SLURM_JOB_NODELIST_HET_GROUP_0`` on Slurm, the Volcano pod's DNS name
  (``VC_LIGHTHOUSE_0_HOSTS``) on Kubernetes. The group roles connect to that host: the scheduler's
  own name for the lighthouse's node.
* **the scheduler's own markers**: ``SLURM_JOB_ID`` in every Slurm task, ``KUBERNETES_SERVICE_HOST``
  in every pod (where torchx tells the first role itself that rank 0 is ``localhost``).

From the `Placement` follow the job directory (`job_dir`: node-local ``/tmp`` when every role is on
this machine, the shared submission directory on Slurm, nothing by default where roles share no
filesystem -- then an explicit one is required) and where the lighthouse listens (`lighthouse_bind`:
loopback on one machine, all interfaces with a job token otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ftlaunch import env
from ftlaunch.errors import ConfigurationError

#: The spec's value for "decide at start-up".
AUTO = "auto"
LOCAL, SLURM, KUBERNETES, REMOTE = "local", "slurm", "kubernetes", "remote"

#: Files in the job directory.
ADDRESS_FILE = "lighthouse.addr"
TOKEN_FILE = "lighthouse.token"


def exit_file(job_dir: str, replica_id: str, node: str) -> str:
    """Where group role ``replica_id``'s node ``node`` writes its torchrun exit status."""
    return os.path.join(job_dir, f"{replica_id}.{node}.exit")


@dataclass(frozen=True)
class Placement:
    #: ``local`` (every role on this machine), ``slurm``, ``kubernetes`` or ``remote`` (another
    #: scheduler whose roles have their own hosts, e.g. ``local_docker``).
    scheduler: str
    #: The lighthouse role's host as the scheduler names it, when that is a usable host name.
    rank0_host: str | None = None

    @property
    def local(self) -> bool:
        return self.scheduler == LOCAL


def detect(rank0_env: str, environ: Mapping[str, str] | None = None) -> Placement:
    """The placement of this role; ``rank0_env`` is what torchx substituted for ``${rank0_env}``."""
    rank0 = (env.text(rank0_env, environ) or "") if rank0_env and not rank0_env.startswith("$") else ""
    if env.is_set(env.SLURM_JOB_ID, environ):
        scheduler = SLURM
    elif env.is_set(env.KUBERNETES_SERVICE_HOST, environ):
        scheduler = KUBERNETES
    elif rank0 in ("", "localhost", "127.0.0.1", "::1"):
        scheduler = LOCAL
    else:
        scheduler = REMOTE
    # A Slurm node list of one node is its name; anything like "node[01-02]" is not a host.
    usable = rank0 not in ("", "localhost", "127.0.0.1", "::1") and not any(c in rank0 for c in "[],")
    return Placement(scheduler, rank0 if usable else None)


def job_dir(requested: str, app_id: str, placement: Placement, *, needed: bool) -> str | None:
    """The directory all roles share (address file, exit files, multi-node group stores).

    ``requested`` is the component's ``job_dir`` (``auto``: choose). Returns None when none is
    needed and none can be chosen. Raises `ConfigurationError` saying what to pass when one is
    needed but the roles share no filesystem by default.
    """
    if requested and requested != AUTO:
        return requested
    if placement.local:
        return f"/tmp/ftlaunch-torchx/{app_id}"
    if placement.scheduler == SLURM:
        # torchx runs Slurm jobs in the submission directory (or its job_dir): on a cluster that is
        # a shared filesystem -- the training script is read from it on every node.
        return os.path.abspath(os.path.join(".ftlaunch-torchx", app_id))
    if not needed:
        return None
    where = "Kubernetes pods" if placement.scheduler == KUBERNETES else "the roles of this scheduler"
    raise ConfigurationError(
        f"{where} share no directory: pass --job_dir on a volume mounted in every role (e.g. --mounts "
        "type=volume,src=<PVC>,dst=/mnt/ft --job_dir /mnt/ft/job), or --lighthouse HOST:PORT of a "
        "lighthouse you run (enough for single-node groups)"
    )


def lighthouse_bind(requested: str, placement: Placement) -> str:
    """Where the lighthouse role listens: loopback when every role is on this machine, otherwise all
    interfaces (then the lighthouse role requires a job token on every request)."""
    if requested and requested != AUTO:
        return requested
    return "127.0.0.1:0" if placement.local else "0.0.0.0:0"


def is_loopback_bind(bind: str) -> bool:
    from ftlaunch.addresses import parse_host_port

    host, _ = parse_host_port(bind, default_port=0)
    return host in ("127.0.0.1", "localhost", "::1")

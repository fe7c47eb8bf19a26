"""ftlaunch: per-step fault-tolerant training for PyTorch, as a torchrun/torchelastic plugin."""

from __future__ import annotations

from ftlaunch.errors import (
    CheckpointTransportError,
    CommunicationError,
    ConfigurationError,
    EvictedError,
    FtlaunchError,
    LighthouseError,
    LighthouseUnavailableError,
    QuorumTimeoutError,
)

__version__ = "0.1.0"

# Public API, torchft's names: a torchft script ports by changing its imports. Resolved lazily
# (PEP 562) so `import ftlaunch` -- done by the CLI and by torchx to find the components below --
# does not import torch.
_LAZY = {
    "init": "ftlaunch.worker.entry",
    "FaultTolerance": "ftlaunch.worker.entry",
    "Timeouts": "ftlaunch.timeouts",
    "DistributedSampler": "ftlaunch.worker.data",
    "ExactlyOnceSampler": "ftlaunch.worker.exactly_once",
    "Manager": "ftlaunch.worker.manager",
    "DistributedDataParallel": "ftlaunch.worker.data_parallel",
    "Optimizer": "ftlaunch.worker.optim",
    "OptimizerWrapper": ("ftlaunch.worker.optim", "Optimizer"),
    "ProcessGroup": "ftlaunch.process_group",
    "ProcessGroupGloo": "ftlaunch.process_group",
    "ProcessGroupNCCL": "ftlaunch.process_group",
    "ProcessGroupBaby": "ftlaunch.process_group",
    "ProcessGroupBabyGloo": "ftlaunch.process_group",
    "ProcessGroupBabyNCCL": "ftlaunch.process_group",
    "ProcessGroupWrapper": "ftlaunch.process_group",
    "ProcessGroupDummy": "ftlaunch.process_group",
    "ErrorSwallowingProcessGroupWrapper": "ftlaunch.process_group",
    "ManagedProcessGroup": "ftlaunch.worker.managed_pg",
    "LocalSGD": "ftlaunch.worker.local_sgd",
    "DiLoCo": "ftlaunch.worker.local_sgd",
    "create_store_client": "ftlaunch.process_group",
    "extend_device_mesh": "ftlaunch.process_group",
    "ft_init_device_mesh": "ftlaunch.worker.hsdp",
    "ShardedState": "ftlaunch.worker.hsdp",
    "CheckpointTransport": "ftlaunch.checkpointing",
    "HTTPTransport": "ftlaunch.checkpointing",
    "PGTransport": "ftlaunch.checkpointing",
    "LighthouseServer": "ftlaunch.lighthouse.server",
    "LighthouseClient": "ftlaunch.lighthouse.client",
    # fairseq2's Gang API (docs/gang.md); its module is ftlaunch.gang, ft.gangs() builds the
    # fault-tolerant Gangs.
    "Gang": "ftlaunch.gang",
    "Gangs": "ftlaunch.gang",
    "FakeGang": "ftlaunch.gang",
    "ProcessGroupGang": "ftlaunch.gang",
    "ReduceOperation": "ftlaunch.gang",
    "GangError": "ftlaunch.errors",
    # torchft's current API
    "WorldSizeMode": "ftlaunch.worker.plan",
    "PureDistributedDataParallel": "ftlaunch.worker.data_parallel",
    "ReconfigureOptions": "ftlaunch.process_group",
    "reconfigure_with_store": "ftlaunch.process_group",
    "ParameterServer": "ftlaunch.process_group.parameter_server",
}


def __getattr__(name: str) -> object:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ftlaunch' has no attribute {name!r}")
    module_name, attr = target if isinstance(target, tuple) else (target, name)
    import importlib

    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointTransportError",
    "CommunicationError",
    "ConfigurationError",
    "EvictedError",
    "FtlaunchError",
    "LighthouseError",
    "LighthouseUnavailableError",
    "QuorumTimeoutError",
    *_LAZY,
    "ddp",
    "diloco",
    "hsdp",
]


# --- torchx components (launcher owner) ---
# torchx resolves `torchx run ftlaunch:hsdp` to a function *defined* in this file (it lints this
# source), so the documented signatures live here; the bodies are in ftlaunch.launcher.torchx_components.
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # torchx is optional: never imported at runtime here
    from torchx.specs import AppDef


def hsdp(
    *script_args: str,
    script: str | None = None,
    m: str | None = None,
    replicas: int = 2,
    workers_per_replica: int = 1,
    nnodes_per_replica: int = 1,
    spares: int = 0,
    image: str | None = None,
    name: str = "ftlaunch",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 2048,  # noqa: N803 - torchx's spelling
    h: str | None = None,
    max_restarts: int = 3,
    min_replicas: int = 1,
    join_timeout: float = 60.0,
    heartbeat_timeout: float = 5.0,
    lighthouse: str = "",
    lighthouse_bind: str = "",
    job_dir: str = "",
    env: dict[str, str] | None = None,
    max_retries: int = 0,
    mounts: list[str] | None = None,
    tee: int = 3,
    stragglers: str = "report",
    health_check: str = "",
    checkpoint_dir: str = "",
    checkpoint_every: int = 100,
) -> AppDef:
    """Fault-tolerant training over replica groups: a lighthouse role plus one torchrun role per group.

    Usage: torchx run -s local_cwd ftlaunch:hsdp --replicas 2 --workers_per_replica 2 --script train.py
    (without --script or -m: scripts/train_hsdp.py, fault-tolerant HSDP of a small GPT)

    Each replica group is its own ``torchrun --rdzv-backend ftlaunch`` (``nnodes_per_replica`` nodes of
    ``workers_per_replica`` workers), restarted by torchelastic on failure without stopping the others.
    ftlaunch provides the replica dimension (gradients averaged across groups, live recovery of a
    restarted group); what happens inside a group is the script's choice -- DDP, or FSDP sharding
    within the group, which with the replica dimension makes HSDP. The same spec works on every
    scheduler: the roles decide at start-up where the lighthouse listens and which directory they
    share (see docs/launcher.md), or pass ``lighthouse`` to use a lighthouse you run.

    Args:
        script_args: arguments of the training script or module
        script: training script to run in every worker (default: scripts/train_hsdp.py)
        m: python module to run instead of a script (python -m)
        replicas: number of replica groups
        workers_per_replica: workers per node of a replica group (torchrun --nproc-per-node)
        nnodes_per_replica: nodes per replica group (multi-node groups meet in a file store in job_dir)
        spares: hot spares, extra group roles that wait and replace a failed group at the next quorum
        image: image (e.g. docker) or, for local_cwd, the working directory
        name: job name
        cpu: cpus per replica-group node
        gpu: gpus per replica-group node
        memMB: memory in MB per replica-group node
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        max_restarts: torchelastic restarts of a group's workers before the group fails
        min_replicas: smallest quorum of replica groups
        join_timeout: seconds the lighthouse waits for stragglers before forming a quorum
        heartbeat_timeout: seconds after which a silent group leaves the quorum
        lighthouse: HOST:PORT of an existing lighthouse (then no lighthouse role is started)
        lighthouse_bind: where the lighthouse role listens (default: 127.0.0.1:0 when all roles share this
        machine, else 0.0.0.0:0 with a job token)
        job_dir: directory shared by all roles (default: /tmp/ftlaunch-torchx/<app_id> on one machine,
        .ftlaunch-torchx/<app_id> in the submission directory on Slurm; required on Kubernetes unless
        lighthouse is given)
        env: environment variables for every role (e.g. K1=v1,K2=v2)
        max_retries: scheduler retries of a role
        mounts: mounts for container schedulers (type=bind,src=...,dst=... or type=volume,src=PVC,dst=...)
        tee: tee worker streams to console and file (0 none, 1 stdout, 2 stderr, 3 both)
        stragglers: slow groups: report them, or replace a persistent one (a hot spare, else a restart)
        health_check: a command each group runs before its workers start or restart (e.g. "python -m
        ftlaunch.health"); while it fails the group stays out, retried with backoff
        checkpoint_dir: durable checkpoints in this directory, shared by the groups (the job resumes from its
        newest; default: none)
        checkpoint_every: committed steps between two durable checkpoints (0: resume only)
    """
    from ftlaunch.launcher.torchx_components import hsdp_app

    return hsdp_app(
        *script_args,
        script=script,
        m=m,
        replicas=replicas,
        workers_per_replica=workers_per_replica,
        nnodes_per_replica=nnodes_per_replica,
        image=image,
        name=name,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        max_restarts=max_restarts,
        min_replicas=min_replicas,
        join_timeout=join_timeout,
        heartbeat_timeout=heartbeat_timeout,
        lighthouse=lighthouse,
        lighthouse_bind=lighthouse_bind,
        job_dir=job_dir,
        env=env,
        max_retries=max_retries,
        mounts=mounts,
        tee=tee,
        spares=spares,
        stragglers=stragglers,
        health_check=health_check,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
    )


def ddp(
    *script_args: str,
    script: str | None = None,
    m: str | None = None,
    replicas: int = 2,
    workers_per_replica: int = 1,
    spares: int = 0,
    image: str | None = None,
    name: str = "ftlaunch",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 2048,  # noqa: N803 - torchx's spelling
    h: str | None = None,
    max_restarts: int = 3,
    min_replicas: int = 1,
    lighthouse: str = "",
    lighthouse_bind: str = "",
    job_dir: str = "",
    env: dict[str, str] | None = None,
    max_retries: int = 0,
    tee: int = 3,
    stragglers: str = "report",
    health_check: str = "",
    checkpoint_dir: str = "",
    checkpoint_every: int = 100,
) -> AppDef:
    """Fault-tolerant DDP training: ``hsdp`` with single-node replica groups (the script's model is
    replicated in every worker; ftlaunch averages across groups and heals restarted ones).

    Usage: torchx run -s local_cwd ftlaunch:ddp --replicas 2 --script train.py

    Args:
        script_args: arguments of the training script or module
        script: training script to run in every worker
        m: python module to run instead of a script (python -m)
        replicas: number of replica groups
        workers_per_replica: workers per replica group (torchrun --nproc-per-node)
        spares: hot spares, extra group roles that wait and replace a failed group at the next quorum
        image: image (e.g. docker) or, for local_cwd, the working directory
        name: job name
        cpu: cpus per replica group
        gpu: gpus per replica group
        memMB: memory in MB per replica group
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        max_restarts: torchelastic restarts of a group's workers before the group fails
        min_replicas: smallest quorum of replica groups
        lighthouse: HOST:PORT of an existing lighthouse (then no lighthouse role is started)
        lighthouse_bind: where the lighthouse role listens (default: 127.0.0.1:0 when all roles share this
        machine, else 0.0.0.0:0 with a job token)
        job_dir: directory shared by all roles (default: /tmp/ftlaunch-torchx/<app_id> on one machine,
        .ftlaunch-torchx/<app_id> in the submission directory on Slurm; required on Kubernetes unless
        lighthouse is given)
        env: environment variables for every role (e.g. K1=v1,K2=v2)
        max_retries: scheduler retries of a role
        tee: tee worker streams to console and file (0 none, 1 stdout, 2 stderr, 3 both)
        stragglers: slow groups: report them, or replace a persistent one (a hot spare, else a restart)
        health_check: a command each group runs before its workers start or restart (e.g. "python -m
        ftlaunch.health"); while it fails the group stays out, retried with backoff
        checkpoint_dir: durable checkpoints in this directory, shared by the groups (the job resumes from its
        newest; default: none)
        checkpoint_every: committed steps between two durable checkpoints (0: resume only)
    """
    return hsdp(
        *script_args,
        script=script,
        m=m,
        replicas=replicas,
        workers_per_replica=workers_per_replica,
        nnodes_per_replica=1,
        image=image,
        name=name,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        max_restarts=max_restarts,
        min_replicas=min_replicas,
        lighthouse=lighthouse,
        lighthouse_bind=lighthouse_bind,
        job_dir=job_dir,
        env=env,
        max_retries=max_retries,
        tee=tee,
        spares=spares,
        stragglers=stragglers,
        health_check=health_check,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
    )


def diloco(
    *script_args: str,
    script: str | None = None,
    m: str | None = None,
    replicas: int = 3,
    workers_per_replica: int = 1,
    spares: int = 0,
    sync_every: int = 100,
    fragments: int = 1,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
    quantize: int = 0,
    image: str | None = None,
    name: str = "ftlaunch-diloco",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 2048,  # noqa: N803 - torchx's spelling
    h: str | None = None,
    max_restarts: int = 3,
    min_replicas: int = 1,
    lighthouse: str = "",
    lighthouse_bind: str = "127.0.0.1:0",
    job_dir: str = "",
    env: dict[str, str] | None = None,
    max_retries: int = 0,
    tee: int = 3,
    stragglers: str = "report",
    health_check: str = "",
    checkpoint_dir: str = "",
    checkpoint_every: int = 100,
) -> AppDef:
    """Fault-tolerant DiLoCo / Streaming DiLoCo: ``ddp``'s roles, with the algorithm's settings.

    Usage: torchx run -s local_cwd ftlaunch:diloco --replicas 3 --sync_every 50 --script train_diloco.py

    The settings reach the script as environment variables that ``ft.diloco()`` (and
    ``ft.local_sgd()``) read for what the script does not pass itself.

    Args:
        script_args: arguments of the training script or module
        script: training script to run in every worker
        m: python module to run instead of a script (python -m)
        replicas: number of replica groups
        workers_per_replica: workers per replica group (torchrun --nproc-per-node)
        spares: hot spares, extra group roles that wait and replace a failed group at the next quorum
        sync_every: inner steps between two syncs of a fragment (FTLAUNCH_SYNC_EVERY)
        fragments: model fragments synced in turn, Streaming DiLoCo when > 1 (FTLAUNCH_FRAGMENTS)
        fragment_sync_delay: inner steps a fragment's all-reduce overlaps (FTLAUNCH_FRAGMENT_SYNC_DELAY)
        fragment_update_alpha: mixing of local and global parameters (FTLAUNCH_FRAGMENT_UPDATE_ALPHA)
        quantize: pseudo-gradient bits, 0 (full precision), 8 or 4 (FTLAUNCH_QUANTIZE)
        image: image (e.g. docker) or, for local_cwd, the working directory
        name: job name
        cpu: cpus per replica group
        gpu: gpus per replica group
        memMB: memory in MB per replica group
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        max_restarts: torchelastic restarts of a group's workers before the group fails
        min_replicas: smallest quorum of replica groups
        lighthouse: HOST:PORT of an existing lighthouse (then no lighthouse role is started)
        lighthouse_bind: where the lighthouse role listens; 0.0.0.0:0 when groups run on other hosts
        job_dir: directory shared by all roles (default /tmp/ftlaunch-torchx/<app_id>)
        env: environment variables for every role (e.g. K1=v1,K2=v2)
        max_retries: scheduler retries of a role
        tee: tee worker streams to console and file (0 none, 1 stdout, 2 stderr, 3 both)
        stragglers: slow groups: report them, or replace a persistent one (a hot spare, else a restart)
        health_check: a command each group runs before its workers start or restart (e.g. "python -m
        ftlaunch.health"); while it fails the group stays out, retried with backoff
        checkpoint_dir: durable checkpoints in this directory, shared by the groups (the job resumes from its
        newest; default: none)
        checkpoint_every: committed steps between two durable checkpoints (0: resume only)
    """
    from ftlaunch.launcher.torchx_components import diloco_environ

    algorithm_env = diloco_environ(
        sync_every, fragments, fragment_sync_delay, fragment_update_alpha, quantize
    )
    return hsdp(
        *script_args,
        script=script,
        m=m,
        replicas=replicas,
        workers_per_replica=workers_per_replica,
        nnodes_per_replica=1,
        image=image,
        name=name,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        h=h,
        max_restarts=max_restarts,
        min_replicas=min_replicas,
        lighthouse=lighthouse,
        lighthouse_bind=lighthouse_bind,
        job_dir=job_dir,
        env={**algorithm_env, **(env or {})},
        max_retries=max_retries,
        tee=tee,
        spares=spares,
        stragglers=stragglers,
        health_check=health_check,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
    )


def _torchx_signatures() -> None:
    from ftlaunch.launcher.torchx_components import with_runtime_annotations

    with_runtime_annotations(hsdp)
    with_runtime_annotations(ddp)
    with_runtime_annotations(diloco)


_torchx_signatures()
# --- end torchx components ---

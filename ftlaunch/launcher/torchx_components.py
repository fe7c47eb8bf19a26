"""Bodies of the torchx components ``ftlaunch:hsdp``, ``ftlaunch:ddp`` and ``ftlaunch:diloco``.

torchx addresses ``ftlaunch:hsdp`` by the function *defined* in ``ftlaunch/__init__.py`` (it lints
that file's source), so the thin, documented definitions live there and call `hsdp_app` here.

The app has one ``lighthouse`` role (first) and one role per replica group (``rg0``, ``rg1``, ...),
each ``torchrun --rdzv-backend ftlaunch --nnodes nnodes_per_replica ... -m ftlaunch.run SCRIPT``
run by `ftlaunch.launcher.group_role` -- so torchelastic restarts a group's workers on its own, a
group never waits for another, and a group's end never ends the others; and each worker is forked
from its node's warm standby interpreter (`ftlaunch.run`), so a restart costs no torch import. No port is
fixed: the lighthouse role binds a free port and publishes its address in the job directory; multi-node groups
meet in a file store there too. What depends on the scheduler (the job directory, loopback or all interfaces,
the lighthouse's host) is decided by each role at start-up from torchx's macros
(`ftlaunch.launcher.placement`), because a component is built before the scheduler is known. With
``lighthouse=HOST:PORT`` of a lighthouse you run there is no lighthouse role.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchx.specs import AppDef

_ANNOTATION_NAMES = {"str": str, "int": int, "float": float, "bool": bool, "dict": dict, "list": list}

#: What ``ftlaunch:hsdp`` runs when neither ``--script`` nor ``-m`` is given (relative to the role's
#: working directory: the checkout for ``local_cwd``, the image's for containers).
DEFAULT_SCRIPT = "scripts/train_hsdp.py"
#: What torchrun runs in front of the script: ``python -u -m ftlaunch.run SCRIPT ...`` (`ftlaunch.run`).
WORKER_MODULE = ("-m", "ftlaunch.run")
#: Retries the lighthouse role gets at least (``max_retries`` applies if larger).
LIGHTHOUSE_ROLE_RETRIES = 3


def with_runtime_annotations(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn`` a signature with real types: torchx builds its argparse from the annotations.

    ``ftlaunch/__init__.py`` uses ``from __future__ import annotations``, which turns them into
    strings torchx cannot decode.
    """
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        ann = p.annotation
        if isinstance(ann, str):
            ann = eval(ann, {"__builtins__": {}}, _ANNOTATION_NAMES)  # noqa: S307 - our own literal annotations
        params.append(p.replace(annotation=ann))
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


def _job_environ(group: int, replicas: int, lighthouse: str, spares: int = 0) -> dict[str, str]:
    """The job environment of group role ``group``.

    With a lighthouse of the user's it is the whole launcher->worker contract (`env.JobEnv`). With a
    lighthouse role the address exists only once that role has bound its port, so the group's
    rendezvous publishes the contract at run time (``JobEnv.to_environ``, before the workers start)
    and the spec names the group only.
    """
    from ftlaunch import env

    if lighthouse:
        return env.JobEnv(group, replicas, lighthouse, spares=spares).to_environ()
    out = {env.REPLICA_GROUP_ID: str(group), env.NUM_REPLICA_GROUPS: str(replicas)}
    if spares:
        out[env.FTLAUNCH_SPARES] = str(spares)
    return out


def hsdp_app(
    *script_args: str,
    script: str | None,
    m: str | None,
    replicas: int,
    workers_per_replica: int,
    nnodes_per_replica: int,
    image: str | None,
    name: str,
    cpu: int,
    gpu: int,
    memMB: int,  # noqa: N803 - torchx's spelling
    h: str | None,
    max_restarts: int,
    min_replicas: int,
    join_timeout: float,
    heartbeat_timeout: float,
    lighthouse: str,
    lighthouse_bind: str,
    job_dir: str,
    env: dict[str, str] | None,
    max_retries: int,
    mounts: list[str] | None,
    tee: int,
    spares: int = 0,
    stragglers: str = "report",
    health_check: str = "",
    checkpoint_dir: str = "",
    checkpoint_every: int = 100,
) -> AppDef:
    """Build the AppDef; see ``ftlaunch.hsdp`` for the meaning and the defaults of every argument.

    No defaults here on purpose: ``ftlaunch.hsdp`` (the definition torchx reads) owns them, and
    every caller goes through it, so the two cannot drift apart.
    """
    import torchx
    import torchx.specs as specs
    from torchx.specs import macros

    from ftlaunch import env as ftenv
    from ftlaunch.errors import ConfigurationError
    from ftlaunch.launcher.placement import AUTO
    from ftlaunch.lighthouse.quorum import HEARTBEAT_TIMEOUT, JOIN_TIMEOUT

    if script is not None and m is not None:
        raise ConfigurationError("give --script or -m, not both")
    if script is None and m is None:
        script = DEFAULT_SCRIPT
    for value, what in (
        (replicas, "replicas"),
        (workers_per_replica, "workers_per_replica"),
        (nnodes_per_replica, "nnodes_per_replica"),
        (min_replicas, "min_replicas"),
    ):
        if value < 1:
            raise ConfigurationError(f"--{what} must be >= 1 (got {value})")
    if spares < 0:
        raise ConfigurationError(f"--spares must be >= 0 (got {spares})")
    if min_replicas > replicas:
        raise ConfigurationError(f"--min_replicas {min_replicas} > --replicas {replicas}")
    if max_restarts < 0:
        raise ConfigurationError("--max_restarts must be >= 0")
    if stragglers not in ftenv.STRAGGLER_POLICIES:
        raise ConfigurationError(
            f"--stragglers {stragglers!r} must be one of {', '.join(ftenv.STRAGGLER_POLICIES)}"
        )
    if lighthouse and stragglers != "report":
        raise ConfigurationError(
            "--stragglers sets the policy of the lighthouse role; the lighthouse at --lighthouse has its own "
            "(ftlaunch-lighthouse --stragglers)"
        )
    JOIN_TIMEOUT.checked(join_timeout, "--join_timeout")
    if checkpoint_every < 0:
        raise ConfigurationError(f"--checkpoint_every must be >= 0 (got {checkpoint_every})")
    durable_env = ftenv.CheckpointEnv(checkpoint_dir or None, checkpoint_every).to_environ()
    HEARTBEAT_TIMEOUT.checked(heartbeat_timeout, "--heartbeat_timeout")

    image = image or torchx.IMAGE
    own_job_dir = not job_dir
    job_dir = job_dir or AUTO
    base_env = {ftenv.LOGLEVEL: "WARNING", **(env or {})}
    resource = specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h)
    parsed_mounts = specs.parse_mounts(mounts) if mounts else []
    # Both kinds of role decide at start-up what depends on the scheduler (`placement`), from
    # torchx's macros: the app id and where the first role -- the lighthouse -- runs.
    where = ["--app-id", macros.app_id, "--rank0-env", macros.rank0_env, "--job-dir", job_dir]
    roles = []

    if not lighthouse:
        roles.append(  # first: torchx's ${rank0_env} then names the lighthouse role's host
            specs.Role(
                name="lighthouse",
                image=image,
                entrypoint="python",
                args=[
                    "-m",
                    "ftlaunch.launcher.lighthouse_role",
                    *where,
                    "--groups",
                    str((replicas + spares) * nnodes_per_replica),
                    "--min-replicas",
                    str(min_replicas),
                    "--expected-replicas",
                    str(replicas),
                    "--join-timeout",
                    str(join_timeout),
                    "--heartbeat-timeout",
                    str(heartbeat_timeout),
                    "--stragglers",
                    stragglers,
                    "--bind",
                    lighthouse_bind or AUTO,
                    *(["--cleanup"] if own_job_dir else []),
                ],
                env=dict(base_env),
                resource=specs.resource(cpu=1, gpu=0, memMB=512),
                mounts=parsed_mounts,
                # The job's single point of failure: let the scheduler replace it alone where it
                # can (REPLICA: Kubernetes/Volcano); it comes back on the same port with the same
                # token (lighthouse_role) and the groups wait for it (FTLAUNCH_LIGHTHOUSE_OUTAGE).
                max_retries=max(max_retries, LIGHTHOUSE_ROLE_RETRIES),
                retry_policy=specs.RetryPolicy.REPLICA,
            )
        )

    for group in range(replicas + spares):  # groups replicas.. start as hot spares
        torchrun = [
            "--rdzv-backend",
            "ftlaunch",
            "--rdzv-id",
            macros.app_id,
            "--nnodes",
            str(nnodes_per_replica),
            "--nproc-per-node",
            str(workers_per_replica),
            "--max-restarts",
            str(max_restarts),
            "--tee",
            str(tee),
        ]
        # Every worker through `ftlaunch.run`: forked from its node's warm standby, torch imported
        # (the group's rendezvous starts the standby), its Baby child forked before the script runs.
        torchrun += [*WORKER_MODULE, *([script] if script is not None else ["-m", m or ""])]
        torchrun += list(script_args)
        roles.append(
            specs.Role(
                name=ftenv.replica_id(group),
                image=image,
                entrypoint="python",
                args=[
                    "-m",
                    "ftlaunch.launcher.group_role",
                    *where,
                    "--group",
                    str(group),
                    "--groups",
                    str(replicas),
                    *(["--spares", str(spares)] if spares else []),
                    "--nnodes",
                    str(nnodes_per_replica),
                    "--node",
                    macros.replica_id,
                    *(["--lighthouse", lighthouse] if lighthouse else []),
                    "--",
                    *torchrun,
                ],
                num_replicas=nnodes_per_replica,
                env={
                    **base_env,
                    **durable_env,
                    **_job_environ(group, replicas, lighthouse, spares),
                    **ftenv.health_check_environ(health_check.strip() or None, None),
                },
                resource=resource,
                mounts=parsed_mounts,
                max_retries=max_retries,
            )
        )
    return specs.AppDef(name=name, roles=roles)


def diloco_environ(
    sync_every: int, fragments: int, fragment_sync_delay: int, fragment_update_alpha: float, quantize: int
) -> dict[str, str]:
    """``ftlaunch:diloco``'s settings as the variables ``ft.diloco()`` reads, checked here so that a
    wrong value fails at ``torchx run`` instead of in every worker."""
    from ftlaunch import env as ftenv
    from ftlaunch.errors import ConfigurationError

    if fragments < 1 or sync_every < fragments or sync_every % fragments:
        raise ConfigurationError(
            f"--sync_every {sync_every} must be a multiple of --fragments {fragments} (>= 1)"
        )
    if not 0 <= fragment_sync_delay < sync_every // fragments:
        raise ConfigurationError(
            f"--fragment_sync_delay {fragment_sync_delay} must be >= 0 and < sync_every / fragments"
        )
    if not 0.0 <= fragment_update_alpha <= 1.0:
        raise ConfigurationError(f"--fragment_update_alpha {fragment_update_alpha} must be in [0, 1]")
    if quantize not in (0, 4, 8):
        raise ConfigurationError(f"--quantize {quantize} must be 0, 4 or 8")
    return {
        ftenv.FTLAUNCH_SYNC_EVERY: str(sync_every),
        ftenv.FTLAUNCH_FRAGMENTS: str(fragments),
        ftenv.FTLAUNCH_FRAGMENT_SYNC_DELAY: str(fragment_sync_delay),
        ftenv.FTLAUNCH_FRAGMENT_UPDATE_ALPHA: repr(float(fragment_update_alpha)),
        ftenv.FTLAUNCH_QUANTIZE: str(quantize),
    }

"""Bodies of the torchx components ``ftlaunch:hsdp``, ``ftlaunch:ddp`` and ``ftlaunch:diloco``.

torchx addresses ``ftlaunch:hsdp`` by the function *defined* in ``ftlaunch/__init__.py`` (it lints
that file's source), so the thin, documented definitions live there and call `hsdp_app` here.

The app has one ``lighthouse`` role and one role per replica group (``rg0``, ``rg1``, ...), each a
plain ``torchrun --rdzv-backend ftlaunch`` with ``--nnodes nnodes_per_replica`` -- so torchelastic
restarts a group's workers on its own, and a group never waits for another. No port is fixed: the
lighthouse role binds a free port and publishes it in a file in the job directory, which the
groups' rendezvous read (``lighthouse_file=``); multi-node groups meet in a file store there too.
That job directory must be shared by all roles: automatic on ``local_cwd``/``local_docker``; on a
cluster pass a shared ``job_dir``, or ``lighthouse=HOST:PORT`` of a lighthouse you run (then there
is no lighthouse role).
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchx.specs import AppDef

_ANNOTATION_NAMES = {"str": str, "int": int, "float": float, "bool": bool, "dict": dict, "list": list}


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


def _job_environ(group: int, replicas: int, lighthouse: str) -> dict[str, str]:
    """The job environment of group role ``group``.

    With a lighthouse of the user's it is the whole launcher->worker contract (`env.JobEnv`). With a
    lighthouse role the address exists only once that role has bound its port, so the group's
    rendezvous publishes the contract at run time (``JobEnv.to_environ``, before the workers start)
    and the spec names the group only.
    """
    from ftlaunch import env

    if lighthouse:
        return env.JobEnv(group, replicas, lighthouse).to_environ()
    return {env.REPLICA_GROUP_ID: str(group), env.NUM_REPLICA_GROUPS: str(replicas)}


class _Raw(str):
    """A shell word that must not be quoted (it holds a variable expansion)."""


def _join(words: list[str]) -> str:
    return " ".join(w if isinstance(w, _Raw) else shlex.quote(w) for w in words)


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
    from ftlaunch.launcher.lighthouse_role import ADDRESS_FILE

    if (script is None) == (m is None):
        raise ConfigurationError("exactly one of --script and -m must be given")
    for value, what in ((replicas, "replicas"), (workers_per_replica, "workers_per_replica"),
                        (nnodes_per_replica, "nnodes_per_replica"), (min_replicas, "min_replicas")):
        if value < 1:
            raise ConfigurationError(f"--{what} must be >= 1 (got {value})")
    if min_replicas > replicas:
        raise ConfigurationError(f"--min_replicas {min_replicas} > --replicas {replicas}")
    if max_restarts < 0:
        raise ConfigurationError("--max_restarts must be >= 0")

    image = image or torchx.IMAGE
    own_job_dir = not job_dir
    job_dir = job_dir or f"/tmp/ftlaunch-torchx/{macros.app_id}"
    base_env = {"LOGLEVEL": "WARNING", **(env or {})}
    resource = specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h)
    parsed_mounts = specs.parse_mounts(mounts) if mounts else []
    roles = []

    if lighthouse:
        endpoint, lighthouse_conf = lighthouse, ""
    else:
        endpoint, lighthouse_conf = "", f",lighthouse_file={job_dir}/{ADDRESS_FILE}"
        roles.append(
            specs.Role(
                name="lighthouse",
                image=image,
                entrypoint="python",
                args=[
                    "-m", "ftlaunch.launcher.lighthouse_role",
                    "--job-dir", job_dir,
                    "--groups", str(replicas * nnodes_per_replica),
                    "--min-replicas", str(min_replicas),
                    "--join-timeout", str(join_timeout),
                    "--heartbeat-timeout", str(heartbeat_timeout),
                    "--bind", lighthouse_bind,
                    *(["--cleanup"] if own_job_dir else []),
                ],
                env=dict(base_env),
                resource=specs.resource(cpu=1, gpu=0, memMB=512),
                mounts=parsed_mounts,
                max_retries=max_retries,
            )
        )

    for group in range(replicas):
        rid = ftenv.replica_id(group)
        conf = f"replica_group_id={group},num_replica_groups={replicas}{lighthouse_conf}"
        if nnodes_per_replica > 1:
            conf += f",group_endpoint=file:{job_dir}/{rid}.store"
        torchrun = [
            "torchrun",
            "--rdzv-backend", "ftlaunch",
            "--rdzv-endpoint", endpoint,
            "--rdzv-id", f"{macros.app_id}",
            "--rdzv-conf", conf,
            "--nnodes", str(nnodes_per_replica),
            "--nproc-per-node", str(workers_per_replica),
            "--max-restarts", str(max_restarts),
            "--tee", str(tee),
        ]
        torchrun += [script] if script is not None else ["-m", m or ""]
        torchrun += list(script_args)
        exit_file = f"{job_dir}/{rid}.{macros.replica_id}.exit"
        command = (
            f"mkdir -p {shlex.quote(job_dir)}; {_join(torchrun)}; rc=$?; "
            f"echo $rc > {shlex.quote(exit_file)}; exit $rc"
        )
        roles.append(
            specs.Role(
                name=rid,
                image=image,
                entrypoint="bash",
                args=["-c", command],
                num_replicas=nnodes_per_replica,
                env={**base_env, **_job_environ(group, replicas, lighthouse)},
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
        raise ConfigurationError(f"--sync_every {sync_every} must be a multiple of --fragments {fragments} (>= 1)")
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

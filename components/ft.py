"""torchx components for the example jobs of this repository (run them from a checkout).

The general-purpose components are ``ftlaunch:hsdp`` and ``ftlaunch:ddp`` (installed with the
package). This file only adds *presets* for the scripts under ``scripts/``: their script path, their
flags as typed arguments, and the defaults of the README demo -- so ``torchx run`` with no arguments
(see ``.torchxconfig``) runs a real fault-tolerant training. The AppDef is built by the same code as
``ftlaunch:hsdp`` itself; nothing is duplicated here.

    torchx run -s local_cwd components/ft.py:train_ddp --replicas 3 --steps 200
"""

import torchx.specs as specs

from ftlaunch import hsdp


def train_ddp(
    replicas: int = 2,
    workers_per_replica: int = 1,
    steps: int = 50,
    step_sleep: float = 0.0,
    backend: str = "gloo",
    max_restarts: int = 3,
    min_replicas: int = 1,
    gpu: int = 0,
    lighthouse: str = "",
    job_dir: str = "",
) -> specs.AppDef:
    """scripts/train_ddp.py as fault-tolerant replica groups (a lighthouse role plus one role per group).

    Args:
        replicas: number of replica groups
        workers_per_replica: workers per replica group
        steps: committed steps to train
        step_sleep: extra seconds per step (slows the demo down so failures are easy to watch)
        backend: cross-group process group of the script (gloo or baby-gloo)
        max_restarts: torchelastic restarts of a group's workers before the group fails
        min_replicas: smallest quorum of replica groups
        gpu: gpus per replica group
        lighthouse: HOST:PORT of an existing lighthouse (then no lighthouse role is started)
        job_dir: directory shared by all roles (default /tmp/ftlaunch-torchx/<app_id>)
    """
    return hsdp(
        "--steps",
        str(steps),
        "--step-sleep",
        str(step_sleep),
        "--backend",
        backend,
        script="scripts/train_ddp.py",
        name="train_ddp",
        replicas=replicas,
        workers_per_replica=workers_per_replica,
        max_restarts=max_restarts,
        min_replicas=min_replicas,
        gpu=gpu,
        lighthouse=lighthouse,
        job_dir=job_dir,
    )

"""The ``ftlaunch`` launcher: a supervisor that runs N replica groups, each a torchelastic agent.

See docs/launcher.md. Entry points: the ``ftlaunch`` console script (`ftlaunch.launcher.cli`), `Supervisor`
for programmatic use, and the torchx components in `ftlaunch.launcher.torchx_components`.
"""

from __future__ import annotations

from ftlaunch.launcher.options import ChaosSpec, LaunchOptions

__all__ = ["ChaosSpec", "LaunchOptions", "Supervisor", "run"]


def run(opts: LaunchOptions) -> int:
    """Run a job to completion and return ``ftlaunch``'s exit code."""
    from ftlaunch.launcher.supervisor import Supervisor

    return Supervisor(opts).run()


def __getattr__(name: str):  # lazy: importing the package must not start threads or import torch
    if name == "Supervisor":
        from ftlaunch.launcher.supervisor import Supervisor

        return Supervisor
    raise AttributeError(name)

"""Run a training script as a fast-restarting ftlaunch worker.

    python -m ftlaunch.run SCRIPT [ARGS...]
    python -m ftlaunch.run -m MODULE [ARGS...]

Under torchrun, put it in front of the script:

    torchrun --rdzv-backend ftlaunch ... -m ftlaunch.run train.py --lr 0.1

Each worker runs the script exactly as `python -u train.py` would (__main__, sys.argv, sys.path[0],
exit code), but a restarted worker imports nothing: it is forked, torch already imported, from the
warm standby interpreter the `ftlaunch` rendezvous keeps on the node, and its Baby process group's
child is forked ready before the script runs (kill -> first commit about 8 times shorter than a
fresh interpreter's). The standby imports torch when
the first worker asks for it and ends with torchrun's agent.

Without a standby (FTLAUNCH_ZYGOTE=0, or another rendezvous backend) the worker imports torch
itself and still forks its Baby child early. FTLAUNCH_PRESTART_FORK=0 turns both off (for a script
that must set something in its environment before torch is imported). The `ftlaunch` launcher and
the torchx components (ftlaunch:ddp, ftlaunch:hsdp, ftlaunch:diloco) run every worker this way
already. Details: docs/launcher.md.
"""

# The public name of `ftlaunch.bootstrap.prestart`, which implements it.

from __future__ import annotations

if __name__ == "__main__":
    # The importable module's main, not a __main__ copy's: the process group must find the Baby
    # child started there (`ftlaunch.bootstrap.prestart.take`).
    from ftlaunch.bootstrap import prestart

    prestart.main(prog="ftlaunch.run", description=__doc__)

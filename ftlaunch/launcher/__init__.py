"""Launching fault-tolerant jobs: everything that starts, watches and restarts replica groups.

The three ways in (docs/launcher.md) and the modules behind them:

* ``ftlaunch`` -- `cli` (flags -> `options.LaunchOptions`; torchrun's own flags and what each means
  here in `torchrun_flags`) runs the `supervisor`: the lifecycle loop
  of one torchelastic `agent` process per replica group. What it learns goes to each group's
  accounting (`group`); ``--chaos`` is `chaos`; the status line and the summary are `report` (over
  `output`'s console); process-tree teardown is `procs`.
* ``torchrun --rdzv-backend ftlaunch`` -- `rendezvous`, the torchelastic backend (also used by the
  agents of ``ftlaunch``). It publishes the job environment (`ftlaunch.env.JobEnv`) to the workers
  under every launch path.
* ``torchx run ftlaunch:hsdp`` -- `torchx_components` builds the app; at run time its roles are
  `lighthouse_role` and `group_role`, which decide what depends on the scheduler with `placement`.

Every path that hosts a lighthouse, or uses one running elsewhere, goes through `lighthouse_host`,
which is also the launcher's only reader of the lighthouse status. This package sits above
`ftlaunch.lighthouse` and the foundation modules (`env`, `addresses`, `errors`, `lifetime`); nothing
below imports it. Importing it starts no thread and does not import torch.
"""

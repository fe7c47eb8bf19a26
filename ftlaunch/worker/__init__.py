"""The training-process side of an ftlaunch job: everything that runs inside a worker.

Layers inside this folder, bottom up (each module uses only those above it in this list):

- `plan`: pure; from a quorum, what this replica group does in the step (ranks, sources, heals,
  whose gradients count: `WorldSizeMode`).
- `group_store`, `state`, `commit`, `managed_work`: the mechanics of one step (the quorum relay and
  commit vote inside the replica group, the registry of state that travels with a heal, the commit
  waits, the Work an allreduce returns).
- `manager`: the per-step protocol (quorum -> allreduce -> commit), built on the above and on the
  reconfigurable process groups and checkpoint transports below this folder.
- `data_parallel`, `optim`, `managed_pg`, `data`: what a training loop holds (DDP, the
  commit-gated optimizer, a process group that reduces through the Manager, the sampler).
- `entry`: ``ftlaunch.init()``, which reads the launcher's environment once and builds the rest.
"""

from __future__ import annotations

from ftlaunch.worker.entry import FaultTolerance, init

__all__ = ["FaultTolerance", "init"]

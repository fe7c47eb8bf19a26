"""fairseq2's Gang API: the processes of a job as gangs, one per parallelism (docs/gang.md).

A fairseq2-style training loop runs unchanged on these classes; under ftlaunch, ``ft.gangs()``
(``ftlaunch.init(...).gangs()``) returns `Gangs` whose ``rdp`` - the dimension across replica
groups - survives failures: its size is the live quorum's, and its collectives go through the
Manager (``ftlaunch.worker.managed_gang``).

The layout:

* `base` - the `Gang` interface, `ReduceOperation`, the argument checks every gang shares,
  `broadcast_flag`, `all_sum`, `raise_operational_gang_error`;
* `fake` - `FakeGang`, a gang of identical peers simulated in one process;
* `process_group` - `ProcessGroupGang`, a gang over a torch ProcessGroup (gloo, NCCL);
* `product` - `ProductGang`, the outer x inner grid that spans replica groups;
* `gangs` - `Gangs`, the factories (`create_parallel_gangs`, `create_fsdp_gangs`, ...) and the
  current gangs (`get_current_gangs`, `set_gangs`, the defaults, `GangContext`).

This layer knows torch.distributed and ftlaunch's error types, nothing of the Manager.
"""

from __future__ import annotations

from ftlaunch.errors import GangError, InvalidOperationError, NotSupportedError, OperationalError
from ftlaunch.gang.base import Gang, ReduceOperation, all_sum, broadcast_flag, raise_operational_gang_error
from ftlaunch.gang.fake import FakeGang
from ftlaunch.gang.gangs import (
    GangContext,
    Gangs,
    StandardGangContext,
    create_fake_gangs,
    create_fsdp_gangs,
    create_parallel_gangs,
    get_current_gangs,
    get_default_gangs,
    maybe_get_current_gangs,
    set_default_gangs,
    set_gangs,
)
from ftlaunch.gang.process_group import ProcessGroupGang
from ftlaunch.gang.product import ProductGang

__all__ = [
    "FakeGang",
    "Gang",
    "GangContext",
    "GangError",
    "StandardGangContext",
    "Gangs",
    "InvalidOperationError",
    "NotSupportedError",
    "OperationalError",
    "ProcessGroupGang",
    "ProductGang",
    "ReduceOperation",
    "all_sum",
    "broadcast_flag",
    "create_fake_gangs",
    "create_fsdp_gangs",
    "create_parallel_gangs",
    "get_current_gangs",
    "get_default_gangs",
    "maybe_get_current_gangs",
    "set_default_gangs",
    "set_gangs",
    "raise_operational_gang_error",
]

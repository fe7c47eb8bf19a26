"""torchft's module path; the implementations live in ftlaunch.worker.data (the fixed shards,
torchft's `DistributedSampler`) and ftlaunch.worker.exactly_once (`ExactlyOnceSampler`).

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.data import DistributedSampler``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.worker.data import DistributedSampler
from ftlaunch.worker.exactly_once import ExactlyOnceSampler

__all__ = ["DistributedSampler", "ExactlyOnceSampler"]

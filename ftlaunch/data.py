"""torchft's module path; the implementation lives in ftlaunch.worker.data.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.data import DistributedSampler``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.worker.data import DistributedSampler

__all__ = ["DistributedSampler"]

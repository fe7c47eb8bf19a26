"""torchft's module path; the implementation lives in ftlaunch.worker.local_sgd.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.local_sgd import DiLoCo, LocalSGD``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.worker.local_sgd import DiLoCo, LocalSGD
from ftlaunch.worker.sync_point import extract_local_tensor

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]

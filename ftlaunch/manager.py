"""torchft's module path; the implementation lives in ftlaunch.worker.manager.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.manager import Manager``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.worker.managed_work import WorkOnManager
from ftlaunch.worker.manager import Manager, WorldSizeMode

#: torchft's name for a Work bound to a Manager (its DDP comm hook and its tests build one).
_ManagedWork = WorkOnManager

__all__ = ["Manager", "WorldSizeMode"]

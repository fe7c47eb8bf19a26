"""torchft's module path; the implementation lives in ftlaunch.worker.manager.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.manager import Manager``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.worker.manager import Manager, WorldSizeMode

__all__ = ["Manager", "WorldSizeMode"]

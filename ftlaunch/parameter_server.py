"""torchft's module path; the implementation lives in ftlaunch.process_group.parameter_server.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.parameter_server import ParameterServer``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.process_group.parameter_server import ParameterServer

__all__ = ["ParameterServer"]

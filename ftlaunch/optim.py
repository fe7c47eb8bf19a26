"""torchft's module path; the implementation lives in ftlaunch.worker.optim.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.optim import OptimizerWrapper``). Nothing inside ftlaunch imports this module.
"""

from ftlaunch.worker.optim import Optimizer

#: torchft's name for the commit-gated optimizer wrapper.
OptimizerWrapper = Optimizer

__all__ = ["Optimizer", "OptimizerWrapper"]

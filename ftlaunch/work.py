"""torchft's module path ``torchft.work``: the Work objects ops return.

Kept so that code written against torchft ports by changing the import: torchft names an already
completed Work ``_DummyWork(result)`` (what a group returns once it has errored, or a do-nothing
group); ftlaunch's is `DoneWork`, the same thing. Nothing inside ftlaunch imports this module.
"""

from ftlaunch.process_group.work import DoneWork

#: torchft's name for `DoneWork`.
_DummyWork = DoneWork

__all__ = ["DoneWork", "_DummyWork"]

"""torchft's module path ``torchft.coordination``; the implementation lives in ftlaunch.lighthouse.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.coordination import LighthouseServer``): torchft's form, which serves on
construction, takes milliseconds and has ``address()`` as a method. ftlaunch's own form is
``ftlaunch.lighthouse.LighthouseServer``. torchft's low-level ``LighthouseClient``/``ManagerServer``
are not offered here: ftlaunch has no per-group manager server, and its client
(``ftlaunch.lighthouse.LighthouseClient``) speaks in `QuorumMember`s. Nothing inside ftlaunch
imports this module.
"""

from ftlaunch.lighthouse.server import TorchftLighthouseServer as LighthouseServer

__all__ = ["LighthouseServer"]

"""torchft's module path ``torchft.coordination``; the implementation lives in ftlaunch.lighthouse.

Kept so that a torchft script ports by changing ``torchft`` to ``ftlaunch``
(``from ftlaunch.coordination import LighthouseServer``): torchft's form, which serves on
construction, takes milliseconds and has ``address()`` as a method. ftlaunch's own form is
``ftlaunch.lighthouse.LighthouseServer``. ``LighthouseClient`` is torchft's form too (keyword
``quorum(replica_id=..., timeout=timedelta(...), ...)``, ``heartbeat(replica_id)``); ftlaunch's own
client (``ftlaunch.lighthouse.LighthouseClient``) speaks in `QuorumMember`s. torchft's
``ManagerClient``/``ManagerServer`` are not offered: ftlaunch has no per-group manager server.
Nothing inside ftlaunch imports this module.
"""

from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.lighthouse.server import TorchftLighthouseServer as LighthouseServer
from ftlaunch.lighthouse.torchft_client import TorchftLighthouseClient as LighthouseClient

__all__ = ["LighthouseClient", "LighthouseServer", "Quorum", "QuorumMember"]

"""Bounds the lighthouse puts on what one client can make it spend (docs/security.md): open
connections below the process's file-descriptor limit, and warnings per client host.

Why a module of its own: the transport (connections) and the routes (error answers) both apply
them, and the numbers are policy, documented in one place. No sockets, no HTTP.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

#: Upper bound of open client connections, whatever the file-descriptor limit allows.
MAX_CONNECTIONS = 16384
#: Seconds between two "connection cap reached" warnings.
CAP_WARNING_INTERVAL = 60.0


def default_max_connections(accept_batch: int) -> int:
    """Open connections allowed: below this process's file-descriptor limit by an eighth of it (at
    least 64: the supervisor that hosts a lighthouse has pipes, logs, stores) and by ``accept_batch``
    (connections asyncio may have accepted before the cap is looked at), so a flood of idle sockets
    can never make ``accept`` fail for a real group."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return 1024
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - max(64, soft // 8) - accept_batch))


class WarningLimiter:
    """Rate limit for the warnings one client causes (a fuzzing client must not write the log full).

    Per client host (the port changes with every connection): at most ``burst`` warnings per
    ``window`` seconds; `allow` returns False for the rest and counts them, and the next allowed
    warning reports how many were dropped (`take_suppressed`). At most ``max_hosts`` hosts are
    remembered (the least recently seen forgotten first), so the limiter itself stays bounded.
    """

    def __init__(
        self,
        burst: int = 5,
        window: float = 60.0,
        max_hosts: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.window, self.max_hosts = burst, window, max_hosts
        self._clock = clock
        self._hosts: OrderedDict[str, list[float]] = OrderedDict()  # host -> [window start, count, dropped]

    @staticmethod
    def host_of(peer: str) -> str:
        return peer.rsplit(":", 1)[0] if ":" in peer else peer

    def allow(self, peer: str) -> bool:
        host = self.host_of(peer)
        now = self._clock()
        entry = self._hosts.get(host)
        if entry is None or now - entry[0] >= self.window:
            dropped = entry[2] if entry is not None else 0
            entry = [now, 0, dropped]
            self._hosts[host] = entry
            while len(self._hosts) > self.max_hosts:
                self._hosts.popitem(last=False)
        self._hosts.move_to_end(host)
        if entry[1] >= self.burst:
            entry[2] += 1
            return False
        entry[1] += 1
        return True

    def take_suppressed(self, peer: str) -> int:
        """Warnings dropped for ``peer``'s host since its last allowed one (and reset the count)."""
        entry = self._hosts.get(self.host_of(peer))
        if entry is None:
            return 0
        dropped, entry[2] = int(entry[2]), 0
        return dropped

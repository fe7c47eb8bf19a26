"""Wire constants of the lighthouse protocol, shared by server and client (see docs/lighthouse.md)."""

from __future__ import annotations

#: Upper bound of a quorum request's ``timeout`` field (seconds): the timeouts' own bound.
from ftlaunch.timeouts import MAX_QUORUM_TIMEOUT as MAX_QUORUM_TIMEOUT

#: Every JSON response carries ``"version": API_VERSION``; paths are served under ``/v1`` too.
API_VERSION = 1
PATH_PREFIX = "/v1"

#: Request header naming the replica group a connection belongs to. A connection that carried it
#: ties the group's liveness to the connection: when the group's last such connection is closed by
#: the peer without a `leave`, the group is marked disconnected at once.
REPLICA_HEADER = "X-Ftlaunch-Replica"

#: Request header naming the process (incarnation) a group's requests come from: a random token per
#: client. A replica id is held by one incarnation at a time; requests without it are one anonymous
#: incarnation.
INCARNATION_HEADER = "X-Ftlaunch-Incarnation"
#: Longest accepted incarnation.
MAX_INCARNATION_LEN = 64

#: Largest accepted request body; larger ones get 413 without being read.
MAX_BODY_BYTES = 1 << 20
#: Deepest nesting of arrays/objects accepted in a request body (a member's ``data`` included): far
#: above what a group publishes, far below where encoding the quorum would hit Python's recursion limit.
MAX_JSON_DEPTH = 64
#: Longest accepted replica id.
MAX_REPLICA_ID_LEN = 256
#: ``timeout`` of a quorum request that names none (seconds).
DEFAULT_QUORUM_TIMEOUT = 60.0

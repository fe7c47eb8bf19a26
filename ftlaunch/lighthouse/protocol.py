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
#: Incarnation of a request that names none (a hand-written client): one incarnation like any other.
ANONYMOUS = ""
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
#: Key of a quorum request's ``data`` carrying a resume report (the group's last quorum: id and
#: members) after the group found the lighthouse unreachable; the lighthouse consumes it
#: (`membership.Membership.adopt_resume_report`) and does not echo it in the quorum.
RESUME_KEY = "resume"
#: Most members a resume report may name (larger reports are ignored).
MAX_RESUME_MEMBERS = 100_000

def parse_resume_report(report: object) -> tuple[int, tuple[str, ...]] | None:
    """(quorum id, sorted unique member ids) from a resume report, or None if it is malformed."""
    if not isinstance(report, dict):
        return None
    quorum_id, members = report.get("quorum_id"), report.get("members")
    if isinstance(quorum_id, bool) or not isinstance(quorum_id, int) or quorum_id < 0 or quorum_id >= 1 << 63:
        return None
    if not isinstance(members, list) or not members or len(members) > MAX_RESUME_MEMBERS:
        return None
    if not all(isinstance(m, str) and 0 < len(m) <= MAX_REPLICA_ID_LEN for m in members):
        return None
    return quorum_id, tuple(sorted(set(members)))

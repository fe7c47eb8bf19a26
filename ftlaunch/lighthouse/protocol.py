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
#: (lighthouse/resume.py) and does not echo it in the quorum.
RESUME_KEY = "resume"
#: Most members a resume report may name (larger reports are ignored).
MAX_RESUME_MEMBERS = 100_000

#: Heartbeats per second a lighthouse lets all groups together send, once there are many groups: a
#: heartbeat answer advises (``"interval"``) the pace that keeps the total under it.
HEARTBEAT_BUDGET_PER_S = 1000.0
#: Below this pace (seconds) nothing is advised: a job of up to ~100 groups beats as its clients
#: chose (the Manager: every 0.1 s), so hang detection in small jobs is what it always was.
MIN_ADVISED_INTERVAL = 0.1
#: An advised pace leaves at least this many beats per heartbeat timeout (a missed beat or two is
#: never a death).
BEATS_PER_TIMEOUT = 5
#: Most a client accepts as advised pace (seconds), whatever a lighthouse says.
MAX_ADVISED_INTERVAL = 5.0

#: How long a step must have waited in a collective of its quorum before it counts as blocked
#: (seconds): from then on the group's heartbeats report it (``blocked``) and its worker prepares to
#: abort the step (worker/hang_abort.py), and the lighthouse takes that report as evidence that a
#: silent peer is hung (lighthouse/hung.py). Above a healthy step's wait on one host, far below the
#: heartbeat timeout (5 s); preparing the abort costs milliseconds (a fork of the idle Baby spare).
#: One number on both sides: a worker that reported sooner than the lighthouse listens would be
#: ignored, one that reported later would slow every hung-peer recovery down to its pace.
BLOCKED_FOR = 0.5


def advised_heartbeat_interval(groups: int, heartbeat_timeout: float) -> float | None:
    """The heartbeat pace (seconds) a lighthouse tracking ``groups`` groups advises, or None (none
    advised: up to ~100 groups).

    Why: every group beats on its own clock (0.1 s by default), so 1024 groups would send ~10,000
    heartbeats a second, more than one event-loop thread answers next to the quorum requests.
    The pace grows with the job so the total stays near `HEARTBEAT_BUDGET_PER_S`, rounded up to
    0.1 s (the answers are encoded once per pace), never past heartbeat_timeout / `BEATS_PER_TIMEOUT`.
    """
    tenths = -(
        -round(groups / HEARTBEAT_BUDGET_PER_S * 1000) // 100
    )  # up to the next 0.1 s (via ms: no float noise)
    cap = round(heartbeat_timeout / BEATS_PER_TIMEOUT * 1000) // 100  # the cap down to it
    pace = min(tenths, cap) / 10
    return pace if pace > MIN_ADVISED_INTERVAL else None


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

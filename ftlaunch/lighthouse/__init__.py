"""The lighthouse: the job's quorum server, its client, and the pure quorum decision.

Why a folder of its own: one process decides, step by step, which replica groups train together
(a quorum), and notices a dead group within milliseconds. The workers (`ftlaunch.worker`) ask it
through `client`; the launcher hosts or reaches it (`ftlaunch.launcher.lighthouse_host`). Layers
inside, bottom up (each module imports only those above it in this list; tests/test_layers.py):

- `protocol` (wire constants) and `quorum` (the decision: a pure function of state, clock, options);
- `status`: the typed status document (``GET /status``, the dashboard, the launcher);
- `membership`: the bookkeeping (groups, quorum requests, failures, evictions), raising domain
  errors, with no HTTP and no sockets; `http`: request/response types and http.server's parsing;
  `dashboard`: HTML from a status; `client`: `LighthouseClient`;
- `routes`: the endpoints (JSON in and out, the admin token, domain errors as status codes);
  `transport`: HTTP/1.1 connections on one asyncio event loop, long polls, identities;
- `server`: `LighthouseServer`, composing them; `cli`: ``ftlaunch-lighthouse``.

The wire protocol: docs/lighthouse.md.
"""

from __future__ import annotations

from ftlaunch.lighthouse.client import HeartbeatHandle, LighthouseClient
from ftlaunch.lighthouse.quorum import (
    Quorum,
    QuorumDecision,
    QuorumIdAllocator,
    QuorumMember,
    QuorumOptions,
    decide_quorum,
)
from ftlaunch.lighthouse.server import LighthouseServer
from ftlaunch.lighthouse.status import LighthouseStatus

__all__ = [
    "HeartbeatHandle",
    "LighthouseClient",
    "LighthouseServer",
    "LighthouseStatus",
    "Quorum",
    "QuorumDecision",
    "QuorumIdAllocator",
    "QuorumMember",
    "QuorumOptions",
    "decide_quorum",
]

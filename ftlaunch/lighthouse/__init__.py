"""The lighthouse: the job's quorum server, its client, and the pure quorum decision.

Why a folder of its own: one process decides, step by step, which replica groups train together
(a quorum), and notices a dead group within milliseconds. The workers (`ftlaunch.worker`) ask it
through `client`; the launcher hosts or reaches it (`ftlaunch.launcher.lighthouse_host`). Layers
inside, bottom up (each module imports only those above it in this list; tests/test_layers.py):

- `protocol` (wire constants), `quorum` (the decision: a pure function of state, clock, options),
  `slots`, `progress`;
- `status`: the typed status document (``GET /status``, the dashboard, the launcher); `spares`;
  `tickets` (a parked quorum request, the domain errors); `quorum_delta` (a quorum as the
  difference from one a member holds); `channel` (one request's travel to the lighthouse);
- `membership_spares`, `membership_status` (mixed into the membership); `http`: request/response
  types and http.server's parsing; `limits`; `dashboard`; `metrics`; `client`: `LighthouseClient`;
- `membership_resume` (mixed into the membership); `connection`: one client connection on the
  event loop; `answers`: quorum answers, whole or as deltas, each encoded once; `reconnect`;
- `membership`: the bookkeeping (groups, quorum requests, failures, evictions), raising domain
  errors, with no HTTP and no sockets; `transport`: the asyncio server (listening, the connection
  cap, identities);
- `routes`: the endpoints (JSON in and out, the token, domain errors as status codes);
- `server`: `LighthouseServer`, composing them; `cli`: ``ftlaunch-lighthouse``.

The wire protocol: docs/lighthouse.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Public name -> the module that defines it, imported on first use (PEP 562): a worker imports this
#: package for its client, and must not load the server, its event loop and the bookkeeping with it.
_EXPORTS = {
    "HeartbeatHandle": "client",
    "LighthouseClient": "client",
    "LighthouseServer": "server",
    "LighthouseStatus": "status",
    "Quorum": "quorum",
    "QuorumDecision": "quorum",
    "QuorumIdAllocator": "quorum",
    "QuorumMember": "quorum",
    "QuorumOptions": "quorum",
    "decide_quorum": "quorum",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

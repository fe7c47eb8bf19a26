"""The lighthouse: the job's quorum server, its client, and the pure quorum decision.

Why a folder of its own: one process decides, step by step, which replica groups train together
(a quorum), and notices a dead group within milliseconds. The workers (`ftlaunch.worker`) ask it
through `client`; the launcher hosts or reaches it (`ftlaunch.launcher.lighthouse_host`). Inside,
by concern (which may import which: ``LIGHTHOUSE_RANKS`` in tests/unit/test_layers.py):

- the rules, pure functions of state and the caller's clock reading: `quorum` (whether a quorum
  forms, with whom, under which id), `admission` (who may make a request), `hung` (a hung member
  declared lost on evidence), `resume` (a restarted lighthouse adopting the groups' last quorum),
  `slots` (which hot spare takes which slot); `protocol` (wire constants), `quorum_delta` (a quorum
  as the difference from one a member holds);
- the bookkeeping, with no HTTP and no sockets: `membership` holds the state's owners and applies
  the rules to them under one lock -- `roster` (the groups' records), `round` (the parked quorum
  requests and the quorum they are compared with; `tickets`: a parked request, the domain
  errors), `spares` (the slot table), `progress` (what the group leaders report); `status`: the
  typed status document;
- the server: `routes` (the endpoints: JSON, the token, domain errors as status codes), `answers`
  (quorum answers, whole or as deltas, each encoded once), `http`, `bodies`, `limits`, `transport`
  (the asyncio server) and `connection` (one client connection); `dashboard`, `metrics`; `server`:
  `LighthouseServer`, composing them; `cli`: ``ftlaunch-lighthouse``;
- the client: `client` (`LighthouseClient`), `channel` (one request's travel), `reconnect` (riding
  out a lighthouse outage).

Importing the package imports none of them: each name below loads its module on first use, so a
worker that only uses the client never loads the server. The wire protocol: docs/lighthouse.md.
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

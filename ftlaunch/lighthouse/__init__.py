"""The lighthouse: quorum server, its client, and the pure quorum decision.

See docs/lighthouse.md for the wire protocol.
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

__all__ = [
    "HeartbeatHandle",
    "LighthouseClient",
    "LighthouseServer",
    "Quorum",
    "QuorumDecision",
    "QuorumIdAllocator",
    "QuorumMember",
    "QuorumOptions",
    "decide_quorum",
]

"""What a group asks the lighthouse with each round, and when it may first ask.

Why apart from the Manager: the request (`QuorumMember`: step, store, every rank's transport
metadata, the state layout) and its retries are the group's side of the lighthouse protocol;
the Manager only decides when a round starts and what it does with the answer.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ftlaunch.errors import EvictedError, LighthouseError
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.worker.plan import LAYOUT_KEY

__all__ = ["ask_lighthouse", "member"]


def member(
    replica_id: str,
    *,
    store_address: str,
    step: int,
    world_size: int,
    shrink_only: bool,
    commit_failures: int,
    transport_metadata: list[str],
    layout: dict[str, str] | None,
) -> QuorumMember:
    """This group's quorum request (the leader's process identifies it for status pages)."""
    data: dict[str, Any] = {"ckpt": transport_metadata}
    if layout:
        data[LAYOUT_KEY] = layout
    return QuorumMember(
        replica_id=replica_id,
        address=f"{socket.gethostname()}:{os.getpid()}",
        store_address=store_address,
        step=step,
        world_size=world_size,
        shrink_only=shrink_only,
        commit_failures=commit_failures,
        data=data,
    )


def ask_lighthouse(
    client: QuorumClient, request: QuorumMember, retries: int, timeout: float, log: logging.LoggerAdapter
) -> Quorum:
    """The quorum for ``request``, retried ``retries`` times on lighthouse errors (never after an
    eviction: that one is final)."""
    attempts = retries + 1
    for attempt in range(1, attempts + 1):
        try:
            return client.quorum(request, timeout=timeout)
        except EvictedError:
            raise
        except LighthouseError as e:
            if attempt == attempts:
                raise
            log.warning("quorum attempt %d/%d failed: %s", attempt, attempts, e)
    raise AssertionError("unreachable")

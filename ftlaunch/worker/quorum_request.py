"""What a group asks the lighthouse with each round, and when it may first ask.

Why apart from the Manager: the request (`QuorumMember`: step, store, every rank's transport
metadata, the state layout) and its retries are the group's side of the lighthouse protocol;
the Manager only decides when a round starts and what it does with the answer.

When: only once the group can take part at once (`become_ready`). A quorum that counts a group
makes every member's reconfigure wait for it (the cross-group rendezvous needs all of them), so a
(re)starting group that asked while its Baby child was still importing torch stalled the
survivors for seconds. Asking later costs the joiner nothing: it could not have stepped sooner.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from ftlaunch import env
from ftlaunch.checkpointing.transport import CheckpointTransport
from ftlaunch.errors import EvictedError, LighthouseError, LighthouseUnavailableError, TrainingFinishedError
from ftlaunch.lighthouse.client import QuorumClient
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.lighthouse.reconnect import OutageTolerantClient
from ftlaunch.process_group.base import ProcessGroup
from ftlaunch.worker.group_store import GroupStore
from ftlaunch.worker.plan import CLAIM_KEY, HEAL_READY_KEY, LAYOUT_KEY, STAGED_KEY

__all__ = ["ask_lighthouse", "become_ready", "member"]


def become_ready(
    pg: ProcessGroup, group: GroupStore, transport: CheckpointTransport[Any], log: logging.LoggerAdapter
) -> None:
    """Make this rank ready to take part in a quorum at once, then say so to its group leader.

    Waits for the cross-group process group (`ProcessGroup.wait_ready`: a Baby child serving
    requests); the group store is connected and the transport's receive path (its server, or the
    process group itself) is up once those are. Then publishes this rank's transport metadata:
    the leader reads every rank's before its first request, so that read waits for the whole
    group. A process group that cannot become ready is logged and let be: its `configure` fails
    the same way and the step is not committed, as it was before this wait existed.
    """
    try:
        pg.wait_ready()
    except Exception as e:  # noqa: BLE001 - configure reports it again, as a step failure
        log.warning("process group not ready (%s: %s); asking for a quorum anyway", type(e).__name__, e)
    group.publish_transport_metadata(transport.metadata())


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
    claims: list[str] | None = None,
    staged: bool = False,
    heal_ready: bool = False,
) -> QuorumMember:
    """This group's quorum request (the leader's process identifies it for status pages).
    ``staged``: every rank holds a snapshot of its state at ``step`` to serve (`plan.STAGED_KEY`);
    ``heal_ready``: behind, it could heal in this step (`plan.HEAL_READY_KEY`);
    ``claims``: every rank's checksum of it (`plan.CLAIM_KEY`); ``[]`` claims on demand
    (`plan.claims_wanted`); None makes no claim."""
    data: dict[str, Any] = {"ckpt": transport_metadata}
    if layout:
        data[LAYOUT_KEY] = layout
    if staged:
        data[STAGED_KEY] = True
    if heal_ready:
        data[HEAL_READY_KEY] = True
    if claims is not None:
        data[CLAIM_KEY] = claims
    return QuorumMember(
        replica_id=replica_id,
        address=f"{env.local_addr() or socket.gethostname()}:{os.getpid()}",
        store_address=store_address,
        step=step,
        world_size=world_size,
        shrink_only=shrink_only,
        commit_failures=commit_failures,
        data=data,
    )


def ask_lighthouse(
    client: QuorumClient,
    request: QuorumMember,
    retries: int,
    timeout: float,
    log: logging.LoggerAdapter,
    *,
    give_up_after: float | None = None,
    final: tuple[type[Exception], ...] = (),
) -> Quorum:
    """The quorum for ``request``, retried ``retries`` times on lighthouse errors (never after an
    eviction, nor after the training finished ahead of the group: those are final, as are
    ``final``). ``give_up_after`` goes to an `OutageTolerantClient` (worker/outage.py); its
    `LighthouseUnavailableError` is then final too."""
    attempts = retries + 1
    if give_up_after is not None:
        final = (*final, LighthouseUnavailableError)
    for attempt in range(1, attempts + 1):
        try:
            if give_up_after is not None and isinstance(client, OutageTolerantClient):
                return client.quorum(request, timeout, give_up_after=give_up_after)
            return client.quorum(request, timeout=timeout)
        except (EvictedError, TrainingFinishedError):
            raise
        except final:
            raise
        except LighthouseError as e:
            if attempt == attempts:
                raise
            log.warning("quorum attempt %d/%d failed: %s", attempt, attempts, e)
    raise AssertionError("unreachable")

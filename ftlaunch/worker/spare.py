"""A group's wait for a replica-group slot in a job with hot spares (``ftlaunch --spares K``).

With spares, ``ftlaunch.init`` builds everything that does not depend on *which* replica group this
is -- imports, the group's own process group, the cross-group process group with its Baby child up,
the state transport -- and then claims a slot here (``POST /claim``, a long poll). A group started
for slot ``g`` gets it at once; a spare waits until an active group fails, then gets the failed
group's slot, so its data shard and sampler position (the position heals from a peer with the
weights). Only then is the Manager built, under the lighthouse name the claim returned (``rg1``,
or ``rg1.1`` for the slot's next holder: the old name is fenced, so a holder that wakes from a hang
is refused and restarts as a spare).

Every rank of the group claims under one name (``g<group>.<restart>``, e.g. ``g2.0``: the same for
all its ranks, new for every restart of the group), so all ranks get the same slot without talking to each
other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from ftlaunch import env
from ftlaunch.errors import LighthouseUnavailableError
from ftlaunch.lighthouse.client import ClaimGrant, LighthouseClient

log = logging.getLogger(__name__)

#: How long one claim poll waits before it is repeated (the spare stays registered throughout).
CLAIM_POLL_S = 30.0


@dataclass(frozen=True)
class Slot:
    """The slot a group trains in: its replica-group id (data shard) and lighthouse name."""

    replica_group_id: int
    replica_id: str
    #: The lighthouse name of the holder this group replaced (None: the slot's first holder).
    replaced: str | None
    #: Seconds the group waited for it.
    waited: float


class JobFinished(Exception):
    """Every slot's training finished while this group waited as a spare: nothing left to do."""


def claimant_name(job: env.JobEnv, group: env.GroupEnv) -> str:
    """One name for all ranks of this incarnation of the group (its restarts get new ones)."""
    return f"g{job.replica_group_id}.{group.incarnation}"


def claim_slot(job: env.JobEnv, group: env.GroupEnv, connect_timeout: float, outage_timeout: float) -> Slot:
    """Block until the lighthouse gives this group a slot. Raises `JobFinished` when the job ended
    first, `LighthouseError` on a refusal or an unreachable lighthouse (after ``outage_timeout``
    seconds, `env.WorkerEnv.lighthouse_outage`, when the job reached it before)."""
    name = claimant_name(job, group)
    preferred = None if job.starts_as_spare else job.replica_group_id
    start = time.monotonic()
    if job.starts_as_spare or group.incarnation:
        log.info("[%s] waiting for a replica-group slot (hot spare)", name)
    # A group of a job that reached its lighthouse (restarted by torchelastic, or its agent by the
    # supervisor) rides out an outage here as a running group's Manager does (lighthouse/reconnect.py).
    outage = outage_timeout if job.lighthouse_reached or group.incarnation else 0.0
    with LighthouseClient(job.lighthouse, connect_timeout=connect_timeout, token=job.token) as client:
        grant = _claim(client, name, job.num_replica_groups, preferred, outage)
    waited = time.monotonic() - start
    if grant is None:
        raise JobFinished(f"the job finished while {name} waited as a spare ({waited:.1f}s)")
    if grant.replaced is not None:  # a spare promoted, or a restarted group back in its free slot
        log.warning(
            "[%s] took over replica group %d after %.2fs waiting (as %s, replacing %s)",
            name, grant.slot, waited, grant.replica_id, grant.replaced,
        )  # fmt: skip
    return Slot(grant.slot, grant.replica_id, grant.replaced, waited)


def _claim(
    client: LighthouseClient, name: str, slots: int, preferred: int | None, outage: float
) -> ClaimGrant | None:
    """``client.claim``, repeated while the lighthouse is unreachable for up to ``outage`` seconds."""
    down_since: float | None = None
    while True:
        try:
            return client.claim(name, slots=slots, preferred=preferred, poll=CLAIM_POLL_S)
        except LighthouseUnavailableError as e:
            now = time.monotonic()
            if down_since is None:
                down_since = now
                if outage > 0:
                    log.warning("[%s] %s; waiting up to %gs for the lighthouse to come back", name, e, outage)
            if now - down_since >= outage:
                raise
            time.sleep(min(1.0, outage - (now - down_since)))


def job_for_slot(job: env.JobEnv, slot: Slot) -> env.JobEnv:
    """The job as seen from the claimed slot; also published in ``REPLICA_GROUP_ID`` for scripts
    that read it themselves (torchft-style data sharding)."""
    env.publish({env.REPLICA_GROUP_ID: str(slot.replica_group_id)})
    return replace(job, replica_group_id=slot.replica_group_id)

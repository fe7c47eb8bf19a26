"""The replica group's own store: how one quorum and one commit decision reach every rank of a group.

Only the group leader (group rank 0) talks to the lighthouse. It relays each step's quorum (or the
reason it got none) to the other ranks through the group's store, and every rank posts its commit
vote there, so the ranks of a group always act on the same quorum and commit together.

Keys live under a per-attempt prefix, ``/ftlaunch/<replica_id>/attempt_<incarnation>``: a store
may outlive a restart of the group's workers (torchelastic keeps its own across restarts), and a
restarted group must never read its previous incarnation's quorum or votes. The incarnation must be
the same on every rank (`env.GroupEnv.incarnation`, counted by the rendezvous), or the ranks of a
multi-node group would wait for each other under different prefixes for ever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ftlaunch.addresses import format_host_port
from ftlaunch.errors import (
    CommunicationError,
    ConfigurationError,
    EvictedError,
    LighthouseError,
    QuorumTimeoutError,
    TrainingFinishedError,
)
from ftlaunch.lighthouse.quorum import Quorum
from ftlaunch.timeouts import Timeouts

#: Keys of steps older than this many quorum rounds are deleted (a slow rank may still read the last one).
_KEEP_ROUNDS = 2
#: Leader errors the other ranks re-raise as their own type (any other: `LighthouseError`).
_RELAYED_ERRORS: dict[str, type[LighthouseError]] = {
    "EvictedError": EvictedError,
    "QuorumTimeoutError": QuorumTimeoutError,
    "TrainingFinishedError": TrainingFinishedError,
}


def _connect(
    store_addr: str | None,
    store_port: int | None,
    *,
    world_size: int,
    hostname: str | None,
    connect_timeout: float,
    timeout: float,
) -> tuple[dist.Store, str]:
    """The group's store and the ``host:port`` other groups reach it on.

    torchelastic's store (or the caller's) when an address is given; otherwise, for a group of
    one worker, a private store on ``hostname`` (its address is still published: another group
    may rendezvous on it for the cross-group process group). Raises `ConfigurationError` when a
    larger group has no address and `CommunicationError` when the store cannot be reached.
    """
    if store_addr is None or store_port is None:
        if world_size != 1:
            raise ConfigurationError(
                "a replica group with more than one worker needs its store: set MASTER_ADDR and "
                "MASTER_PORT (torchrun/ftlaunch do) or pass store_addr/store_port"
            )
        host = hostname or "127.0.0.1"  # the Manager passes the address other hosts reach
        store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )
        return store, format_host_port(host, store.port)
    try:
        store = dist.TCPStore(
            store_addr,
            store_port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=connect_timeout),
        )
    except Exception as e:  # noqa: BLE001 - torch raises several types here
        raise CommunicationError(
            f"cannot connect to the replica group's store at {format_host_port(store_addr, store_port)}: {e}"
        ) from e
    return store, format_host_port(store_addr, store_port)


def _address_of(store: dist.Store, store_addr: str | None, store_port: int | None) -> str:
    """``host:port`` of a store the caller built: the given address, else a TCPStore's own."""
    if store_addr is not None and store_port is not None:
        return format_host_port(store_addr, store_port)
    if isinstance(store, dist.TCPStore):
        return format_host_port(store.host, store.port)
    raise ValueError(
        f"group_store is a {type(store).__name__}: pass store_addr= and store_port= (where other "
        "groups reach it for the cross-group rendezvous)"
    )


class GroupStore:
    """One incarnation's view of the replica group's store: quorum relay, votes, transport metadata.

    ``timeout`` bounds every wait on a peer rank (a non-leader waits for the leader's quorum call
    here, so it must cover the quorum timeout plus the leader's connect retries).
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        address: str,
        replica_id: str,
        attempt: int,
        rank: int,
        world_size: int,
        timeout: float,
    ) -> None:
        #: ``host:port`` other groups reach the store on (published in the quorum).
        self.address = address
        self._live: dist.Store | None = dist.PrefixStore(f"/ftlaunch/{replica_id}/attempt_{attempt}", store)
        self._timeout = timedelta(seconds=timeout)
        self._store.set_timeout(self._timeout)
        self._rank = rank
        self._world_size = world_size

    @classmethod
    def open(
        cls,
        store: dist.Store | None,
        store_addr: str | None,
        store_port: int | None,
        *,
        replica_id: str,
        attempt: int,
        rank: int,
        world_size: int,
        hostname: str | None,
        timeouts: Timeouts,
        leader_outage: float = 0.0,
    ) -> GroupStore:
        """The given ``store``, or a connection to the one at ``store_addr:store_port`` (a private
        one for a group of one worker without an address); see `_connect` for what raises.
        ``leader_outage``: how long the leader waits out an unreachable lighthouse
        (`ftlaunch.lighthouse.reconnect`); the other ranks wait that much longer for its answer."""
        if store is None:
            store, address = _connect(
                store_addr,
                store_port,
                world_size=world_size,
                hostname=hostname,
                connect_timeout=timeouts.connect,
                timeout=timeouts.collective,
            )
        else:
            address = _address_of(store, store_addr, store_port)
        # A non-leader waits here for the leader's quorum call (the quorum, its connect retries and
        # a lighthouse outage it waits out).
        timeout = max(timeouts.quorum + timeouts.connect + leader_outage, timeouts.collective)
        return cls(
            store, address=address, replica_id=replica_id, attempt=attempt, rank=rank, world_size=world_size,
            timeout=timeout,
        )  # fmt: skip

    @property
    def _store(self) -> dist.Store:
        if self._live is None:
            raise CommunicationError(
                "the replica group's store connection was closed (the Manager shut down)"
            )
        return self._live

    def close(self) -> None:
        """Drop this incarnation's connection to the group's store: its socket (and, for a private
        store, its server) closes with the last reference. Later calls raise. Idempotent."""
        self._live = None

    # ---- a quorum the leader learned was lost (worker/hang_abort.py): the other ranks abort too ----
    def tell_lost(self, quorum_id: int) -> None:
        """The leader: the lighthouse said quorum ``quorum_id`` lost a participant."""
        self._store.set(f"lost/{quorum_id}", b"1")  # type: ignore[arg-type]

    def was_lost(self, quorum_id: int) -> bool:
        """Whether the leader said so (one store round trip; asked only while a wait lasts)."""
        return bool(self._store.check([f"lost/{quorum_id}"]))

    # ---- checkpoint-transport metadata: each rank's, collected by the leader for the quorum ----
    def publish_transport_metadata(self, metadata: str) -> None:
        self._store.set(f"ckpt_meta/{self._rank}", metadata)

    def transport_metadata(self) -> list[str]:
        """Every rank's transport metadata, in rank order (blocks until all ranks published)."""
        return [self._store.get(f"ckpt_meta/{r}").decode() for r in range(self._world_size)]

    # ---- heal claims: each rank's, collected by the leader for each quorum request -------------
    def publish_claim(self, seq: int, claim: str | None) -> None:
        """This rank's claim for round ``seq`` (`worker.recovery.state_claim`); ranks > 0 only."""
        self._store.set(f"claim/{seq}/{self._rank}", claim or "")

    def claims(self, seq: int, own: str | None, timeout: float) -> list[str] | None:
        """The leader's list of every rank's claim for round ``seq`` (``own`` is rank 0's), or None
        when a rank has none or does not post it within ``timeout`` seconds (a rank that hangs is
        the commit vote's business; the request goes out without a claim)."""
        if own is None:
            return None
        if self._world_size == 1:
            return [own]
        keys = [f"claim/{seq}/{r}" for r in range(1, self._world_size)]
        try:
            self._store.set_timeout(timedelta(seconds=max(timeout, 1e-3)))
            try:
                got = [v.decode() for v in self._store.multi_get(keys)]
            finally:
                self._store.set_timeout(self._timeout)
            if seq > _KEEP_ROUNDS:
                for r in range(1, self._world_size):
                    self._store.delete_key(f"claim/{seq - _KEEP_ROUNDS}/{r}")
        except Exception:  # noqa: BLE001 - torch raises several types here; no claim this round
            return None
        return None if "" in got else [own, *got]

    # ---- the quorum relay ----------------------------------------------------------------------
    def relay_quorum(self, seq: int, ask: Callable[[], Quorum]) -> Quorum:
        """Round ``seq``'s quorum, the same on every rank of the group.

        The leader calls ``ask()`` (the lighthouse) and hands the answer, or the error it raised,
        to the other ranks, which read it here. So a leader failure is raised on every rank (as
        `EvictedError` or `LighthouseError`) instead of leaving them waiting.
        """
        if self._rank != 0:
            payload = json.loads(self._store.get(f"quorum/{seq}"))
            if "error" in payload:
                # The leader's error type, where the other ranks act on it: evicted (stop), or
                # no quorum in time (peers still busy: a periodic sync asks again).
                cls = _RELAYED_ERRORS.get(payload.get("type", ""), LighthouseError)
                raise cls(f"the group leader could not get a quorum: {payload['error']}")
            return Quorum.from_json(payload)
        try:
            quorum = ask()
        except Exception as e:
            self._publish(seq, {"error": str(e), "type": type(e).__name__})
            raise
        self._publish(seq, quorum.to_json())
        return quorum

    def _publish(self, seq: int, payload: dict) -> None:
        if self._world_size == 1:
            return
        self._store.set(f"quorum/{seq}", json.dumps(payload))
        if seq > _KEEP_ROUNDS:
            self._store.delete_key(f"quorum/{seq - _KEEP_ROUNDS}")

    # ---- the commit vote inside the group --------------------------------------------------------
    def vote(self, seq: int, ok: bool, deadline: float, topic: str = "commit") -> bool:
        """Post this rank's vote for round ``seq`` and return whether every rank voted yes.
        ``topic`` names what is voted on (the commit; ``"heal"``: every rank received its state).

        Waits until ``deadline`` (monotonic) at most; raises `CommunicationError` when a rank's
        vote does not arrive (it died: its agent restarts the group).
        """
        # Store.set takes bytes too (pybind std::string); torch's stub says str only.
        self._store.set(f"{topic}/{seq}/{self._rank}", b"1" if ok else b"0")  # type: ignore[arg-type]
        keys = [f"{topic}/{seq}/{r}" for r in range(self._world_size)]
        try:
            # set_timeout is local to this client: bounding the wait by the deadline costs no
            # extra round trip on the per-step path (a store.wait() before the get would).
            self._store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            try:
                votes = self._store.multi_get(keys)
            finally:
                self._store.set_timeout(self._timeout)
            if self._rank == 0 and seq > _KEEP_ROUNDS:
                for r in range(self._world_size):
                    self._store.delete_key(f"{topic}/{seq - _KEEP_ROUNDS}/{r}")
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise CommunicationError(f"{topic} vote inside the group failed: {e}") from e
        return all(v == b"1" for v in votes)

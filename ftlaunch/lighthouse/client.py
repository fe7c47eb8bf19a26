"""Client of the lighthouse protocol.

Each thread reuses its own keep-alive connection (http.client connections are not thread-safe),
so a step's quorum request costs one round trip, not a TCP handshake. Connection failures are
retried with exponential backoff for at most ``connect_timeout`` seconds, then surface as
`LighthouseUnavailableError`; every socket operation has a timeout, so a lost or hung lighthouse
never hangs the caller.

`start_heartbeat` runs a daemon thread with a dedicated persistent connection carrying the
replica header: the server ties the group's liveness to it, so a killed process is noticed the
moment the kernel closes that socket. Only that connection carries the header: per-thread
connections come and go with their threads, which says nothing about the process.

One request's travel is `channel.Channel`'s. A quorum answer may be a delta from the quorum this
client holds (`quorum_delta`); `quorum` always returns the whole `Quorum`.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ftlaunch.addresses import http_url, parse_host_port
from ftlaunch.errors import EvictedError, LighthouseError
from ftlaunch.lighthouse.channel import Channel, raise_for
from ftlaunch.lighthouse.health import HealthReport
from ftlaunch.lighthouse.progress import ProgressReport
from ftlaunch.lighthouse.protocol import MAX_ADVISED_INTERVAL, PATH_PREFIX
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember
from ftlaunch.lighthouse.quorum_delta import apply_delta
from ftlaunch.lighthouse.spares import ClaimGrant
from ftlaunch.lighthouse.status import LighthouseStatus

log = logging.getLogger(__name__)

#: Extra time a long poll waits for the server's own answer (200 or 408) before calling it lost.
LONG_POLL_GRACE = 5.0


class HeartbeatHandle:
    """A running heartbeat thread.

    Its connection outlives `stop()` on purpose: closing it would tell the lighthouse the process
    died. It is closed by `LighthouseClient.leave` (after the leave) or `LighthouseClient.close`.
    """

    def __init__(self, client: LighthouseClient, replica_id: str, interval: float) -> None:
        self.replica_id = replica_id
        self.interval = interval
        #: The pace the lighthouse advised in its last answer (0: none; a large job's lighthouse
        #: asks for slower beats, `protocol.advised_heartbeat_interval`). The slower of the two is kept.
        self.advised = 0.0
        self._client = client
        self._channel = client._new_channel()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"ftlaunch-heartbeat-{replica_id}", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                answer = self._client._heartbeat(self._channel, self.replica_id, bind=True, stop=self._stop)
                if answer.get("kill"):
                    _kill_self(self.replica_id, str(answer["kill"]))
                if answer.get("lost") or answer.get("superseded") is not None:
                    self._client._tell_lost(self.replica_id, answer)
                if failing:
                    log.info(
                        "lighthouse client: heartbeat of %s reaches the lighthouse again", self.replica_id
                    )
                failing = False
                self.advised = _advised_pace(answer.get("interval"))
            except EvictedError as e:
                log.warning("lighthouse client: %s; heartbeat stopped", e)
                self._client._note_evicted(self.replica_id, told=False)
                return
            except LighthouseError as e:
                if self._stop.is_set():
                    return
                if not failing:  # log once per outage, not once per beat
                    log.warning(
                        "lighthouse client: heartbeat of %s failed: %s (retrying)", self.replica_id, e
                    )
                failing = True
            self._stop.wait(max(self.interval, self.advised))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating: the group turns silent after heartbeat_timeout unless it `leave`s."""
        self._stop.set()
        if threading.current_thread() is self._thread:
            return
        self._thread.join(min(timeout, 1.0))
        if self._thread.is_alive():  # stuck on a hung lighthouse: cut the request short
            self._channel.abort()
            self._thread.join(timeout)


def _advised_pace(value: object) -> float:
    """A heartbeat answer's ``interval`` (seconds), bounded by `MAX_ADVISED_INTERVAL`; 0 when absent
    or not a number (an older lighthouse advises nothing: the client's own interval applies)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        return 0.0
    return min(float(value), MAX_ADVISED_INTERVAL)


def _kill_self(replica_id: str, reason: str) -> None:
    """The lighthouse's admin asked this group to die (the dashboard's Kill button): die as a crash
    would, so the group's agent restarts it and its peers go on without it."""
    log.error("lighthouse client: %s killed on the lighthouse's request: %s", replica_id, reason)
    for handler in log.handlers + logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class QuorumClient(Protocol):
    """What a replica group's leader needs from the lighthouse; `LighthouseClient` is the real one.

    The Manager is written against this, so its step protocol can be driven by a scripted fake.
    """

    def quorum(self, member: QuorumMember, timeout: float) -> Quorum:
        """Block until a quorum containing ``member`` forms (at most ``timeout`` seconds) and return it.

        Raises `QuorumTimeoutError` when none formed in time, `EvictedError` when the group was
        evicted, `LighthouseUnavailableError` when the lighthouse cannot be reached, and
        `LighthouseError` for any other refusal.
        """
        ...

    def start_heartbeat(self, replica_id: str, interval: float) -> object:
        """Tell the lighthouse every ``interval`` seconds, from a background thread, that the group
        lives, until `leave` or `close`. Returns a handle the caller may ignore."""
        ...

    def leave(self, replica_id: str) -> None:
        """Graceful exit: stop the group's heartbeats and stop counting it. Raises `LighthouseError`
        when the lighthouse cannot be told (it then notices the group's silence instead)."""
        ...

    def close(self) -> None:
        """Release every connection and thread; raises nothing."""
        ...


class LighthouseClient:
    """Thread-safe client; see docs/lighthouse.md for the protocol."""

    def __init__(self, addr: str, *, connect_timeout: float = 10.0, token: str | None = None) -> None:
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0, got {connect_timeout}")
        self._host, self._port = parse_host_port(addr)
        self.address = http_url(self._host, self._port)
        self._connect_timeout = float(connect_timeout)
        self._token = token or None
        #: This client's incarnation: a replica id is held by one at a time (docs/security.md).
        self.incarnation = secrets.token_hex(8)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._channels: weakref.WeakSet[Channel] = weakref.WeakSet()
        self._heartbeats: list[HeartbeatHandle] = []
        self._evicted: set[str] = set()
        # replica id -> (latest progress report, whether it was sent): see set_progress.
        self._progress: dict[str, tuple[ProgressReport, bool]] = {}
        #: Connections that failed (refused, reset, closed mid-request) on any of this client's
        #: channels, heartbeats included: `reconnect.OutageTolerantClient` reads it to learn that
        #: the lighthouse may have restarted (and forgotten the job) since the last quorum.
        self.connection_failures = 0
        #: Whether the lighthouse ever answered this client (so an unreachable one is an outage,
        #: not a wrong address).
        self.answered = False
        #: The newest quorum answer received, by its revision: sent as ``known`` so that the next
        #: answer can be a delta from it (lighthouse/quorum_delta.py). None until a lighthouse that
        #: names revisions answered, and after one refused the field (an older lighthouse).
        self._held: tuple[str, Quorum] | None = None
        self._deltas_refused = False
        #: Told when a heartbeat answer says a participant of the caller's quorum was lost.
        self._on_lost: Callable[[str, int, tuple[str, ...]], None] | None = None
        #: Asked at every heartbeat: (quorum id, seconds) its step waits in a collective (`report_blocked`).
        self._blocked: Callable[[], tuple[int, float] | None] | None = None
        #: Asked at every heartbeat: the resume report, if due (`report_resume`).
        self._resume: Callable[[], dict | None] | None = None
        self._resume_told: tuple[object, int] | None = None  # (its quorum id, failures) last delivered
        #: Optional heartbeat fields a lighthouse refused (one older than the field): sent no more.
        self._refused: set[str] = set()

    def report_blocked(self, probe: Callable[[], tuple[int, float] | None] | None) -> None:
        """Call ``probe()`` (on the heartbeat thread; it must not block) at every heartbeat; while it
        returns (quorum id, seconds) -- the caller's step has waited that long in a collective of
        that quorum -- the heartbeat says so (``blocked``): the lighthouse then declares a member of
        that quorum whose heartbeats stopped lost sooner (lighthouse/hung.py)."""
        self._blocked = probe

    def report_resume(self, probe: Callable[[], dict | None] | None) -> None:
        """Call ``probe()`` (heartbeat thread; must not block) at every heartbeat; the resume report
        it returns (`reconnect.OutageTolerantClient`) rides on heartbeats until one delivered it, and
        again after each connection failure: a restarted lighthouse adopts it even from a group
        blocked in a step with a stopped peer, which then can be declared hung (lighthouse/hung.py)."""
        self._resume = probe

    def on_quorum_lost(self, callback: Callable[[str, int, tuple[str, ...]], None] | None) -> None:
        """Call ``callback(replica_id, quorum_id, lost_replica_ids)`` (on a heartbeat thread; it
        must not block) whenever a heartbeat answer says that participants of the caller's quorum
        ``quorum_id`` are no longer live -- or, with no ids, that ``quorum_id`` is the current
        quorum and the caller is not in it (docs/lighthouse.md, ``POST /heartbeat``)."""
        self._on_lost = callback

    def _tell_lost(self, replica_id: str, answer: dict) -> None:
        callback = self._on_lost
        if callback is None:
            return
        lost, superseded = answer.get("lost"), answer.get("superseded")
        news: tuple[object, object] = (superseded, [])
        if isinstance(lost, dict):
            news = (lost.get("quorum_id"), lost.get("replica_ids"))
        quorum_id, ids = news
        if isinstance(quorum_id, int) and not isinstance(quorum_id, bool) and isinstance(ids, list):
            try:
                callback(replica_id, quorum_id, tuple(str(i) for i in ids))
            except Exception:  # noqa: BLE001 - the heartbeat must go on
                log.exception("lighthouse client: the quorum-lost callback failed")

    def _note_connection(self, ok: bool) -> None:
        if ok:
            self.answered = True
            return
        with self._lock:
            self.connection_failures += 1

    def __repr__(self) -> str:
        return f"LighthouseClient({self.address!r})"

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections

    def _new_channel(self) -> Channel:
        channel = Channel(
            self._host,
            self._port,
            self._connect_timeout,
            self._token,
            self.incarnation,
            self._note_connection,
        )
        with self._lock:
            self._channels.add(channel)
        return channel

    def _channel(self) -> Channel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = self._local.channel = self._new_channel()
        return channel

    def _call(self, path: str, payload: dict | None, what: str, **kwargs: Any) -> dict:
        method = "GET" if payload is None else "POST"
        kwargs.setdefault("read_timeout", self._connect_timeout)
        status, obj = self._channel().call(method, PATH_PREFIX + path, payload, **kwargs)
        raise_for(status, obj, what)
        return obj

    # -- eviction bookkeeping: the server says 410 once; whoever hears it tells the others

    def _note_evicted(self, replica_id: str, *, told: bool) -> None:
        with self._lock:
            if not told:
                self._evicted.add(replica_id)  # the next quorum() raises EvictedError
            beats = [h for h in self._heartbeats if h.replica_id == replica_id]
        for h in beats:
            h._stop.set()  # they exit on their own and close their connections

    def _check_evicted(self, replica_id: str) -> None:
        with self._lock:
            if replica_id in self._evicted:
                self._evicted.discard(replica_id)
                raise EvictedError(
                    f"replica {replica_id} was evicted by the lighthouse (noticed by its heartbeat)"
                )

    # -- API

    def quorum(
        self, member: QuorumMember, timeout: float, *, unreachable_after: float | None = None
    ) -> Quorum:
        """Block until a quorum containing ``member`` forms (long poll) and return it.
        ``unreachable_after``: retry failed connections for that long instead of the connect timeout."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._check_evicted(member.replica_id)
        body: dict[str, Any] = {"member": member.to_json(), "timeout": timeout}
        progress = self._unsent_progress(member.replica_id)
        if progress is not None:
            body["progress"] = progress
        with self._lock:
            held = None if self._deltas_refused else self._held
        if held is not None:
            body["known"] = held[0]
        what = f"quorum request of {member.replica_id}"
        read_timeout = timeout + min(self._connect_timeout, LONG_POLL_GRACE)
        try:
            status, obj = self._channel().call(
                "POST",
                PATH_PREFIX + "/quorum",
                body,
                read_timeout=read_timeout,
                connect_timeout=unreachable_after,
            )
            if status == 400 and held is not None and "'known'" in str(obj.get("error", "")):
                # A lighthouse older than answer deltas (restarted from an older install): ask as before.
                log.info(
                    "lighthouse client: the lighthouse does not know quorum deltas; asking for whole quorums"
                )
                with self._lock:
                    self._deltas_refused = True
                del body["known"]
                held = None
                status, obj = self._channel().call(
                    "POST",
                    PATH_PREFIX + "/quorum",
                    body,
                    read_timeout=read_timeout,
                    connect_timeout=unreachable_after,
                )
            raise_for(status, obj, what)
        except EvictedError:
            self._note_evicted(member.replica_id, told=True)
            raise
        return self._take_quorum(obj, held)

    def _take_quorum(self, answer: dict, held: tuple[str, Quorum] | None) -> Quorum:
        """The whole quorum of a 200 answer (rebuilt from ``held`` when it is a delta); remembers it
        by the answer's revision for the next request."""
        try:
            delta = answer.get("delta")
            if delta is None:
                quorum = Quorum.from_json(answer.get("quorum"))
            elif held is None or not isinstance(delta, dict) or delta.get("base") != held[0]:
                raise ValueError("a delta from a quorum this client did not name")
            else:
                quorum = apply_delta(held[1], delta)
        except (TypeError, ValueError) as e:
            raise LighthouseError(f"lighthouse sent a malformed quorum: {e}") from None
        revision = answer.get("revision")
        if isinstance(revision, str):
            with self._lock:
                self._held = (revision, quorum)
        return quorum

    def _heartbeat(
        self, channel: Channel, replica_id: str, *, bind: bool = False, stop: threading.Event | None = None
    ) -> dict:
        body: dict[str, Any] = {"replica_id": replica_id}
        progress = self._unsent_progress(replica_id)
        if progress is not None:
            body["progress"] = progress
        blocked = self._probe("blocked", self._blocked)
        if blocked is not None:
            body["blocked"] = {"quorum_id": blocked[0], "seconds": round(blocked[1], 3)}
        failures, resume = self.connection_failures, self._probe("resume", self._resume)
        if resume is not None and self._resume_told != (resume.get("quorum_id"), failures):
            body["resume"] = resume
        status, obj = channel.call(
            "POST",
            PATH_PREFIX + "/heartbeat",
            body,
            bind_replica=replica_id if bind else None,
            read_timeout=self._connect_timeout,
            stop=stop,
        )
        for field in ("blocked", "resume"):
            if status == 400 and field in body and f"'{field}'" in str(obj.get("error", "")):
                self._refused.add(field)  # a lighthouse older than the field: beat without it
                del body[field]
                status, obj = channel.call(
                    "POST",
                    PATH_PREFIX + "/heartbeat",
                    body,
                    bind_replica=replica_id if bind else None,
                    read_timeout=self._connect_timeout,
                    stop=stop,
                )
        raise_for(status, obj, f"heartbeat of {replica_id}")
        if "resume" in body:
            self._resume_told = (body["resume"].get("quorum_id"), failures)
        return obj

    def _probe(self, field: str, probe: Callable[[], Any] | None) -> Any:
        """What ``probe`` says for the heartbeat's optional ``field``; None when there is none, the
        lighthouse refused the field, or the probe failed."""
        if probe is None or field in self._refused:
            return None
        try:
            return probe()
        except Exception:  # noqa: BLE001 - the heartbeat must go on
            log.exception("lighthouse client: the %s probe failed", field)
            return None

    def heartbeat(self, replica_id: str) -> None:
        try:
            answer = self._heartbeat(self._channel(), replica_id)
        except EvictedError:
            self._note_evicted(replica_id, told=True)
            raise
        if answer.get("kill"):
            _kill_self(replica_id, str(answer["kill"]))

    def leave(self, replica_id: str) -> None:
        """Graceful exit: the lighthouse stops counting this group (no failure is recorded).

        Also stops this client's heartbeats for the group, closing their connections only after
        the leave went through (closing first would look like the process died).
        """
        with self._lock:
            beats = [h for h in self._heartbeats if h.replica_id == replica_id]
            self._heartbeats = [h for h in self._heartbeats if h.replica_id != replica_id]
        for h in beats:
            h.stop()
        body: dict[str, Any] = {"replica_id": replica_id}
        with self._lock:
            final = self._progress.pop(replica_id, None)
        if final is not None:
            body["progress"] = final[0].to_json()  # the final report goes with the leave, sent or not
        try:
            self._call("/leave", body, f"leave of {replica_id}")
        finally:
            for h in beats:
                h._channel.close()

    # -- progress (lighthouse/progress.py)

    def set_progress(self, replica_id: str, report: ProgressReport) -> None:
        """Make ``report`` the group's latest progress: it rides on the next quorum request or
        heartbeat (whichever goes first, once) and on the leave. Never blocks on the network."""
        with self._lock:
            self._progress[replica_id] = (report, False)

    def report_progress(self, replica_id: str, report: ProgressReport) -> None:
        """Send ``report`` now, with a heartbeat (for scripts without a Manager)."""
        self.set_progress(replica_id, report)
        self.heartbeat(replica_id)

    def _unsent_progress(self, replica_id: str) -> dict | None:
        with self._lock:
            entry = self._progress.get(replica_id)
            if entry is None or entry[1]:
                return None
            self._progress[replica_id] = (entry[0], True)
        return entry[0].to_json()

    def status(self) -> dict:
        """The ``GET /status`` document as JSON (see `snapshot` for it typed)."""
        return self._call("/status", None, "status")

    def snapshot(self) -> LighthouseStatus:
        """The lighthouse's status, typed. Raises `LighthouseError` if it cannot be read or is not one."""
        try:
            return LighthouseStatus.from_json(self.status())
        except (TypeError, ValueError) as e:
            raise LighthouseError(f"lighthouse {self.address} sent a malformed status: {e}") from None

    def report_failure(self, replica_id: str, reason: str = "") -> None:
        self._call(
            "/admin/report_failure",
            {"replica_id": replica_id, "reason": reason},
            f"report_failure of {replica_id}",
        )

    def report_health(self, replica_id: str, report: HealthReport) -> None:
        """Tell the lighthouse how the group's health check went (its agent, before the workers)."""
        self._call(
            "/health", {"replica_id": replica_id, **report.to_json()}, f"health report of {replica_id}"
        )

    def kill(self, replica_id: str, reason: str = "") -> None:
        """Ask the group's leader to kill its process at its next heartbeat (admin)."""
        self._call("/admin/kill", {"replica_id": replica_id, "reason": reason}, f"kill of {replica_id}")

    def evict(self, replica_id: str, reason: str = "") -> None:
        self._call("/admin/evict", {"replica_id": replica_id, "reason": reason}, f"evict of {replica_id}")

    def claim(
        self, claimant: str, *, slots: int, preferred: int | None, poll: float = 30.0
    ) -> ClaimGrant | None:
        """Wait (as a hot spare, maybe for hours) until the lighthouse gives ``claimant`` one of the
        job's ``slots`` replica-group slots; None when every slot's training finished first.

        Long polls of ``poll`` seconds, repeated: the parked request is what keeps the spare
        registered (its connection closing withdraws it). Raises `LighthouseError` on a refusal,
        `LighthouseUnavailableError` when the lighthouse cannot be reached.
        """
        if poll <= 0:
            raise ValueError(f"poll must be > 0, got {poll}")
        payload = {"claimant": claimant, "slots": slots, "preferred": preferred, "timeout": poll}
        while True:
            obj = self._call(
                "/claim", payload, f"claim of {claimant}",
                read_timeout=poll + min(self._connect_timeout, LONG_POLL_GRACE),
            )  # fmt: skip
            slot, rid = obj.get("slot"), obj.get("replica_id")
            if isinstance(slot, int) and isinstance(rid, str):
                replaced = obj.get("replaced")
                return ClaimGrant(slot, rid, replaced if isinstance(replaced, str) else None)
            if obj.get("done") is True:
                return None

    def start_heartbeat(self, replica_id: str, interval: float) -> HeartbeatHandle:
        """Beat every ``interval`` seconds from a daemon thread with its own persistent connection."""
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        handle = HeartbeatHandle(self, replica_id, interval)
        with self._lock:
            self._heartbeats = [h for h in self._heartbeats if h.running] + [handle]
        return handle

    def close(self) -> None:
        """Stop heartbeats and close every connection (call with no request in flight)."""
        with self._lock:
            beats, self._heartbeats = self._heartbeats, []
            channels = list(self._channels)
        for h in beats:
            h.stop()
        for c in channels:
            c.close()

"""Abort a step whose quorum lost a participant, as soon as the lighthouse knows (issue: hung peers).

A participant that hangs (SIGSTOP, a hung host, a stuck device) keeps its sockets open: its peers'
collectives with it neither complete nor fail until the collective timeout (60 s by default),
while the lighthouse declares the group silent within its heartbeat timeout (5 s). The answer to
the heartbeats the group leader sends anyway carries the quorum id and the lost participants
(docs/lighthouse.md, ``POST /heartbeat``); `LostPeerAbort` turns it into the process group's abort:
the pending collective fails, the step is not committed, and the next quorum -- whose id the loss
changes -- forms without the lost group (or with a hot spare in its place).

Only the quorum in use is aborted: a stale answer (an older quorum id: the group already moved on)
is ignored, and each quorum is aborted at most once. The abort comes only once an op of the step
has been pending for `protocol.BLOCKED_FOR` -- seen by a wait of ours (`watch`), or by a thread the notice
starts
(DDP's backward waits for the allreduces itself) -- not from the notice alone: a crashed peer (also "lost")
makes the
collectives fail at once by itself, and aborting then would only replace a Baby child that is still
usable. A configure in flight is aborted at once (the Manager's `stuck`): it cannot complete
without every participant. It runs on a thread of its own, never on the heartbeat thread: a plain Gloo abort
can
block, and a heartbeat that waited for it would make this group silent in turn. `use` (the Manager's
reconfigure) and an abort
exclude each other, so an abort never lands on the group built for the next quorum.
A member that is slow but still heartbeats is live to the lighthouse: no abort.

Known limit: with plain Gloo (no Baby child) the abort of a group whose op waits on a stopped peer
was seen to block (tests/processes/test_manager.py, a SIGSTOP before the commit vote, 600 s timeout): the step
fails at once, but the next configure waits for the abort, so the survivor goes on only when the
op times out -- as before this abort existed. Baby Gloo (the default) kills its child: immediate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ftlaunch.errors import CommunicationError
from ftlaunch.lighthouse.protocol import BLOCKED_FOR

log = logging.getLogger(__name__)

#: How often a rank told by its leader looks whether an op of the step is stuck (`LostPeerAbort._listen`).
_LISTEN_EVERY = 0.1


class LostPeerAbort:
    """Aborts ``abort()`` (the cross-group process group's) when told that the quorum in use lost
    a participant. `watch` gives each wait of the step its ``interrupted`` condition."""

    def __init__(
        self,
        abort: Callable[[], None],
        logger: logging.Logger | logging.LoggerAdapter[Any] = log,
        *,
        tell_group: Callable[[int], None] | None = None,
        told_by_leader: Callable[[int], bool] | None = None,
        stuck: Callable[[], bool] = lambda: False,
    ) -> None:
        """``tell_group(quorum_id)`` (the leader of a multi-rank group) passes an abort on to the
        group's other ranks, whose own cross-group groups wait on the lost group's ranks too and
        who hear nothing from the lighthouse; ``told_by_leader(quorum_id)`` (those other ranks)
        asks whether the leader did, while a wait of theirs lasts (`watch`)."""
        self._abort = abort
        self._log = logger
        self._tell_group = tell_group
        self._told_by_leader = told_by_leader
        #: Whether an op of the step has been pending for `protocol.BLOCKED_FOR` (the Manager's allreduces,
        #: which DDP's backward waits for): after a notice, a thread aborts once it is.
        self._stuck = stuck
        self._lock = threading.Lock()  # guards the fields below; never held while aborting
        self._abort_done: threading.Event | None = None  # set when the abort under way returned
        self._quorum_id: int | None = None  # the quorum the process group is configured for
        self._told_for: int | None = None
        self._aborted_for: int | None = None
        self._error: CommunicationError | None = None
        self._lost = threading.Event()
        #: Set by `close`: the watcher thread of a notice ends, none is started any more.
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []  # started by this object; `close` joins them
        self._listening = False  # a rank told by its leader: the listener thread runs (`_listen`)
        self.aborts = 0  # how many quorums were aborted (tests, logs)

    def use(self, quorum_id: int) -> None:
        """The process group is being configured for ``quorum_id`` (call before configuring): waits
        for an abort of the previous quorum to return first."""
        done = self._abort_done
        if done is not None:
            done.wait()
        with self._lock:
            self._abort_done = None
            self._quorum_id = quorum_id
            self._lost.clear()
            self._error = None
            listen = self._told_by_leader is not None and not self._listening and not self._closed.is_set()
            self._listening = self._listening or listen
        if listen:
            self._start(self._listen, (), "ftlaunch-lost-peer-listen")

    def lost(self, quorum_id: int, replica_ids: tuple[str, ...]) -> bool:
        """The lighthouse says ``replica_ids`` of quorum ``quorum_id`` are no longer live -- or, when
        ``replica_ids`` is empty, that ``quorum_id`` is the current quorum and this group is not in
        it (it was stopped while its peers went on). If that condemns the quorum in use, the step's
        waits stop (`watch`) and abort the process group; never blocks. Returns whether it did."""
        with self._lock:
            in_use = self._quorum_id
            if in_use is None or self._told_for == in_use or self._closed.is_set():
                return False
            if replica_ids and quorum_id != in_use:
                return False  # a stale answer: about a quorum this group no longer uses
            if not replica_ids and quorum_id == in_use:
                return False
            self._told_for = in_use
            why = (
                f"lost {', '.join(replica_ids)} (the lighthouse no longer counts it live)" if replica_ids
                else f"was superseded by quorum {quorum_id}, which goes on without this group"
            )  # fmt: skip
            self._error = CommunicationError(
                f"quorum {in_use} {why}: this step is aborted instead of waiting for the collective timeout"
            )
            self._lost.set()
        self._log.warning("%s", self._error)
        self._start(self._until_stuck, (in_use,), "ftlaunch-lost-peer")
        return True

    def _start(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the watcher of a notice and wait (at most ``timeout`` in all) for it and for an
        abort under way: nothing this object started outlives the Manager's shutdown."""
        self._closed.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _until_stuck(self, quorum_id: int) -> None:
        """After a notice: tell the group's other ranks, then abort as soon as an op of the step is
        stuck (DDP's backward waits for its allreduces outside any wait of ours), until the quorum
        changes or the abort happened."""
        if self._tell_group is not None:
            self._relay(quorum_id)
        while self._quorum_id == quorum_id and self._aborted_for != quorum_id:
            if self._stuck():
                self._abort_once(quorum_id)
                return
            if self._closed.wait(0.05):
                return

    def _listen(self) -> None:
        """A rank other than the leader hears of a lost participant only from its leader. Its waits
        ask (`watch`), but an op can be stuck outside any wait of ours -- DDP's backward or FSDP's
        gradient hook waiting on a Baby NCCL collective, which a dead peer never fails (a Gloo
        peer's closed sockets fail it at once) -- so this thread asks too, once an op of the step has
        been pending for `protocol.BLOCKED_FOR`: until then it only reads a clock, ten times a second."""
        asked = self._told_by_leader
        assert asked is not None
        while not self._closed.wait(_LISTEN_EVERY):
            in_use = self._quorum_id
            if in_use is None or self._lost.is_set() or self._aborted_for == in_use or not self._stuck():
                continue
            try:
                told = asked(in_use)
            except Exception:  # noqa: BLE001 - the store may be gone with the leader: the timeout still bounds us
                continue
            if told and self.lost(in_use, ("a participant (told by this group's leader)",)):
                continue  # `lost` started the abort's watcher: it aborts, the op being stuck

    def _relay(self, quorum_id: int) -> None:
        assert self._tell_group is not None
        try:
            self._tell_group(quorum_id)
        except Exception as e:  # noqa: BLE001 - the other ranks then wait for their timeouts
            self._log.warning(
                "could not tell the group's other ranks that quorum %d was lost: %s", quorum_id, e
            )

    def _abort_once(self, quorum_id: int | None = None) -> None:
        """Start the abort (once per quorum) on a thread of its own: a plain Gloo group's abort can
        block, and neither the training thread nor -- through this object's lock -- the heartbeat
        thread may wait for it. `use` waits for it, so it never lands on the next quorum's group."""
        with self._lock:
            in_use = self._quorum_id
            if (
                in_use is None
                or self._aborted_for == in_use
                or (quorum_id is not None and quorum_id != in_use)
            ):
                return
            self._aborted_for = in_use
            done = self._abort_done = threading.Event()
        self._start(self._run, (in_use, done), "ftlaunch-lost-peer-abort")

    def _run(self, quorum_id: int, done: threading.Event) -> None:
        try:
            self._abort()
        except Exception:  # noqa: BLE001 - the step fails anyway (interrupted); log why the abort did not
            self._log.exception("aborting the process group of quorum %d failed", quorum_id)
        finally:
            self.aborts += 1
            done.set()

    def settle(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout``) for an abort under way: the step's ops then fail within the
        step, not into the next one."""
        done = self._abort_done
        if done is not None:
            done.wait(timeout)

    def watch(self, prepare: Callable[[], None], after: float = BLOCKED_FOR) -> Callable[[], bool]:
        """The ``interrupted`` condition of one wait of a step (`commit.wait_all`). Once the wait has
        lasted ``after`` seconds (`protocol.BLOCKED_FOR`: the threshold at which the leader reports
        the step blocked and the lighthouse's hung rule acts; a slow peer that still heartbeats is
        never declared for it) it calls ``prepare`` (the process group's `prepare_abort`: a Baby
        group starts its replacement child while the lighthouse still waits out its heartbeat
        timeout), and if the quorum in use was told lost it aborts the process group and ends the
        wait. Only a wait that lasts: a crashed peer's sockets close, so the collectives fail by
        themselves at once, and a Baby child left alive is reused instead of replaced (a torch
        import: seconds, 20 s on loaded cores)."""
        start = time.monotonic()
        prepared = False

        def interrupted() -> bool:
            nonlocal prepared
            if time.monotonic() - start < after:
                return False
            if not prepared:
                prepared = True
                try:
                    prepare()
                except Exception:  # noqa: BLE001 - only a head start: the abort still works without it
                    self._log.exception("preparing the process group for an abort failed")
            in_use, asked = self._quorum_id, self._told_by_leader
            if not self._lost.is_set() and in_use is not None and asked is not None:
                try:
                    told = asked(in_use)
                except Exception:  # noqa: BLE001 - the store may be gone with the leader: the timeout still bounds us
                    told = False
                if told:
                    self.lost(in_use, ("a participant (told by this group's leader)",))
            if not self._lost.is_set():
                return False
            self._abort_once()
            return True

        return interrupted

    @property
    def error(self) -> CommunicationError | None:
        """Why the quorum in use was aborted, or None."""
        return self._error if self._lost.is_set() else None

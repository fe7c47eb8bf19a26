"""What a quorum request of the membership comes to: a `QuorumTicket`, resolved once, with a quorum
or one of the domain errors below.

Why a module of its own: the tickets and the errors are the membership's vocabulary towards whoever
waits on it (``routes.py`` maps each error to an HTTP status, and resolves nothing itself), and they
need nothing of the bookkeeping: `round.QuorumRound` parks and resolves the tickets, and
`membership.Membership` re-exports them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ftlaunch.errors import LighthouseError
from ftlaunch.lighthouse.quorum import Quorum, QuorumMember


class MembershipError(LighthouseError):
    """A request the membership refuses (or a wait it ends); ``routes.py`` maps each kind to HTTP."""


class ShuttingDown(MembershipError):
    """The lighthouse is stopping: it accepts nothing more."""


class Evicted(MembershipError):
    """The group was evicted; told once, after which the group may join afresh."""


class Superseded(MembershipError):
    """A newer quorum request of the same group replaced this one."""


class Left(MembershipError):
    """The group left while its quorum request waited."""


class QuorumTimeout(MembershipError):
    """No quorum containing the group formed in time; the message says what the decision waited for."""


class HeldElsewhere(MembershipError):
    """The replica id is held by another live incarnation (process) of the group."""


class ImplausibleStep(MembershipError):
    """A group claims a step no quorum led to: it would become every group's healing source
    (docs/security.md)."""


class TooManyGroups(MembershipError):
    """The lighthouse tracks `MAX_GROUPS` ids already."""


class TrainingFinished(MembershipError):
    """Another group finished the training at a step this request is behind, and no participant of
    the quorum that would form is at or past that step: nobody is left to heal the group from, so
    it would train from behind, alone. The group is a straggler of a finished job and should end."""

    def __init__(self, message: str, finished_step: int) -> None:
        super().__init__(message)
        self.finished_step = finished_step


class Abandoned(MembershipError):
    """The requester went away (its connection closed): there is nobody to answer."""


class QuorumTicket:
    """One parked quorum request: resolved exactly once, with a quorum or a `MembershipError`.

    Callbacks run in the thread that resolves it (or at once, in the caller's, if it already is),
    so they must be short and thread-safe; the transport's only schedules the answer.
    """

    __slots__ = ("member", "quorum", "error", "_done", "_callbacks", "_lock")

    def __init__(self, member: QuorumMember) -> None:
        self.member = member
        self.quorum: Quorum | None = None
        self.error: MembershipError | None = None
        self._done = False
        self._callbacks: list[Callable[[QuorumTicket], None]] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[QuorumTicket], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def resolve(self, quorum: Quorum | None = None, error: MembershipError | None = None) -> bool:
        """Answer it (the first answer wins: a second one returns False and changes nothing)."""
        with self._lock:
            if self._done:  # the first answer wins
                return False
            self.quorum, self.error, self._done = quorum, error, True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True

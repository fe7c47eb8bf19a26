"""Exception types of ftlaunch.

One base type (`FtlaunchError`) so callers can catch everything we raise, and one type for
communication failures (`CommunicationError`, the analogue of fairseq2's ``GangError``) that is
distinct from misuse, which raises the standard ``ValueError``/``TypeError``. Training code that
wants to survive a dead peer catches `CommunicationError` and nothing else.

The Gang API (`ftlaunch.gang`, fairseq2's interface) adds fairseq2's names to this one family:
`GangError` is the `CommunicationError` a gang raises, and `InvalidOperationError`,
`NotSupportedError` and `OperationalError` are the other conditions its documentation names.
"""

from __future__ import annotations


class FtlaunchError(RuntimeError):
    """Base class of every error ftlaunch raises on purpose."""


class CommunicationError(FtlaunchError):
    """A collective, store or network operation failed (peer died, timeout, connection lost).

    The message names the operation, the peer rank when known, and the quorum/store prefix.
    """


class LighthouseError(FtlaunchError):
    """The lighthouse could not be reached or rejected a request."""


class LighthouseUnavailableError(LighthouseError):
    """No lighthouse answered within the connect timeout (after retries)."""


class QuorumTimeoutError(LighthouseError):
    """No quorum containing this replica group formed within the quorum timeout."""


class EvictedError(LighthouseError):
    """The lighthouse evicted this replica group (admin action); the group must stop."""


class TrainingFinishedError(LighthouseError):
    """The lighthouse refused this group a quorum: another group finished the training at a step
    this group is behind, and nobody is left to heal it from (HTTP 412). The group is a straggler
    of a finished job: the Manager ends its process cleanly (exit status 0)."""


class CheckpointTransportError(CommunicationError):
    """A live-recovery transfer failed, timed out, or delivered a corrupt payload."""


class ConfigurationError(FtlaunchError, ValueError):
    """Settings are missing or inconsistent (bad environment, bad timeout hierarchy, ...)."""


class GangError(CommunicationError):
    """A gang's collective failed (fairseq2's ``GangError``): a peer died, a timeout, a lost connection.

    A subclass of `CommunicationError`, not a sibling or an alias: ``except CommunicationError``
    (ftlaunch's one rule for surviving a dead peer) also catches gang failures, while
    ``except GangError`` (fairseq2 code) catches exactly what gangs raise and nothing from the
    lighthouse or the checkpoint transports. Every gang raises this one type, whatever its backend.
    """


class InvalidOperationError(FtlaunchError):
    """The call is not valid in the object's current state (a closed gang, a second default group)."""


class NotSupportedError(FtlaunchError, NotImplementedError):
    """This implementation cannot do what was asked (e.g. a ``FakeGang`` as a torch ProcessGroup)."""


class OperationalError(FtlaunchError):
    """The job cannot go on because its environment failed, not because of a bug in the caller.

    fairseq2 recipes turn a `GangError` they cannot handle into this (``raise_operational_gang_error``).
    """


def install_brief_configuration_errors() -> None:
    """Make an uncaught `ConfigurationError` end the process with one line on stderr, not a traceback.

    Why: a bad environment value (``FTLAUNCH_LIGHTHOUSE=ftp://x``, ``REPLICA_GROUP_ID=abc``) is the
    operator's mistake, not a bug; under torchrun every worker would print the same 20-line traceback
    whose last line alone matters. Any other exception keeps the previous hook (a traceback).
    Idempotent; called by ``ftlaunch.init()`` and the Manager before they read the environment.
    """
    import sys

    previous = sys.excepthook
    if getattr(previous, "_ftlaunch_brief", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        if issubclass(exc_type, ConfigurationError):
            print(f"ftlaunch: configuration error: {exc}", file=sys.stderr, flush=True)
            return
        previous(exc_type, exc, tb)  # type: ignore[arg-type]

    hook._ftlaunch_brief = True  # type: ignore[attr-defined]
    sys.excepthook = hook

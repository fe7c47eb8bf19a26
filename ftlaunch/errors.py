"""Exception types of ftlaunch.

One base type (`FtlaunchError`) so callers can catch everything we raise, and one type for
communication failures (`CommunicationError`, the analogue of fairseq2's ``GangError``) that is
distinct from misuse, which raises the standard ``ValueError``/``TypeError``. Training code that
wants to survive a dead peer catches `CommunicationError` and nothing else.
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


class CheckpointTransportError(CommunicationError):
    """A live-recovery transfer failed, timed out, or delivered a corrupt payload."""


class ConfigurationError(FtlaunchError, ValueError):
    """Settings are missing or inconsistent (bad environment, bad timeout hierarchy, ...)."""

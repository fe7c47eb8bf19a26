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

import contextlib
import urllib.error
from typing import Any


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


class CheckpointUnreachableError(CheckpointTransportError, urllib.error.URLError):
    """The HTTP checkpoint server could not be reached, or did not answer before the deadline.

    Also a ``urllib.error.URLError`` (so an ``OSError``), which is what torchft's HTTP transport
    raises then: code written for torchft that catches ``URLError`` keeps catching it, and
    ftlaunch code catches `CheckpointTransportError`. Its text reads as a URLError's
    (``<urlopen error ...>``).
    """

    def __init__(self, message: str) -> None:
        urllib.error.URLError.__init__(self, message)

    __str__ = urllib.error.URLError.__str__


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


def brief_message(exc: BaseException) -> str | None:
    """The one line an uncaught ``exc`` ends the process with, or None for a traceback.

    One line for the operator's mistakes, which a traceback only buries: a bad setting
    (`ConfigurationError`: a malformed or out-of-range value, a missing variable) and a lighthouse
    that does not answer (`LighthouseUnavailableError`: nothing listens at the address, or it stayed
    down longer than the job waits). Their messages name the value and the fix. Everything else --
    a bug, a failed step the script chose not to survive -- keeps its traceback.
    """
    if isinstance(exc, ConfigurationError):
        return f"ftlaunch: configuration error: {exc}"
    if isinstance(exc, LighthouseUnavailableError):
        return f"ftlaunch: error: {exc}"
    return None


#: The ``errorTraits`` category (torchelastic's error-file field) of a worker that ended on a
#: `ConfigurationError`: its launcher stops the job instead of restarting the group.
CONFIGURATION_ERROR = "configuration_error"


def error_record(exc: BaseException, callstack: str, timestamp: int) -> dict[str, Any]:
    """What a worker ending on ``exc`` writes to its torchelastic error file: torchelastic's own
    layout (what its ``@record`` writes, so torchrun's failure report shows the message), plus the
    ``errorTraits`` that say a `ConfigurationError` is not worth a restart.

    Why the error file: it is torchelastic's channel from a worker to its agent, one file per worker
    and attempt, complete before the process exits -- the agent that sees the exit can read why.
    """
    record: dict[str, Any] = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)},
        }
    }
    if isinstance(exc, ConfigurationError):
        record["errorTraits"] = {"category": CONFIGURATION_ERROR, "retryability": "False"}
    return record


def configuration_error_in(record: object) -> str | None:
    """The message of the `ConfigurationError` a worker's error file ``record`` (parsed JSON) says
    it ended on (`error_record`), or None: another failure, or a record that is not one of ours."""
    if not isinstance(record, dict):
        return None
    traits = record.get("errorTraits")
    if not isinstance(traits, dict) or traits.get("category") != CONFIGURATION_ERROR:
        return None
    message = record.get("message")
    text = message.get("message") if isinstance(message, dict) else message
    if not isinstance(text, str):
        return ""
    prefix = f"{ConfigurationError.__name__}: "
    return text[len(prefix) :] if text.startswith(prefix) else text


#: Where this worker records a `ConfigurationError` it ends on, as `install_brief_errors` was told:
#: its torchelastic error file, and the file the ``ftlaunch`` rendezvous reads (none: not launched so).
_error_files: tuple[str, ...] = ()


def _record_for_launcher(exc: BaseException) -> None:
    """Write `error_record` to each of this worker's error files (whole or not at all: the agent
    may read one the moment the process is gone). Best effort: the process is ending on one line
    either way."""
    import json
    import os
    import time
    import traceback

    if not _error_files:
        return
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    record = error_record(exc, callstack, int(time.time()))
    for path in _error_files:
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def install_brief_errors(error_file: str | None = None, rendezvous_file: str | None = None) -> None:
    """Make an uncaught ftlaunch configuration error end the process with one line on stderr, exit
    status 1, instead of a traceback (`brief_message` says which errors).

    Why a hook and not a catch: the error surfaces in the user's script (``ftlaunch.init()``, or the
    first step of the training loop), and under torchrun every worker would print the same 40-line
    traceback whose last line alone matters. Code that catches the error is unaffected, and for any
    other exception the previous hook runs (a traceback, or whatever the script installed).
    A `ConfigurationError` is also recorded in ``error_file``, the worker's torchelastic error file
    (``TORCHELASTIC_ERROR_FILE``, `ftlaunch.env.error_file`; `error_record`), so that the
    ``ftlaunch`` launcher stops the job rather than restart a group into the same error -- and in
    ``rendezvous_file`` (``FTLAUNCH_RENDEZVOUS_ERROR_FILE``, `ftlaunch.env.rendezvous_error_file`),
    which the ``ftlaunch`` rendezvous reads before a restart under torchrun's own agent, whose error
    files it cannot find.
    Idempotent; ``ftlaunch.init()`` and the Manager call it before they read the environment.
    """
    import sys

    global _error_files
    given = tuple(p for p in (error_file, rendezvous_file) if p)
    if given:
        _error_files = given
    previous = sys.excepthook
    if getattr(previous, "_ftlaunch_brief", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        line = brief_message(exc)
        if line is None:
            previous(exc_type, exc, tb)  # type: ignore[arg-type]
            return
        if isinstance(exc, ConfigurationError):
            _record_for_launcher(exc)  # the launcher stops the job: a restart cannot fix a setting
        _silence_ftlaunch_logs()
        print(line, file=sys.stderr, flush=True)

    hook._ftlaunch_brief = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _silence_ftlaunch_logs() -> None:
    """Mute every ``ftlaunch`` logger: the process is ending on one line, and a background thread
    (the heartbeat still retrying the lighthouse that is down) must not log after it and bury it."""
    import logging

    manager = logging.getLogger().manager
    for name in ["ftlaunch", *manager.loggerDict]:
        if name == "ftlaunch" or name.startswith("ftlaunch."):
            logging.getLogger(name).disabled = True

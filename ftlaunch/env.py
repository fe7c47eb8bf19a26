"""Every environment variable ftlaunch reads or writes, in one place.

The launcher, the rendezvous handler and the torchx components *publish* these to workers; the
Manager and ``ftlaunch.init`` *read* them. Keeping the names here means the README table, the
writers and the readers cannot drift apart.
"""

from __future__ import annotations

import os

# --- set by torchrun / torchelastic inside every worker (we set the same ones) -------------------
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

# --- ftlaunch's own ------------------------------------------------------------------------------
#: Id of this worker's replica group (0..N-1). Same name as torchft's so scripts port unchanged.
REPLICA_GROUP_ID = "REPLICA_GROUP_ID"
#: Number of replica groups the job was started with.
NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
#: Lighthouse address, ``http://host:port``.
FTLAUNCH_LIGHTHOUSE = "FTLAUNCH_LIGHTHOUSE"
#: torchft's name for the lighthouse address; accepted as a fallback.
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
#: Job token: required by the lighthouse's admin endpoints (evict, report failure).
FTLAUNCH_TOKEN = "FTLAUNCH_TOKEN"
#: Address the lighthouse binds when the launcher/rendezvous starts one (default loopback).
FTLAUNCH_LIGHTHOUSE_BIND = "FTLAUNCH_LIGHTHOUSE_BIND"
#: Cross-group process group built by ``ftlaunch.init()``: baby-gloo, baby-nccl, gloo or nccl.
FTLAUNCH_BACKEND = "FTLAUNCH_BACKEND"
#: Live-recovery transport built by ``ftlaunch.init()``: pg or http.
FTLAUNCH_TRANSPORT = "FTLAUNCH_TRANSPORT"
#: The one timeout knob (seconds); the others derive from it (``ftlaunch.timeouts``).
FTLAUNCH_TIMEOUT = "FTLAUNCH_TIMEOUT"
#: Explicit overrides of the derived timeouts (validated together; see docs/timeouts.md).
FTLAUNCH_COLLECTIVE_TIMEOUT = "FTLAUNCH_COLLECTIVE_TIMEOUT"
FTLAUNCH_HEAL_TIMEOUT = "FTLAUNCH_HEAL_TIMEOUT"
FTLAUNCH_COMMIT_TIMEOUT = "FTLAUNCH_COMMIT_TIMEOUT"
FTLAUNCH_QUORUM_TIMEOUT = "FTLAUNCH_QUORUM_TIMEOUT"
FTLAUNCH_CONNECT_TIMEOUT = "FTLAUNCH_CONNECT_TIMEOUT"

ALL_FTLAUNCH_VARS = (
    REPLICA_GROUP_ID,
    NUM_REPLICA_GROUPS,
    FTLAUNCH_LIGHTHOUSE,
    TORCHFT_LIGHTHOUSE,
    FTLAUNCH_TOKEN,
    FTLAUNCH_LIGHTHOUSE_BIND,
    FTLAUNCH_BACKEND,
    FTLAUNCH_TRANSPORT,
    FTLAUNCH_TIMEOUT,
    FTLAUNCH_COLLECTIVE_TIMEOUT,
    FTLAUNCH_HEAL_TIMEOUT,
    FTLAUNCH_COMMIT_TIMEOUT,
    FTLAUNCH_QUORUM_TIMEOUT,
    FTLAUNCH_CONNECT_TIMEOUT,
)


def lighthouse_address(environ: dict[str, str] | None = None) -> str | None:
    """The lighthouse address from the environment (ours first, torchft's as fallback)."""
    env = os.environ if environ is None else environ
    return env.get(FTLAUNCH_LIGHTHOUSE) or env.get(TORCHFT_LIGHTHOUSE) or None


def get_int(name: str, default: int | None = None, environ: dict[str, str] | None = None) -> int | None:
    """Read an integer variable; a malformed value is a clear `ConfigurationError`, not a traceback."""
    from ftlaunch.errors import ConfigurationError

    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={raw!r} is not an integer") from None

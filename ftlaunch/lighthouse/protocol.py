"""Wire constants of the lighthouse protocol, shared by server and client (see docs/lighthouse.md)."""

from __future__ import annotations

#: Every JSON response carries ``"version": API_VERSION``; paths are served under ``/v1`` too.
API_VERSION = 1
PATH_PREFIX = "/v1"

#: Request header naming the replica group a connection belongs to. A connection that carried it
#: ties the group's liveness to the connection: when the group's last such connection is closed by
#: the peer without a `leave`, the group is marked disconnected at once.
REPLICA_HEADER = "X-Ftlaunch-Replica"

#: Largest accepted request body; larger ones get 413 without being read.
MAX_BODY_BYTES = 1 << 20
#: Longest accepted replica id.
MAX_REPLICA_ID_LEN = 256
#: Upper bound of a quorum request's ``timeout`` field (seconds).
MAX_QUORUM_TIMEOUT = 24 * 3600.0
#: ``timeout`` of a quorum request that names none (seconds).
DEFAULT_QUORUM_TIMEOUT = 60.0


def parse_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port`` / ``http://host:port[/]`` into (host, port).

    A bare host takes ``default_port``; without one a missing port is a ValueError.
    """
    s = text.strip()
    if s.startswith("http://"):
        s = s[len("http://") :]
    elif "://" in s:
        raise ValueError(f"unsupported scheme in lighthouse address {text!r} (only http:// is served)")
    s = s.rstrip("/")
    if "/" in s:
        raise ValueError(f"lighthouse address {text!r} must not contain a path")
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            raise ValueError(f"unterminated IPv6 address in {text!r}")
        host, rest = s[1:end], s[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"bad address {text!r}")
        port_text = rest[1:] if rest else None
    elif s.count(":") == 1:
        host, port_text = s.split(":")
    elif ":" in s:
        raise ValueError(f"IPv6 address {text!r} must be written [addr]:port")
    else:
        host, port_text = s, None
    if port_text is None or port_text == "":
        if default_port is None:
            raise ValueError(f"address {text!r} has no port")
        port = default_port
    else:
        if not port_text.isdigit():
            raise ValueError(f"bad port in address {text!r}")
        port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in address {text!r}")
    return host, port


def format_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

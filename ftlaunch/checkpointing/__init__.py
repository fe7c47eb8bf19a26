"""Live-recovery checkpoint transports: copy the live state from a healthy replica group.

`HTTPTransport` serves the state over HTTP and fetches it with parallel range requests;
`PGTransport` sends it over a (reconfigured) process group. Both use `serialization`: a JSON header
plus raw tensor bytes — never pickle. Failures raise `ftlaunch.errors.CheckpointTransportError`.
"""

from ftlaunch.checkpointing.http_transport import HTTPTransport
from ftlaunch.checkpointing.pg_transport import PGTransport
from ftlaunch.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]

"""Live-recovery checkpoint transports: copy the live state from a healthy replica group.

A healing group copies the state of a healthy one at the current step instead of reloading a
checkpoint. `transport.CheckpointTransport` is the interface the Manager uses; two implement it:

* `http_transport.HTTPTransport` (default) serves the state over HTTP and fetches it with parallel
  range requests (`_http_server` is its serving side, `_http_fetch` its fetching side);
* `pg_transport.PGTransport` sends it over a (reconfigured) process group, e.g. NCCL between GPUs.

Both use `serialization/`, the wire format: a JSON header plus raw tensor bytes, never pickle.
Failures raise `ftlaunch.errors.CheckpointTransportError`. `staging` copies a state off the training
tensors, so that what a source serves is one step's state while its training goes on.
"""

from ftlaunch.checkpointing.http_transport import HTTPTransport
from ftlaunch.checkpointing.pg_transport import PGTransport
from ftlaunch.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]

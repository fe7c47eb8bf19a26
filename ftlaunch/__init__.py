"""ftlaunch: per-step fault-tolerant training for PyTorch, as a torchrun/torchelastic plugin."""

from __future__ import annotations

from ftlaunch.errors import (
    CheckpointTransportError,
    CommunicationError,
    ConfigurationError,
    EvictedError,
    FtlaunchError,
    LighthouseError,
    LighthouseUnavailableError,
    QuorumTimeoutError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointTransportError",
    "CommunicationError",
    "ConfigurationError",
    "EvictedError",
    "FtlaunchError",
    "LighthouseError",
    "LighthouseUnavailableError",
    "QuorumTimeoutError",
]

"""Connectors: move one keyed object between stage processes (docs/protocol.md §3.1).

``create_connector("shm" | "nixl" | "inproc", namespace=..., stage_id=..., **options)``.
"""

from __future__ import annotations

from typing import Any

from omnirelay.connectors.base import (
    MAX_KEY_BYTES,
    Connector,
    ConnectorHealth,
    GetResult,
    GetStatus,
    PutResult,
    is_prefix_match,
    validate_key,
    validate_namespace,
)
from omnirelay.errors import ConfigError

__all__ = [
    "BACKENDS",
    "MAX_KEY_BYTES",
    "Connector",
    "ConnectorHealth",
    "GetResult",
    "GetStatus",
    "PutResult",
    "create_connector",
    "is_prefix_match",
    "validate_key",
    "validate_namespace",
]

BACKENDS = ("shm", "nixl", "inproc")


def create_connector(
    backend: str, *, namespace: str, stage_id: int | None = None, **options: Any
) -> Connector:
    """Build a connector by backend name; unknown names and options raise ConfigError."""
    if backend == "shm":
        from omnirelay.connectors.shm.connector import ShmConnector

        return ShmConnector(namespace, stage_id, **options)
    if backend == "nixl":
        from omnirelay.connectors.nixl.connector import NixlConnector

        return NixlConnector(namespace, stage_id, **options)
    if backend == "inproc":
        from omnirelay.connectors.inproc import InprocConnector

        return InprocConnector(namespace, stage_id, **options)
    raise ConfigError(f"unknown connector backend {backend!r}; choose one of {', '.join(BACKENDS)}")

"""Connectors: move one keyed object between stage processes (docs/protocol.md §3.1).

* ``create_connector("shm" | "nixl" | "inproc", namespace=..., stage_id=..., **options)``;
* :func:`reclaim_namespace` — every backend's objects of a namespace that outlive their
  process, and those of dead owners reclaimed: the one reclaim call of the contract
  (each backend reclaims its own namespace: shm objects; nixl leases and device blocks
  live in their producer's memory and go with it).
"""

from __future__ import annotations

from typing import Any

from omnirelay.connectors.base import (
    MAX_KEY_BYTES,
    Connector,
    ConnectorHealth,
    GetResult,
    GetStatus,
    NamespaceObject,
    PutResult,
    ReclaimReport,
    inbox_name,
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
    "NamespaceObject",
    "PutResult",
    "ReclaimReport",
    "create_connector",
    "inbox_name",
    "is_prefix_match",
    "reclaim_namespace",
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


def reclaim_namespace(
    namespace: str | None, *, reclaim: bool = True, shm_dir: str | None = None
) -> ReclaimReport:
    """Every backend's objects of ``namespace`` (None: every namespace) that outlive their
    process; with ``reclaim``, those whose owner is dead are removed (objects of live
    processes, or of owners that cannot be told, are listed and left alone). Synchronous
    file-system work: call it off an event loop. ``shm_dir``: where the shm backend looks
    (tests; default /dev/shm). The in-process backend keeps nothing outside its process."""
    from omnirelay.connectors import nixl, shm

    report = shm.reclaim_namespace(namespace, reclaim=reclaim, shm_dir=shm_dir or shm.SHM_DIR)
    report.extend(nixl.reclaim_namespace(namespace, reclaim=reclaim))
    return report

"""``shm``: the default connector, across processes on one Linux host.

Modules, by role:

* ``connector`` — :class:`~omnirelay.connectors.shm.connector.ShmConnector`, the facade
  (``create_connector("shm", ...)`` builds one);
* ``slot`` — the header of a shared-memory slot and its state machine;
* ``atomics`` — the atomic word operations claims are made of;
* ``notices`` — arrival notices: wire format, sending, draining;
* ``mappings`` — a reader's cache of slot mappings;
* ``names`` — names under /dev/shm and process identities;
* ``reclaim`` — :func:`sweep`: find objects and reclaim those of dead processes (at
  connector startup, and through :func:`reclaim_namespace`, this backend's part of the
  contract's reclaim).

Importing this package is cheap (no payload codec, no torch): the connector module is
imported when a connector is built.
"""

from __future__ import annotations

from omnirelay.connectors.base import ReclaimReport
from omnirelay.connectors.shm.names import SHM_DIR
from omnirelay.connectors.shm.notices import address as notice_address
from omnirelay.connectors.shm.reclaim import sweep

__all__ = ["SHM_DIR", "notice_address", "reclaim_namespace", "sweep"]


def reclaim_namespace(namespace: str | None, *, reclaim: bool, shm_dir: str = SHM_DIR) -> ReclaimReport:
    """The shm backend's objects of ``namespace`` under /dev/shm — slots, published keys,
    claims — with those of dead owners removed when ``reclaim`` is true. Device blocks
    need nothing here: they live in their producer's GPU memory and go with its process;
    consumers drop their mappings of a dead producer in housekeeping."""
    return sweep(namespace, reclaim=reclaim, shm_dir=shm_dir)

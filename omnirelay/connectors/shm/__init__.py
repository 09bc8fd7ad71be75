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
  connector startup, by the orchestrator and ``omnirelay doctor``).

Importing this package is cheap (no payload codec, no torch): the connector module is
imported when a connector is built.
"""

from __future__ import annotations

from omnirelay.connectors.shm.names import SHM_DIR
from omnirelay.connectors.shm.notices import address as notice_address
from omnirelay.connectors.shm.reclaim import ShmObject, SweepReport, sweep

__all__ = ["SHM_DIR", "ShmObject", "SweepReport", "notice_address", "sweep"]

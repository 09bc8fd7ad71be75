"""``nixl``: the connector contract across hosts; bytes move by NIXL's one-sided READ.

Modules, by role:

* ``connector`` — :class:`~omnirelay.connectors.nixl.connector.NixlConnector`, the facade
  (``create_connector("nixl", ...)`` builds one), its options and addressing;
* ``producer`` — put, the claim server, leases and retracts;
* ``reader`` — notices, claims, the READ and the acknowledgement;
* ``wire`` — the control messages and the layout of a registered object;
* ``agent`` — loading NIXL, one agent per connector, registered buffer pools;
* :func:`reclaim_namespace` — this backend's part of the contract's reclaim.

Importing this package is cheap: NIXL is imported when a connector is built.
"""

from __future__ import annotations

from omnirelay.connectors.base import ReclaimReport
from omnirelay.connectors.nixl.agent import unavailable_reason

__all__ = ["reclaim_namespace", "unavailable_reason"]


def reclaim_namespace(namespace: str | None, *, reclaim: bool) -> ReclaimReport:
    """The nixl backend's objects that outlive their process: none. An object is a
    registered buffer in its producer's memory, gone with the producer; while the producer
    lives, its own lease reclaims what a claimer never acknowledged and its cleanup
    withdraws what nobody claimed (:mod:`~omnirelay.connectors.nixl.producer`)."""
    return ReclaimReport()

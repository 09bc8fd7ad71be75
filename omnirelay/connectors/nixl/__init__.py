"""``nixl``: the connector contract across hosts; bytes move by NIXL's one-sided READ.

Modules, by role:

* ``connector`` — :class:`~omnirelay.connectors.nixl.connector.NixlConnector`, the facade
  (``create_connector("nixl", ...)`` builds one), its options and addressing;
* ``producer`` — put, the claim server, leases and retracts;
* ``reader`` — notices, claims, the READ and the acknowledgement;
* ``wire`` — the control messages and the layout of a registered object;
* ``agent`` — loading NIXL, one agent per connector, registered buffer pools.

Importing this package is cheap: NIXL is imported when a connector is built.
"""

from __future__ import annotations

from omnirelay.connectors.nixl.agent import unavailable_reason

__all__ = ["unavailable_reason"]

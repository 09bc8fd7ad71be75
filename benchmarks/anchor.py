"""omnirelay's ``shm`` connector as a transport of a transfer-anchor harness: a
``transfer_anchor.py`` that loads its transports as ``module:Class`` (not in this repository)::

    python transfer_anchor.py --transport benchmarks.anchor:OmniRelayShmTransport

The harness creates one instance per role (producer / consumer) in separate processes;
both derive the same namespace from the run directory and channel it passes in.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from omnirelay.connectors import GetStatus, create_connector

__all__ = ["OmniRelayShmTransport"]


class OmniRelayShmTransport:
    name = "omnirelay_shm"
    in_process = False

    def __init__(self, role: str, options: dict[str, str] | None = None) -> None:
        self.role = role
        self.options = dict(options or {})
        self.conn: Any = None

    def setup(self, ctx: dict[str, Any]) -> None:
        digest = hashlib.blake2b(f"{ctx['run_dir']}|{ctx['channel']}".encode(), digest_size=6).hexdigest()
        self.namespace = f"anchor{digest}"
        stage = 1 if self.role == "producer" else 2
        # The consumer binds the arrival socket of stage 2; the producer only sends to it.
        self.conn = create_connector("shm", namespace=self.namespace, stage_id=stage, sweep_on_start=False)

    def put(self, key: str, obj: Any) -> None:
        res = self.conn.put(1, 2, key, obj)
        if not res.ok:
            raise RuntimeError(f"omnirelay shm put failed for {key}: {res.error}")
        self.conn.reap_consumed()

    def get(self, key: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.conn.get(1, 2, key)
            if got.status is GetStatus.READY:
                return got.obj
            if got.status is GetStatus.FAILED:
                raise RuntimeError(f"omnirelay shm get failed for {key}: {got.error}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no data for {key} within {timeout_s}s")
            self.conn.wait_arrivals(2, timeout=min(left, 0.5))

    def cleanup(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def info(self) -> dict[str, Any]:
        return {
            "connector": "omnirelay.connectors.shm.connector.ShmConnector",
            "namespace": getattr(self, "namespace", None),
        }

"""``SplitConnector``: a stage whose input edge and output edge use different backends.

Placed on several hosts, a middle stage may read its input over ``shm`` (its source runs on
the same host) and send its output over ``nixl`` (its consumer runs on another). The stage's
adapter still sees one :class:`~omnirelay.connectors.base.Connector`: gets and arrivals go
to the input side, puts and the books of what was put to the output side, cleanups to both
(the input side forgets announcements of the keys, the output side withdraws them).
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnirelay.connectors.base import Arrivals, Connector, ConnectorHealth, GetResult, PutResult

__all__ = ["SplitConnector"]

_SUMMED = (
    "num_puts", "num_put_failures", "num_gets", "num_get_failures", "bytes_put", "bytes_got",
    "num_pending_keys", "num_live_objects", "live_bytes", "num_reaped", "num_cleaned",
    "num_notices_sent", "num_notices_lost", "pool_slots", "pool_bytes",
)  # fmt: skip


class SplitConnector(Connector):
    def __init__(self, input_side: Connector, output_side: Connector) -> None:
        self.input_side = input_side
        self.output_side = output_side
        self.backend = f"{input_side.backend}+{output_side.backend}"

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        return self.output_side.put(from_stage, to_stage, key, obj, to_replica)

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        return self.input_side.get(from_stage, to_stage, key)

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        arrivals = self.input_side.wait_arrivals(to_stage, timeout)
        return arrivals if isinstance(arrivals, Arrivals) else Arrivals(arrivals)

    def cleanup(self, key: str) -> bool:
        removed = self.output_side.cleanup(key)
        return self.input_side.cleanup(key) or removed

    def cleanup_prefix(self, prefix: str) -> int:
        return self.output_side.cleanup_prefix(prefix) + self.input_side.cleanup_prefix(prefix)

    def reap_consumed(self) -> int:
        return self.output_side.reap_consumed() + self.input_side.reap_consumed()

    def pending_keys(self) -> list[str]:
        return self.output_side.pending_keys() + self.input_side.pending_keys()

    def leak_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for side in (self.input_side, self.output_side):
            books = getattr(side, "leak_state", None)
            if callable(books):
                out.update(books())
        return out

    def close(self) -> None:
        try:
            self.output_side.close()
        finally:
            self.input_side.close()

    def health(self) -> ConnectorHealth:
        a, b = self.input_side.health(), self.output_side.health()
        merged = msgspec.structs.replace(a, backend=self.backend)
        for name in _SUMMED:
            setattr(merged, name, getattr(a, name) + getattr(b, name))
        merged.status = a.status if a.status != "healthy" else b.status
        merged.last_error = b.last_error or a.last_error
        return merged

"""Backpressure: a byte budget of unconsumed data per edge (docs/protocol.md §10.1).

Every successful put is recorded with its ``PutResult.nbytes``. A record is released when
the data is known to be gone:

* the sender's cleanup task removed the key (:meth:`ByteBudget.release`), or
* a housekeeping pass saw the key missing from ``connector.pending_keys()`` after
  ``reap_consumed()`` — consumed by the receiver, or released by the orchestrator
  (:meth:`ByteBudget.release_absent`).

The pass compares against a snapshot of records taken *before* it lists the pending keys,
and releases a record only if it is still the same object, so a put that completes during
the pass is never released by mistake.

A put may start while its edge is below the budget (a high-water mark: the put that crosses
it is allowed, since a payload's size is known only once it is encoded). A connector whose
``pending_keys()`` is the default empty list makes every put look consumed at the next
pass: the budget then never binds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["ByteBudget", "Edge", "PutRecord", "edge_name"]

Edge = tuple[int, int]


def edge_name(edge: Edge) -> str:
    return f"{edge[0]}->{edge[1]}"


class PutRecord:
    __slots__ = ("edge", "nbytes")

    def __init__(self, edge: Edge, nbytes: int) -> None:
        self.edge = edge
        self.nbytes = nbytes


class ByteBudget:
    """Unconsumed bytes per edge against one limit; a condition wakes waiting senders."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._cv = threading.Condition()
        self._records: dict[str, PutRecord] = {}
        self._used: dict[Edge, int] = {}
        self.num_waiters = 0
        self.num_released = 0

    def add(self, key: str, edge: Edge, nbytes: int) -> None:
        with self._cv:
            old = self._records.get(key)
            if old is not None:  # same key published again: the old record is stale
                self._drop(key, old)
            rec = PutRecord(edge, max(0, int(nbytes)))
            self._records[key] = rec
            if rec.nbytes:
                self._used[edge] = self._used.get(edge, 0) + rec.nbytes

    def _drop(self, key: str, rec: PutRecord) -> None:
        # ``_used`` holds an edge only while its records hold bytes: a record of no bytes
        # (a put by reference, docs/protocol.md §3.10) never touches it, so releasing one
        # cannot take the books of an edge whose other records are still there.
        del self._records[key]
        if rec.nbytes:
            left = self._used[rec.edge] - rec.nbytes
            if left:
                self._used[rec.edge] = left
            else:
                del self._used[rec.edge]
        self.num_released += 1

    def release(self, keys: Iterable[str]) -> int:
        n = 0
        with self._cv:
            for key in keys:
                rec = self._records.get(key)
                if rec is not None:
                    self._drop(key, rec)
                    n += 1
            if n:
                self._cv.notify_all()
        return n

    def snapshot(self) -> list[tuple[str, PutRecord]]:
        with self._cv:
            return list(self._records.items())

    def release_absent(self, snapshot: list[tuple[str, PutRecord]], present: set[str]) -> int:
        n = 0
        with self._cv:
            for key, rec in snapshot:
                if key not in present and self._records.get(key) is rec:
                    self._drop(key, rec)
                    n += 1
            if n:
                self._cv.notify_all()
        return n

    def is_over(self, edge: Edge) -> bool:
        # One dict read, atomic under the GIL: no lock on the send path. A sender that
        # reads a stale value either waits one more reap pass or re-checks in the wait loop.
        return self._used.get(edge, 0) >= self.limit_bytes

    def used(self, edge: Edge) -> int:
        with self._cv:
            return self._used.get(edge, 0)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a release (or :meth:`notify`). Counts as a waiter."""
        with self._cv:
            self.num_waiters += 1
            try:
                self._cv.wait(timeout)
            finally:
                self.num_waiters -= 1

    def notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def stats(self) -> dict[str, object]:
        with self._cv:
            per_edge: dict[str, dict[str, int]] = {}
            for rec in self._records.values():
                e = per_edge.setdefault(edge_name(rec.edge), {"pending_bytes": 0, "pending_keys": 0})
                e["pending_bytes"] += rec.nbytes
                e["pending_keys"] += 1
            return {
                "limit_bytes": self.limit_bytes,
                "edges": per_edge,
                "num_waiters": self.num_waiters,
                "num_released": self.num_released,
            }

    def leak_state(self) -> dict[str, object]:
        with self._cv:
            return {"budget_records": sorted(self._records)} if self._records else {}

    def clear(self) -> None:
        with self._cv:
            self._records.clear()
            self._used.clear()
            self._cv.notify_all()

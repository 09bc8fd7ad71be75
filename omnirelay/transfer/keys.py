"""Transfer keys and the internal↔external request id mapping (docs/protocol.md §4.1, docs/design.md §3).

* :func:`make_key` — ``f"{external_id}_{source_stage}_{chunk_id}"``, the connector key of
  one chunk. Keys of one (external id, source stage) differ only in the chunk id, and
  cleanup always names exact keys (never a prefix), so ``task`` never touches ``task_1``.
* :func:`key_prefix` — ``f"{external_id}_{source_stage}_"`` for ``cleanup_prefix``.
* External ids are checked by :func:`omnirelay.ids.request_id_problem` (the one place
  their rules live); every id it accepts forms a key the connectors accept.
* :class:`IdMap` — internal id → external id of the requests this adapter knows, so a
  cleanup by internal id finds the sender state keyed by external id.
"""

from __future__ import annotations

import threading

from omnirelay.connectors.base import MAX_KEY_BYTES
from omnirelay.ids import MAX_REQUEST_ID_LEN

__all__ = ["IdMap", "key_prefix", "make_key"]

# Invariant: a usable external id (at most 4 UTF-8 bytes a character) with a stage and a
# 20-digit chunk id never exceeds the key limit, so the transfer layer checks ids only.
assert MAX_REQUEST_ID_LEN * 4 + 64 <= MAX_KEY_BYTES


def make_key(external_id: str, source_stage: int, chunk_id: int) -> str:
    """The connector key of chunk ``chunk_id`` of ``external_id`` sent by ``source_stage``."""
    return f"{external_id}_{source_stage}_{chunk_id}"


def key_prefix(external_id: str, source_stage: int) -> str:
    """Prefix of every key of ``external_id`` sent by ``source_stage`` (for ``cleanup_prefix``)."""
    return f"{external_id}_{source_stage}_"


class IdMap:
    """Internal → external ids. Written by admission and registration, removed by cleanup."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._external: dict[str, str] = {}

    def set(self, internal_id: str, external_id: str) -> None:
        with self._lock:
            self._external[internal_id] = external_id

    def ensure(self, internal_id: str, external_id: str) -> None:
        """``set``, skipped when the mapping is already there (one lock-free dict read:
        the hot path of every chunk after a request's first)."""
        if self._external.get(internal_id) != external_id:
            self.set(internal_id, external_id)

    def get(self, internal_id: str) -> str | None:
        with self._lock:
            return self._external.get(internal_id)

    def pop(self, internal_id: str) -> str | None:
        with self._lock:
            return self._external.pop(internal_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._external)

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._external)

    def clear(self) -> None:
        with self._lock:
            self._external.clear()

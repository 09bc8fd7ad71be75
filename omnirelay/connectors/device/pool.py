"""The producer's device buffer pool: blocks of one arena, by key (pure bookkeeping).

A block is a first-fit range of the arena, aligned to :data:`ALIGN`, that starts with a
:data:`STAMP_BYTES` stamp (its generation, written after the data, cleared when the block
is freed) followed by the tensor's bytes. Each placement takes a new generation, so a
reference to a freed or reused block never matches its stamp. A full pool places
nothing: the object takes the host path instead (never an error, never a wait).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["ALIGN", "STAMP_BYTES", "Block", "DevicePool"]

ALIGN = 256
STAMP_BYTES = 64


@dataclass(frozen=True, slots=True)
class Block:
    key: str
    offset: int  # of the stamp; the data starts STAMP_BYTES later
    size: int  # bytes taken from the arena (stamp, data, alignment)
    nbytes: int  # the data's bytes
    generation: int

    @property
    def data_offset(self) -> int:
        return self.offset + STAMP_BYTES


class DevicePool:
    """First-fit allocation of an arena of ``capacity`` bytes, one block per key."""

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"a device pool needs at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), by offset
        self._blocks: dict[str, Block] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def place(self, key: str, nbytes: int) -> Block | None:
        """A new block for ``key`` (None when no free range is large enough)."""
        size = -(-(STAMP_BYTES + nbytes) // ALIGN) * ALIGN
        with self._lock:
            if key in self._blocks:
                raise KeyError(f"key {key!r} already has a device block")
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    self._generation += 1
                    block = Block(key, offset, size, nbytes, self._generation)
                    self._blocks[key] = block
                    return block
            return None

    def free(self, key: str) -> Block | None:
        """Return ``key``'s block to the pool (None when it has none: idempotent)."""
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is not None:
                self._insert_free(block.offset, block.size)
            return block

    def _insert_free(self, offset: int, size: int) -> None:
        ranges = self._free
        i = 0
        while i < len(ranges) and ranges[i][0] < offset:
            i += 1
        ranges.insert(i, (offset, size))
        # Merge with the neighbours so that large blocks fit again after small ones go.
        if i + 1 < len(ranges) and offset + size == ranges[i + 1][0]:
            ranges[i] = (offset, size + ranges[i + 1][1])
            del ranges[i + 1]
        if i > 0 and ranges[i - 1][0] + ranges[i - 1][1] == offset:
            ranges[i - 1] = (ranges[i - 1][0], ranges[i - 1][1] + ranges[i][1])
            del ranges[i]

    def block(self, key: str) -> Block | None:
        with self._lock:
            return self._blocks.get(key)

    def live_keys(self) -> list[str]:
        """The keys that hold a block."""
        with self._lock:
            return list(self._blocks)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._blocks.values())

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max((size for _, size in self._free), default=0)

"""Which KV slot each request holds, and how many of its positions are cached (pure).

The static runner's KV cache has ``num_slots`` rows of ``max_len`` positions (plus one
*scratch* row, index ``num_slots``, where padding rows of a launch write). A request
takes a slot on its first prefill and keeps it until :meth:`SlotTable.release`; its
cached length only grows (or is cut back by :meth:`SlotTable.truncate`, for a recompute).
A request that finds no free slot is an error naming the setting to raise — never a
silent eviction of another request's cache.

The holders stay packed: slots ``0 .. n−1`` for ``n`` holders. When a request leaves,
the holder of the highest slot moves into the freed one (``on_move(src, dst, length)``
lets the runner move that slot's cached positions and per-slot state first), so a decode
over every holder is a run of slots from 0 that attention reads in place (see
:mod:`omnirelay.models.runner.decoder`): one copy per departure instead of a gather per
layer and step.
"""

from __future__ import annotations

from collections.abc import Callable

from omnirelay.errors import ModelError

__all__ = ["SlotTable"]


class SlotTable:
    """Slots by request id (one thread)."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        self.num_slots = num_slots
        self.max_len = max_len
        # Lowest slot first: a lightly loaded runner touches few rows of the cache.
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}
        #: called before a holder moves from slot ``src`` to ``dst`` with its cached length
        self.on_move: Callable[[int, int, int], None] | None = None

    @property
    def scratch(self) -> int:
        """The row padding writes to (never handed out)."""
        return self.num_slots

    def __contains__(self, rid: object) -> bool:
        return rid in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holders(self) -> list[str]:
        """The requests holding a slot, sorted (for leak audits)."""
        return sorted(self._slot)

    def acquire(self, rid: str) -> int:
        """The request's slot, taking a free one on first use (length 0)."""
        slot = self._slot.get(rid)
        if slot is not None:
            return slot
        if not self._free:
            raise ModelError(
                f"request {rid!r}: all {self.num_slots} KV slots are taken; raise executor_args.max_num_seqs "
                "(it must be at least the stage's max_num_seqs)"
            )
        slot = self._free.pop()
        self._slot[rid] = slot
        self._length[rid] = 0
        return slot

    def release(self, rid: str) -> None:
        """Give the slot back (idempotent); the holder of the highest slot moves into it."""
        slot = self._slot.pop(rid, None)
        if slot is None:
            return
        del self._length[rid]
        if self._slot:
            last, top = max(self._slot.items(), key=lambda item: item[1])
            if top > slot:
                if self.on_move is not None:
                    self.on_move(top, slot, self._length[last])
                self._slot[last] = slot
                slot = top
        self._free.append(slot)
        self._free.sort(reverse=True)

    def slot(self, rid: str) -> int:
        return self._slot[rid]

    def length(self, rid: str) -> int:
        """Cached positions of the request (0 when it holds no slot)."""
        return self._length.get(rid, 0)

    def check_room(self, rid: str, start: int, count: int) -> None:
        if start + count > self.max_len:
            raise ModelError(
                f"request {rid!r} needs {start + count} positions; max_model_len is {self.max_len} "
                "(raise executor_args.max_model_len)"
            )

    def set_length(self, rid: str, length: int) -> None:
        """Positions ``[0, length)`` are cached (after a forward pass wrote them)."""
        if rid not in self._slot:
            raise KeyError(rid)
        if not 0 <= length <= self.max_len:
            raise ModelError(f"request {rid!r}: length {length} outside [0, {self.max_len}]")
        self._length[rid] = length

    def truncate(self, rid: str, length: int) -> None:
        """Forget cached positions from ``length`` on (a recompute from an earlier point)."""
        if rid in self._length and length < self._length[rid]:
            self._length[rid] = max(0, length)

"""GPU-direct objects: the producer's pool over an arena, and the consumer's importer.

:class:`DeviceProducer` (the sending stage) places a tensor in a block of its arena,
writes the block's generation stamp after the data, waits for both copies to finish and
only then returns the :class:`~omnirelay.connectors.device.refs.DeviceRef` that the shm
slot's object carries: a reader can never see a partial tensor, because the ref exists
only once the bytes do (docs/protocol.md §3.3). The block lives until the key goes —
:meth:`~DeviceProducer.release` from the connector's reap (the slot was consumed), its
``cleanup``/``cleanup_prefix`` (abort, id release) or a dead reader's slot returning to
the producer (§3.5); :meth:`~DeviceProducer.close` frees everything. Release clears the
stamp before the range can be placed again.

:class:`DeviceImporter` (the receiving stage) opens each producer's arena once and, inside
the slot's claim (before the slot is set ``FREE``), copies a block out: it checks the
stamp before and after the copy, so a stale or forged ref — a block already released or
placed again — is a :class:`StaleBlockError`, never another object's bytes. Exactly once
is the slot's claim (§3.4): this layer adds no second way to read an object.
:meth:`~DeviceImporter.forget` closes what it opened of a producer that died (its memory
goes with its process).

Both work over an arena backend (:class:`Arena`, :class:`Opener`): CUDA IPC in
:mod:`omnirelay.connectors.device.cuda`, an in-memory fake in the tests.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from omnirelay.connectors.device.paths import MIN_BYTES
from omnirelay.connectors.device.pool import STAMP_BYTES, DevicePool
from omnirelay.connectors.device.refs import ArenaHandle, DeviceRef, check_ref
from omnirelay.payload.dtypes import TORCH_BY_DTYPE, TORCH_BY_NAME

__all__ = [
    "MIN_BYTES",
    "Arena",
    "DeviceImporter",
    "DeviceProducer",
    "OpenedArena",
    "Opener",
    "StaleBlockError",
]


class StaleBlockError(RuntimeError):
    """A device ref whose block no longer holds that object (released, or placed again)."""


class Arena(Protocol):
    """The producer's side of one device allocation; each call completes before it returns."""

    backend: str
    device: int
    capacity: int

    def ipc_fields(self) -> dict[str, Any]: ...
    def write(self, offset: int, data: torch.Tensor) -> None: ...
    def write_stamp(self, offset: int, value: int) -> None: ...
    def close(self) -> None: ...


class OpenedArena(Protocol):
    def read_stamp(self, offset: int) -> int: ...
    def read(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int], device: torch.device | None
    ) -> torch.Tensor: ...
    def close(self) -> None: ...


class Opener(Protocol):
    def open(self, handle: ArenaHandle) -> OpenedArena: ...


class DeviceProducer:
    """Places tensors in ``arena`` under keys; see the module docstring."""

    def __init__(self, arena: Arena, *, producer: str, arena_id: int = 0, min_bytes: int = MIN_BYTES) -> None:
        self.arena = arena
        self.min_bytes = min_bytes
        self.pool = DevicePool(arena.capacity)
        self.handle = ArenaHandle(
            backend=arena.backend,
            producer=producer,
            arena_id=arena_id,
            device=arena.device,
            capacity=self.pool.capacity,
            **arena.ipc_fields(),
        )
        self._closed = False
        self._lock = threading.Lock()

    def put(self, key: str, tensor: torch.Tensor) -> DeviceRef | None:
        """The ref of ``tensor`` placed under ``key``; None when the tensor is smaller than
        ``min_bytes``, the pool has no room or the dtype cannot travel (the caller takes
        the host path)."""
        spec = TORCH_BY_DTYPE.get(tensor.dtype)
        if spec is None or self._closed:
            return None
        nbytes = tensor.numel() * spec.itemsize
        if nbytes < self.min_bytes:
            return None
        block = self.pool.place(key, nbytes)
        if block is None:
            return None
        try:
            if nbytes:
                self.arena.write(block.data_offset, tensor.contiguous().reshape(-1).view(torch.uint8))
            self.arena.write_stamp(block.offset, block.generation)  # after the data: the ref is whole
        except BaseException:
            self.pool.free(key)
            raise
        return DeviceRef(
            arena=self.handle,
            offset=block.offset,
            nbytes=nbytes,
            generation=block.generation,
            dtype=spec.name,
            shape=tuple(tensor.shape),
        )

    def release(self, key: str) -> bool:
        """Free ``key``'s block (consumed, cleaned up, or its reader died); idempotent."""
        with self._lock:
            block = self.pool.block(key)
            if block is None:
                return False
            if not self._closed:
                self.arena.write_stamp(block.offset, 0)  # before the range can be placed again
            self.pool.free(key)
            return True

    def release_prefix(self, prefix: str) -> int:
        """Free the blocks of keys ``prefix + <integer>`` (a released request id, §2.8)."""
        pattern = re.compile(re.escape(prefix) + r"\d+")
        return sum(self.release(key) for key in self.pool.live_keys() if pattern.fullmatch(key))

    def keys(self) -> list[str]:
        return self.pool.live_keys()

    def close(self) -> None:
        """Free every block and the arena; idempotent."""
        with self._lock:
            if self._closed:
                return
            for key in self.pool.live_keys():
                self.pool.free(key)
            self._closed = True
        self.arena.close()


class DeviceImporter:
    """Copies GPU-direct objects out of producers' arenas; see the module docstring."""

    def __init__(self, opener: Opener, device: torch.device | None = None) -> None:
        self.opener = opener
        self.device = device
        self._open: dict[tuple[str, int], tuple[ArenaHandle, OpenedArena]] = {}
        self._lock = threading.Lock()

    def _arena(self, handle: ArenaHandle) -> OpenedArena:
        key = (handle.producer, handle.arena_id)
        with self._lock:
            known = self._open.get(key)
            if known is not None and known[0] == handle:
                return known[1]
            if known is not None:  # the same name, another arena: the old one is gone
                known[1].close()
            opened = self.opener.open(handle)
            self._open[key] = (handle, opened)
            return opened

    def take(self, ref: DeviceRef) -> torch.Tensor:
        """The referenced tensor, copied to this importer's device (complete on return)."""
        check_ref(ref)
        arena = self._arena(ref.arena)
        what = f"device block at {ref.offset} of producer {ref.arena.producer}"
        if arena.read_stamp(ref.offset) != ref.generation:
            raise StaleBlockError(f"{what} no longer holds generation {ref.generation}")
        out = arena.read(
            ref.offset + STAMP_BYTES, ref.nbytes, TORCH_BY_NAME[ref.dtype].dtype, ref.shape, self.device
        )
        if arena.read_stamp(ref.offset) != ref.generation:
            raise StaleBlockError(f"{what} was released while it was read")
        return out

    def forget(self, producer: str) -> int:
        """Close the arenas of ``producer`` (it died: its memory went with it)."""
        with self._lock:
            keys = [k for k in self._open if k[0] == producer]
            for key in keys:
                self._open.pop(key)[1].close()
        return len(keys)

    def producers(self) -> list[str]:
        with self._lock:
            return sorted({k[0] for k in self._open})

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for _, arena in opened:
            arena.close()

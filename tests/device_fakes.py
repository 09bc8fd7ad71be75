"""A fake device for GPU-direct tests on the CPU: arenas are host buffers in a registry
that stands for the GPU's memory (a producer's death removes its arenas, as the driver
frees a dead process's allocations)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from omnirelay.connectors.device.refs import ArenaHandle

#: name -> the arena's bytes: "device memory" of the fake GPU.
MEMORY: dict[bytes, torch.Tensor] = {}
_LOCK = threading.Lock()
_COUNT = [0]


class FakeArena:
    backend = "fake"

    def __init__(self, capacity: int, device: int = 0) -> None:
        with _LOCK:
            _COUNT[0] += 1
            self.name = f"arena-{_COUNT[0]}".encode()
            MEMORY[self.name] = torch.zeros(capacity, dtype=torch.uint8)
        self.device = device
        self.capacity = capacity
        self.num_stamp_writes = 0

    def ipc_fields(self) -> dict[str, Any]:
        return {"handle": self.name}

    def write(self, offset: int, data: torch.Tensor) -> None:
        MEMORY[self.name][offset : offset + data.numel()].copy_(data)

    def write_stamp(self, offset: int, value: int) -> None:
        self.num_stamp_writes += 1
        MEMORY[self.name][offset : offset + 8].copy_(
            torch.tensor([value], dtype=torch.int64).view(torch.uint8)
        )

    def close(self) -> None:
        MEMORY.pop(self.name, None)

    def die(self) -> None:
        """The producer process died: the driver frees its memory."""
        MEMORY.pop(self.name, None)


class FakeOpened:
    def __init__(self, handle: ArenaHandle, on_read: Callable[[], None] | None) -> None:
        if handle.handle not in MEMORY:
            raise RuntimeError(f"no device allocation {handle.handle!r} (its producer is gone)")
        self.name = handle.handle
        self.on_read = on_read
        self.is_closed = False

    def _mem(self) -> torch.Tensor:
        mem = MEMORY.get(self.name)
        if mem is None or self.is_closed:
            raise RuntimeError("the device allocation is gone")
        return mem

    def read_stamp(self, offset: int) -> int:
        return int(self._mem()[offset : offset + 8].view(torch.int64).item())

    def read(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int], device: torch.device | None
    ) -> torch.Tensor:
        out = self._mem()[offset : offset + nbytes].clone().view(dtype).view(tuple(shape))
        if self.on_read is not None:
            self.on_read()  # a forced interleaving: something happens mid-copy
        return out

    def close(self) -> None:
        self.is_closed = True


class FakeOpener:
    def __init__(self) -> None:
        self.opened: list[FakeOpened] = []
        self.on_read: Callable[[], None] | None = None

    def open(self, handle: ArenaHandle) -> FakeOpened:
        opened = FakeOpened(handle, self.on_read)
        self.opened.append(opened)
        return opened


class FakeBackend:
    """The shm connector's device backend over the fake GPU: the tensors passed through
    :meth:`on_device` stand for tensors on the device (every other one is a host tensor).
    ``fail_arena``: making an arena fails (no device memory, no IPC export)."""

    def __init__(self) -> None:
        self._on_device: dict[int, torch.Tensor] = {}  # by id, held: ids are never reused
        self.arenas: list[FakeArena] = []
        self.opener_made = FakeOpener()
        self.fail_arena: str | None = None

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        self._on_device[id(tensor)] = tensor
        return tensor

    def holds(self, tensor: torch.Tensor) -> bool:
        return self._on_device.get(id(tensor)) is tensor

    def arena(self, capacity: int, device: str | None, like: torch.Tensor) -> FakeArena:
        if self.fail_arena is not None:
            raise RuntimeError(self.fail_arena)
        arena = FakeArena(capacity)
        self.arenas.append(arena)
        return arena

    def opener(self) -> FakeOpener:
        return self.opener_made

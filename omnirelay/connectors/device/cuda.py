"""The CUDA backend of GPU-direct edges: one device allocation shared by CUDA IPC.

:class:`CudaArena` allocates the producer's arena on its device and exports it once
(``torch.UntypedStorage._share_cuda_``: the IPC handle of the allocation, the arena's
offset in it, and torch's IPC reference counter, which keeps the allocation alive while
a consumer still maps it). :class:`CudaOpener` maps it in the consumer
(``_new_shared_cuda``); :meth:`CudaOpened.read` copies a block to the consumer's device —
device to device on one GPU, a peer copy between two — and waits for the copy, so the
block can be released as soon as the slot is set free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omnirelay.connectors.device.refs import ArenaHandle

__all__ = ["CudaArena", "CudaOpened", "CudaOpener"]


class CudaArena:
    backend = "cuda"

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"a CUDA arena needs a CUDA device, got {dev}")
        self.buffer: torch.Tensor | None = torch.zeros(capacity, dtype=torch.uint8, device=dev)
        self.device = dev.index if dev.index is not None else torch.cuda.current_device()
        self.capacity = capacity
        self._stream = torch.cuda.current_stream(self.device)

    def _buf(self) -> torch.Tensor:
        if self.buffer is None:
            raise RuntimeError("the device arena is closed")
        return self.buffer

    def ipc_fields(self) -> dict[str, Any]:
        (_, handle, size, offset, rc_handle, rc_offset, event, event_sync) = (
            self._buf().untyped_storage()._share_cuda_()
        )
        return {
            "handle": bytes(handle),
            "storage_bytes": int(size),
            "storage_offset": int(offset),
            "ref_counter_handle": bytes(rc_handle or b""),
            "ref_counter_offset": int(rc_offset),
            "event_handle": bytes(event or b""),
            "event_sync_required": bool(event_sync),
        }

    def write(self, offset: int, data: torch.Tensor) -> None:
        # On the current stream, after whatever produced ``data``; the stamp's write waits.
        self._buf()[offset : offset + data.numel()].copy_(data, non_blocking=True)

    def write_stamp(self, offset: int, value: int) -> None:
        stamp = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
        self._buf()[offset : offset + 8].copy_(stamp)
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.buffer = None


class CudaOpened:
    def __init__(self, handle: ArenaHandle) -> None:
        torch.cuda.init()  # a process that never touched CUDA yet cannot map an IPC handle
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device,
            handle.handle,
            handle.storage_bytes,
            handle.storage_offset,
            handle.ref_counter_handle or None,
            handle.ref_counter_offset,
            handle.event_handle or None,
            handle.event_sync_required,
        )
        base = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle.device}")
        self.buffer: torch.Tensor | None = base.set_(storage, 0, (handle.capacity,), (1,))
        self.device = handle.device

    def _buf(self) -> torch.Tensor:
        if self.buffer is None:
            raise RuntimeError("the device arena is closed")
        return self.buffer

    def read_stamp(self, offset: int) -> int:
        return int(self._buf()[offset : offset + 8].view(torch.int64).item())

    def read(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int], device: torch.device | None
    ) -> torch.Tensor:
        src = self._buf()[offset : offset + nbytes].view(dtype).view(tuple(shape))
        out = src.to(device if device is not None else src.device, copy=True)
        torch.cuda.current_stream(out.device).synchronize()
        return out

    def close(self) -> None:
        self.buffer = None  # the storage's release drops torch's IPC reference


class CudaOpener:
    def open(self, handle: ArenaHandle) -> CudaOpened:
        if handle.backend != "cuda":
            raise ValueError(f"not a CUDA arena: {handle.backend!r}")
        return CudaOpened(handle)

"""The shm connector's two ends of a GPU-direct edge (docs/protocol.md §3.9).

:class:`DeviceSender` — on a connector whose stage sends on GPU-direct edges: the
:data:`~omnirelay.payload.codec.Placer` its puts hand the codec places each tensor of the
backend's device in a :class:`~omnirelay.connectors.device.channel.DeviceProducer` block,
under a key of its own, and the slot's object carries the block's reference. The
connector records the block keys with the slot and releases them when the slot goes
(consumed and reaped, cleaned up, a dead reader's claim ended, closed). The pool is made
on the first tensor (so a stage that never sends one allocates nothing). A tensor the
pool cannot take — below ``min_bytes`` (faster through the host), the pool full, the
arena or its IPC export failing — takes the host path: never a failed put; the fallbacks
are counted and the last reason kept for ``health``.

:class:`DeviceReceiver` — on a connector whose stage receives on GPU-direct edges: the
:data:`~omnirelay.payload.codec.DeviceTaker` its gets hand the codec decodes the
reference as untrusted input, checks it against the region's dtype and shape, and copies
the block out through a :class:`~omnirelay.connectors.device.channel.DeviceImporter`
onto this stage's device, inside the slot's claim. Whatever it cannot serve (malformed,
stale, forged, a producer gone) is a :class:`~omnirelay.errors.PayloadDecodeError`: the
get is FAILED with the reason, never another object's bytes.

Both work over a :class:`DeviceBackend`: CUDA (:class:`CudaBackend`), or a fake in tests.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from omnirelay.connectors import owners
from omnirelay.connectors.device.channel import (
    MIN_BYTES,
    Arena,
    DeviceImporter,
    DeviceProducer,
    Opener,
    StaleBlockError,
)
from omnirelay.connectors.device.refs import DeviceRefError, decode_ref, encode_ref
from omnirelay.errors import PayloadDecodeError
from omnirelay.payload.dtypes import TORCH_BY_DTYPE

__all__ = ["CudaBackend", "DeviceBackend", "DeviceReceiver", "DeviceSender"]

_ARENAS = itertools.count(1)


class DeviceBackend(Protocol):
    """Where GPU-direct tensors live: which tensors, how an arena is made and opened."""

    def holds(self, tensor: torch.Tensor) -> bool: ...
    def arena(self, capacity: int, device: str | None, like: torch.Tensor) -> Arena: ...
    def opener(self) -> Opener: ...


class CudaBackend:
    """CUDA IPC (:mod:`omnirelay.connectors.device.cuda`)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def arena(self, capacity: int, device: str | None, like: torch.Tensor) -> Arena:
        from omnirelay.connectors.device.cuda import CudaArena

        return CudaArena(capacity, device or like.device)

    def opener(self) -> Opener:
        from omnirelay.connectors.device.cuda import CudaOpener

        return CudaOpener()


class DeviceSender:
    """See the module docstring. ``device``: where the pool lives (the stage's device;
    None: that of the first tensor)."""

    def __init__(
        self, backend: DeviceBackend, *, device: str | None, capacity: int, min_bytes: int = MIN_BYTES
    ) -> None:
        self.backend = backend
        self.device = device
        self.capacity = capacity
        self.min_bytes = min_bytes
        self._producer: DeviceProducer | None = None
        self._unavailable: str | None = None  # why the pool could not be made (once)
        self._keys = itertools.count(1)
        self._closed = False
        self._lock = threading.Lock()
        self.num_puts = 0
        self.bytes_put = 0
        self.num_fallbacks = 0
        self.last_fallback: str | None = None

    def placer(self, placed: list[str]) -> Callable[[torch.Tensor], bytes | None]:
        """The placer of one put: the keys of the blocks it takes are appended to ``placed``."""
        return lambda tensor: self.place(tensor, placed)

    def place(self, tensor: torch.Tensor, placed: list[str]) -> bytes | None:
        if not self.backend.holds(tensor):
            return None
        spec = TORCH_BY_DTYPE.get(tensor.dtype)
        if spec is None or tensor.numel() * spec.itemsize < self.min_bytes:
            return None  # the host path by design: small tensors cross faster through it
        producer = self._producer or self._open(tensor)
        if producer is None:
            return None
        key = str(next(self._keys))
        src = tensor.detach()  # the pool's copy is data, never part of a graph
        if src.is_conj():
            src = src.resolve_conj()
        if src.is_neg():
            src = src.resolve_neg()
        try:
            ref = producer.put(key, src)
        except Exception as exc:  # a device error: this object goes by the host
            self._fallback(f"{type(exc).__name__}: {exc}")
            return None
        if ref is None:
            self._fallback(
                f"device pool full ({producer.pool.largest_free} of {producer.pool.capacity} bytes free "
                f"in one range; {ref_bytes(tensor)} needed)"
            )
            return None
        placed.append(key)
        with self._lock:
            self.num_puts += 1
            self.bytes_put += ref.nbytes
        return encode_ref(ref)

    def _open(self, like: torch.Tensor) -> DeviceProducer | None:
        with self._lock:
            if self._closed or self._unavailable is not None:
                reason = "the connector is closed" if self._closed else self._unavailable
            elif self._producer is not None:
                return self._producer
            else:
                try:
                    arena = self.backend.arena(self.capacity, self.device, like)
                    self._producer = DeviceProducer(
                        arena, producer=str(owners.self_owner()), arena_id=next(_ARENAS), min_bytes=0
                    )
                    return self._producer
                except Exception as exc:  # no arena, or no IPC export of it: the host path
                    reason = self._unavailable = f"no device pool: {type(exc).__name__}: {exc}"
        self._fallback(reason or "")
        return None

    def _fallback(self, reason: str) -> None:
        with self._lock:
            self.num_fallbacks += 1
            self.last_fallback = reason

    def release(self, keys: list[str]) -> None:
        """Free the blocks of a slot that went (idempotent)."""
        producer = self._producer
        if producer is None:
            return
        for key in keys:
            try:
                producer.release(key)
            except Exception as exc:  # the device failed: the block is lost until close
                self._fallback(f"cannot release a device block: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Free the pool. Stamps are not cleared: a reader still copying (its claim made
        before the close) finishes, and the backend keeps the memory it maps alive."""
        with self._lock:
            self._closed = True
            producer, self._producer = self._producer, None
        if producer is not None:
            producer.close()

    def stats(self) -> dict[str, int]:
        producer = self._producer
        with self._lock:
            return {
                "num_device_puts": self.num_puts,
                "device_bytes_put": self.bytes_put,
                "num_device_fallbacks": self.num_fallbacks,
                "device_blocks": len(producer.keys()) if producer is not None else 0,
                "device_pool_bytes": producer.pool.used_bytes if producer is not None else 0,
            }


def ref_bytes(tensor: torch.Tensor) -> int:
    spec = TORCH_BY_DTYPE.get(tensor.dtype)
    return tensor.numel() * (spec.itemsize if spec is not None else tensor.element_size())


class DeviceReceiver:
    """See the module docstring. ``device``: where received tensors are copied (the
    stage's device; None: the producer's)."""

    def __init__(self, backend: DeviceBackend, *, device: str | None) -> None:
        self.backend = backend
        self.device = torch.device(device) if device else None
        self._importer: DeviceImporter | None = None
        self._lock = threading.Lock()
        self.num_gets = 0

    def _get_importer(self) -> DeviceImporter:
        with self._lock:
            if self._importer is None:
                self._importer = DeviceImporter(self.backend.opener(), self.device)
            return self._importer

    def take(self, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``data`` refers to, on this stage's device; PayloadDecodeError if it
        cannot be served."""
        try:
            ref = decode_ref(data)
        except DeviceRefError as exc:
            raise PayloadDecodeError(f"bad GPU-direct reference: {exc}") from exc
        if ref.dtype != str(dtype).removeprefix("torch.") or ref.shape != tuple(shape):
            raise PayloadDecodeError(
                f"bad GPU-direct reference: it names a {ref.dtype} tensor of shape {list(ref.shape)}, "
                f"the payload a {dtype} one of shape {list(shape)}"
            )
        try:
            out = self._get_importer().take(ref)
        except StaleBlockError as exc:
            raise PayloadDecodeError(f"stale GPU-direct reference: {exc}") from exc
        except Exception as exc:  # the arena cannot be opened or read (its producer is gone)
            raise PayloadDecodeError(
                f"cannot copy the GPU-direct tensor of producer {ref.arena.producer}: {type(exc).__name__}: {exc}"
            ) from exc
        with self._lock:
            self.num_gets += 1
        return out

    def forget_dead(self) -> int:
        """Close the arenas of producers that died (their memory went with them)."""
        importer = self._importer
        if importer is None:
            return 0
        dead = 0
        for producer in importer.producers():
            pid, _, start = producer.partition(".")
            try:
                owner = owners.OwnerId(int(pid), int(start))
            except ValueError:
                continue
            if not owners.owner_alive(owner):
                dead += importer.forget(producer)
        return dead

    def close(self) -> None:
        with self._lock:
            importer, self._importer = self._importer, None
        if importer is not None:
            importer.close()

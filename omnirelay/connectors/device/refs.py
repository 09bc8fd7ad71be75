"""What a GPU-direct object carries instead of its tensor's bytes (untrusted on decode).

* :class:`ArenaHandle` — how another process opens the producer's arena: the backend,
  the producer's identity (pid and start time, like every shm owner name), the arena's
  id, device and size, and the backend's IPC fields (for CUDA, those of
  ``torch.UntypedStorage._share_cuda_``).
* :class:`DeviceRef` — one tensor in one block of that arena: the block's offset and
  generation, the dtype, the shape and the byte count.

:func:`decode_ref` checks everything a reader relies on before any of it reaches a
device call: types (msgspec), a known dtype, the byte count equal to the shape's, the
block inside the arena and aligned, bounded handle sizes. A ref that fails is a
:class:`DeviceRefError` (the get fails, like a corrupt object).
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from omnirelay.connectors.device.pool import ALIGN, STAMP_BYTES
from omnirelay.payload.dtypes import TORCH_BY_NAME
from omnirelay.payload.wire import MAX_DIMS

__all__ = ["BACKENDS", "ArenaHandle", "DeviceRef", "DeviceRefError", "check_ref", "decode_ref", "encode_ref"]

BACKENDS = ("cuda", "fake")
_Handle = Annotated[bytes, msgspec.Meta(max_length=256)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class DeviceRefError(ValueError):
    """A device reference that no reader may act on."""


class ArenaHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str
    producer: Annotated[str, msgspec.Meta(max_length=64)]
    arena_id: _NonNegative
    device: _NonNegative
    capacity: Annotated[int, msgspec.Meta(gt=0)]
    handle: _Handle
    storage_bytes: _NonNegative = 0
    storage_offset: _NonNegative = 0
    ref_counter_handle: _Handle = b""
    ref_counter_offset: _NonNegative = 0
    event_handle: _Handle = b""
    event_sync_required: bool = False


class DeviceRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    arena: ArenaHandle
    offset: _NonNegative
    nbytes: _NonNegative
    generation: Annotated[int, msgspec.Meta(ge=1)]
    dtype: str
    shape: Annotated[tuple[_NonNegative, ...], msgspec.Meta(max_length=MAX_DIMS)]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(DeviceRef)


def encode_ref(ref: DeviceRef) -> bytes:
    return _ENCODER.encode(ref)


def decode_ref(data: bytes | memoryview) -> DeviceRef:
    """A checked :class:`DeviceRef` from its bytes (:class:`DeviceRefError` otherwise)."""
    try:
        ref = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise DeviceRefError(f"malformed device reference: {exc}") from exc
    check_ref(ref)
    return ref


def check_ref(ref: DeviceRef) -> None:
    arena = ref.arena
    if arena.backend not in BACKENDS:
        raise DeviceRefError(f"unknown device backend {arena.backend!r}; known: {', '.join(BACKENDS)}")
    spec = TORCH_BY_NAME.get(ref.dtype)
    if spec is None:
        raise DeviceRefError(f"unknown dtype {ref.dtype!r}")
    if math.prod(ref.shape) * spec.itemsize != ref.nbytes:
        raise DeviceRefError(
            f"{ref.nbytes} bytes do not hold a {ref.dtype} tensor of shape {list(ref.shape)}"
        )
    if ref.offset % ALIGN:
        raise DeviceRefError(f"block offset {ref.offset} is not aligned to {ALIGN}")
    if ref.offset + STAMP_BYTES + ref.nbytes > arena.capacity:
        raise DeviceRefError(
            f"block [{ref.offset}, +{STAMP_BYTES + ref.nbytes}) lies outside the {arena.capacity}-byte arena"
        )

"""The payload wire format: a msgpack header describing the object tree, then raw tensor regions.

Layout (version 1, little endian)::

    offset 0   prefix, 20 bytes: magic b"ORLY" | u16 version | u16 flags (0) | u32 header_len | u64 total_len
    offset 20  header: msgpack array [regions, tree]
                 regions: [[kind, dtype, shape, offset, nbytes], ...]
                   kind "torch" (dtype = torch name, e.g. "bfloat16"), "numpy" (dtype = numpy
                   dtype.str, e.g. "<f4") or "bytes" (dtype "uint8"); offset is relative to
                   data_start, a multiple of 64, increasing; nbytes = prod(shape) * itemsize.
                   kind "device": a tensor of that torch dtype and shape left on a GPU of
                   the host (a GPU-direct edge, docs/protocol.md §3.9); the region holds
                   its device reference (at most MAX_DEVICE_REF bytes), not its data
                 tree: the object, in msgpack, with msgpack extension values for what
                   msgpack cannot say:
                   ext 1 = region reference (u32 index into regions),
                   ext 2 = tuple (msgpack array of its items),
                   ext 3 = registered struct (msgpack [wire name, {field: value}]; a field
                           whose value is its default object is omitted)
                   bytes of 4 KiB or more travel as a "bytes" region, smaller ones inline.
    zero padding up to data_start = align64(20 + header_len)
    regions, each at data_start + offset, zero padding between; total_len ends the last one
    (or the header when there are none).

This module holds what both directions share: the constants, the prefix, and the header's
msgspec types. ``encoder.py`` writes the format, ``decoder.py`` reads it.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Final, Literal

import msgspec

from omnirelay.errors import PayloadDecodeError, PayloadMagicError, PayloadTruncatedError, PayloadVersionError

__all__ = [
    "ALIGNMENT",
    "EXT_REGION",
    "EXT_STRUCT",
    "EXT_TUPLE",
    "HEADER_DECODER",
    "MAGIC",
    "MAX_DEVICE_REF",
    "MAX_DIMS",
    "PREFIX",
    "PREFIX_SIZE",
    "U32",
    "WIRE_VERSION",
    "Header",
    "Region",
    "align",
    "byte_view",
    "read_prefix",
]

MAGIC: Final = b"ORLY"
WIRE_VERSION: Final = 1
ALIGNMENT: Final = 64
PREFIX = struct.Struct("<4sHHIQ")
PREFIX_SIZE: Final = PREFIX.size  # 20
U32 = struct.Struct("<I")

EXT_REGION: Final = 1
EXT_TUPLE: Final = 2
EXT_STRUCT: Final = 3

#: The largest device reference a "device" region may hold (a CUDA one is ~300 bytes).
MAX_DEVICE_REF: Final = 2048

#: numpy 1.x supports 32 dimensions; more would encode but not decode everywhere.
MAX_DIMS: Final = 32


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


class Region(msgspec.Struct, array_like=True, frozen=True):
    """One entry of the header's region table (the encoder writes the same fields as a
    plain tuple: msgpack cannot tell them apart)."""

    kind: Literal["torch", "numpy", "bytes", "device"]
    dtype: str
    shape: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_DIMS)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]


class Header(msgspec.Struct, array_like=True, frozen=True):
    regions: list[Region]
    tree: msgspec.Raw


HEADER_DECODER = msgspec.msgpack.Decoder(Header)


def byte_view(buf: Any) -> memoryview:
    """``buf`` as a flat memoryview of bytes (no copy)."""
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1:
        return buf
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def read_prefix(mv: memoryview) -> tuple[int, int]:
    """Validate the prefix; return ``(header_len, total_len)``."""
    if len(mv) < PREFIX_SIZE:
        if bytes(mv[:4]) != MAGIC[: len(mv)]:
            raise PayloadMagicError(f"not an omnirelay payload: starts with {bytes(mv[:4])!r}")
        raise PayloadTruncatedError(
            f"buffer of {len(mv)} bytes is shorter than the {PREFIX_SIZE}-byte prefix"
        )
    magic, version, flags, header_len, total = PREFIX.unpack_from(mv)
    if magic != MAGIC:
        raise PayloadMagicError(f"not an omnirelay payload: starts with {magic!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise PayloadVersionError(f"payload wire version {version}; this build reads version {WIRE_VERSION}")
    if flags:
        raise PayloadDecodeError(f"payload has unknown flags 0x{flags:04x}")
    if total < PREFIX_SIZE + header_len:
        raise PayloadDecodeError(
            f"total_len {total} is shorter than the prefix and the {header_len}-byte header"
        )
    return header_len, total

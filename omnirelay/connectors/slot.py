"""The fixed header at the start of every shared-memory slot.

A slot is a /dev/shm file, mapped once by its producer and reused for many objects.
Its first bytes are a header whose ``state`` word tells who owns the slot right now::

    FREE ──put──► WRITING ──publish (link key name)──► PUBLISHED ──claim (rename)──► CLAIMED
      ▲                                                    │                           │
      └───────────── cleanup (unlink key name) ◄───────────┘                           │
      └──────────────────────────── consumer done copying ◄────────────────────────────┘
    any ──producer trims the pool or closes──► RETIRED (then the file is unlinked)

Only the owner of the current state writes the next one: the producer writes WRITING,
PUBLISHED and RETIRED; the consumer that won the claim writes CLAIMED and FREE. The
producer learns that an object was consumed by reading FREE in its own mapping (no
syscall), which is what makes ``reap_consumed`` cheap.

Layout (little endian)::

    0   magic        8s   b"ORLYSLT1"
    8   state        u32
    12  key_len      u32  UTF-8 bytes of the transfer key
    16  payload_len  u64
    24  seq          u64  bumped on every publish
    32  owner_pid    u32
    36  claimer_pid  u32
    40  owner_start  u64
    48  claimer_start u64
    56  created_ns   u64  wall clock of the publish (for audits: age)
    64  from_stage   i32
    68  to_stage     i32
    128 key bytes, then the payload at the next 64-byte boundary
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLAIMED",
    "FREE",
    "HEADER_SIZE",
    "MAGIC",
    "PUBLISHED",
    "RETIRED",
    "WRITING",
    "SlotHeader",
    "payload_offset",
    "read_header",
    "read_state",
    "write_claim",
    "write_publish_header",
    "write_state",
]

MAGIC = b"ORLYSLT1"
FREE, WRITING, PUBLISHED, CLAIMED, RETIRED = 0, 1, 2, 3, 4
STATE_NAMES = {
    FREE: "free",
    WRITING: "writing",
    PUBLISHED: "published",
    CLAIMED: "claimed",
    RETIRED: "retired",
}
HEADER_SIZE = 128

_FIXED = struct.Struct("<8sIIQQIIQQQii")
_STATE = struct.Struct("<I")
_OFF_STATE = 8
_OFF_CLAIMER_PID = 36
_OFF_CLAIMER_START = 48
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def payload_offset(key_len: int) -> int:
    return (HEADER_SIZE + key_len + 63) & ~63


@dataclass(frozen=True)
class SlotHeader:
    state: int
    key_len: int
    payload_len: int
    seq: int
    owner_pid: int
    claimer_pid: int
    owner_start: int
    claimer_start: int
    created_ns: int
    from_stage: int
    to_stage: int
    key: bytes

    @property
    def payload_off(self) -> int:
        return payload_offset(self.key_len)


def read_header(buf: Any, size: int) -> SlotHeader | str:
    """Parse a slot header from ``buf`` (``size`` bytes). Returns an error string if the
    bytes are not a valid slot (never raises on bad bytes)."""
    if size < HEADER_SIZE:
        return f"object is {size} bytes, smaller than the {HEADER_SIZE}-byte slot header"
    (magic, state, key_len, payload_len, seq, opid, cpid, ostart, cstart, created, src, dst) = (
        _FIXED.unpack_from(buf, 0)
    )
    if magic != MAGIC:
        return f"bad slot magic {magic!r} (not an omnirelay object)"
    if state not in STATE_NAMES:
        return f"bad slot state {state}"
    off = payload_offset(key_len)
    if off + payload_len > size:
        return f"slot header claims {off + payload_len} bytes but the object has {size}"
    key = bytes(buf[HEADER_SIZE : HEADER_SIZE + key_len])
    return SlotHeader(state, key_len, payload_len, seq, opid, cpid, ostart, cstart, created, src, dst, key)


def read_state(buf: Any) -> int:
    return int(_STATE.unpack_from(buf, _OFF_STATE)[0])


def write_state(buf: Any, state: int) -> None:
    _STATE.pack_into(buf, _OFF_STATE, state)


def write_claim(buf: Any, pid: int, start: int) -> None:
    _U32.pack_into(buf, _OFF_CLAIMER_PID, pid)
    _U64.pack_into(buf, _OFF_CLAIMER_START, start)
    _STATE.pack_into(buf, _OFF_STATE, CLAIMED)


def write_publish_header(
    buf: Any,
    *,
    key: bytes,
    payload_len: int,
    seq: int,
    owner_pid: int,
    owner_start: int,
    created_ns: int,
    from_stage: int,
    to_stage: int,
) -> None:
    """Write everything but the payload, with state WRITING (the caller flips it later)."""
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        WRITING,
        len(key),
        payload_len,
        seq,
        owner_pid,
        0,
        owner_start,
        0,
        created_ns,
        from_stage,
        to_stage,
    )
    buf[HEADER_SIZE : HEADER_SIZE + len(key)] = key

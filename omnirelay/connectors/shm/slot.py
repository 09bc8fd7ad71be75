"""The fixed header at the start of every shared-memory slot.

A slot is a /dev/shm file, mapped once by its producer and reused for many objects.
Its first bytes are a header whose ``state`` word tells who owns the slot right now::

    FREE ──put──► WRITING ──publish (link key name)──► PUBLISHED ──claim (CAS)──► CLAIMED
      ▲             │  ▲                                    │                        │
      │   reader    ▼  │ publish (CAS fails: notice again)  │                        │
      │            WAITING                                  │                        │
      └──────────── cleanup (CAS, unlink key name) ◄────────┘                        │
      └───────────────── consumer done copying (producer's reap unlinks the name) ◄─┘
    any ──producer trims the pool or closes──► RETIRED (then the file is unlinked)

Only the owner of the current state writes the next one: the producer writes WRITING,
PUBLISHED and RETIRED; the consumer that won the claim writes CLAIMED and FREE. The
producer learns that an object was consumed by reading FREE in its own mapping (no
syscall), which is what makes ``reap_consumed`` cheap.

A small object's arrival notice may go out *before* it is written (the receiver's
wake-up then overlaps the encoding). A reader that finds the slot still WRITING for the
notice's ``seq`` waits briefly; if the producer is not done by then, the reader CASes
``WRITING(seq) -> WAITING(seq)`` and goes back to sleep. The producer publishes with a
CAS ``WRITING(seq) -> PUBLISHED(seq)``; when that fails the word is WAITING, so it
stores PUBLISHED and sends the notice again. No wake-up is lost: the reader's CAS and the
producer's CAS cannot both succeed.

State and publish sequence share one 8-byte *stamp* word, ``state | seq << 8``. The one
race between processes, readers claiming an object, is a compare-and-swap of the stamp
``PUBLISHED(seq) -> CLAIMED(seq)`` (:func:`claim`, on an ``atomics.Word``): exactly one
reader wins, and since ``seq`` grows with every publish of the slot, a stamp names one
publish — a reader holding an old arrival notice can never claim the slot's next object.

Layout (little endian)::

    0   magic         8s   b"ORLYSLT2"
    8   stamp         u64  state (low 8 bits) | seq << 8   (atomic)
    16  key_len       u32  UTF-8 bytes of the transfer key
    20  owner_pid     u32
    24  payload_len   u64
    32  owner_start   u64
    40  claimer_pid   u32
    44  from_stage    i32
    48  claimer_start u64
    56  created_ns    u64  wall clock of the publish (for audits: age)
    64  to_stage      i32
    72  claim_seq     u64  the seq the claimer's record (pid, start) belongs to (atomic)
    128 key bytes, then the payload at the next 64-byte boundary

A claimer writes its record (pid, start) and then ``claim_seq`` right after winning the
CAS. The producer judges a CLAIMED slot abandoned only from a record of *this* claim
(``claim_seq == seq``) naming a dead process — never from a record not yet written, which
would free a slot under a reader's feet.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnirelay.connectors.shm import names

if TYPE_CHECKING:
    from omnirelay.connectors.shm.atomics import Word

__all__ = [
    "CLAIMED",
    "CLAIM_LAYOUT",
    "CLAIM_SEQ_OFFSET",
    "FREE",
    "HEADER_SIZE",
    "MAGIC",
    "PUBLISHED",
    "RETIRED",
    "STAMP_OFFSET",
    "WAITING",
    "WRITING",
    "SlotHeader",
    "claim",
    "claimer_record",
    "key_len_of",
    "owner_of",
    "payload_offset",
    "read_header",
    "read_payload_span",
    "read_state",
    "record_claim",
    "stamp",
    "write_claim",
    "write_claimer",
    "write_claimer_record",
    "write_publish_header",
    "write_state",
]

MAGIC = b"ORLYSLT2"
FREE, WRITING, PUBLISHED, CLAIMED, RETIRED, WAITING = 0, 1, 2, 3, 4, 5
STATE_NAMES = {
    FREE: "free",
    WRITING: "writing",
    PUBLISHED: "published",
    CLAIMED: "claimed",
    RETIRED: "retired",
    WAITING: "writing (a reader waits)",
}
HEADER_SIZE = 128
#: Byte offset of the stamp word (8-byte aligned, for the atomic operations).
STAMP_OFFSET = 8
#: Byte offset of the claim record's sequence word (8-byte aligned, atomic).
CLAIM_SEQ_OFFSET = 72

_FIXED = struct.Struct("<8sQIIQQIiQQiIQ")
#: Everything after the stamp (offset 16 onwards): the publish writes it around the stamp.
_AFTER_STAMP = struct.Struct("<IIQQIiQQiIQ")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_OFF_KEY_LEN = 16
_OFF_PAYLOAD_LEN = 24
_LENGTHS = struct.Struct("<I4xQ")  # key_len, payload_len
_OFF_CLAIMER_PID = 40
_OFF_CLAIMER_START = 48

#: The offsets and states the C extension's whole-claim call was compiled for
#: (``atomics`` uses it only if they agree).
CLAIM_LAYOUT = (STAMP_OFFSET, _OFF_KEY_LEN, _OFF_PAYLOAD_LEN, _OFF_CLAIMER_PID, _OFF_CLAIMER_START,
                CLAIM_SEQ_OFFSET, HEADER_SIZE, PUBLISHED, CLAIMED)  # fmt: skip


def stamp(state: int, seq: int) -> int:
    """The stamp word of ``state`` for publish ``seq``."""
    return (seq << 8) | state


def payload_offset(key_len: int) -> int:
    return (HEADER_SIZE + key_len + 63) & ~63


def key_len_of(head: Any) -> int:
    """The key length field of a header (the first ``HEADER_SIZE`` bytes)."""
    return int(_U32.unpack_from(head, _OFF_KEY_LEN)[0])


@dataclass(frozen=True)
class SlotHeader:
    state: int
    seq: int
    key_len: int
    payload_len: int
    owner_pid: int
    claimer_pid: int
    owner_start: int
    claimer_start: int
    created_ns: int
    from_stage: int
    to_stage: int
    key: bytes
    claim_seq: int = 0

    @property
    def payload_off(self) -> int:
        return payload_offset(self.key_len)


_OWNER_PID = struct.Struct("<I")
_OWNER_START = struct.Struct("<Q")


def owner_of(buf: Any) -> names.OwnerId | None:
    """The producer (pid, start time) named in a slot's header; None if it is no slot."""
    if len(buf) < HEADER_SIZE or bytes(buf[:8]) != MAGIC:
        return None
    return names.OwnerId(_OWNER_PID.unpack_from(buf, 20)[0], _OWNER_START.unpack_from(buf, 32)[0])


def read_header(buf: Any, size: int) -> SlotHeader | str:
    """Parse a slot header from ``buf`` (``size`` bytes). Returns an error string if the
    bytes are not a valid slot (never raises on bad bytes)."""
    if size < HEADER_SIZE:
        return f"object is {size} bytes, smaller than the {HEADER_SIZE}-byte slot header"
    (magic, word, key_len, opid, payload_len, ostart, cpid, src, cstart, created, dst, _pad, claim_seq) = (
        _FIXED.unpack_from(buf, 0)
    )
    if magic != MAGIC:
        return f"bad slot magic {magic!r} (not an omnirelay object)"
    state = word & 0xFF
    if state not in STATE_NAMES:
        return f"bad slot state {state}"
    off = payload_offset(key_len)
    if off + payload_len > size:
        return f"slot header claims {off + payload_len} bytes but the object has {size}"
    key = bytes(buf[HEADER_SIZE : HEADER_SIZE + key_len])
    return SlotHeader(
        state, word >> 8, key_len, payload_len, opid, cpid, ostart, cstart, created, src, dst, key, claim_seq
    )


def read_payload_span(buf: Any, size: int, key: bytes) -> tuple[int, int] | None:
    """``(payload offset, payload length)`` of a slot that holds ``key``; None if the header
    names another key or its lengths do not fit in ``size`` bytes (the hot path's check)."""
    key_len, payload_len = _LENGTHS.unpack_from(buf, _OFF_KEY_LEN)
    off = (HEADER_SIZE + key_len + 63) & ~63
    if key_len != len(key) or off + payload_len > size or buf[HEADER_SIZE : HEADER_SIZE + key_len] != key:
        return None
    return off, payload_len


def read_state(buf: Any) -> int:
    """The state of a slot from a plain (non-atomic) read; for audits and tests."""
    return int(_U64.unpack_from(buf, STAMP_OFFSET)[0]) & 0xFF


def write_state(buf: Any, state: int) -> None:
    """Set the state, keeping the sequence (a plain write: only for buffers no other
    process races on, e.g. in tests; live slots use ``atomics.Word``)."""
    word = _U64.unpack_from(buf, STAMP_OFFSET)[0]
    _U64.pack_into(buf, STAMP_OFFSET, (word & ~0xFF) | state)


def write_claimer(buf: Any, pid: int, start: int) -> None:
    """Record who claimed the object (the claim itself is the stamp CAS)."""
    write_claimer_record(buf, claimer_record(pid, start))


def claimer_record(pid: int, start: int) -> tuple[bytes, bytes]:
    """A claimer's record, encoded once (for :func:`write_claimer_record`)."""
    return _U32.pack(pid), _U64.pack(start)


def write_claimer_record(buf: Any, record: tuple[bytes, bytes]) -> None:
    buf[_OFF_CLAIMER_PID : _OFF_CLAIMER_PID + 4] = record[0]
    buf[_OFF_CLAIMER_START : _OFF_CLAIMER_START + 8] = record[1]


def claim(
    buf: Any, size: int, word: Word, claim_word: Word, seq: int, key: bytes, pid: int, start: int
) -> tuple[int, int] | None:
    """A reader's claim of publish ``seq`` of the slot mapped as ``buf`` (``size`` bytes):
    CAS the stamp ``PUBLISHED(seq) -> CLAIMED(seq)``, check that the header names ``key``
    and that the payload fits (else put the stamp back: not ours to take), then record
    the claimer (``pid``, ``start``). ``(payload offset, payload length)``, or None if this
    reader did not win or the slot holds something else. The C extension makes the same
    steps in one call (``atomics.Backend.claim``)."""
    base = seq << 8  # stamp(state, seq) is base | state
    if not word.cas(base | PUBLISHED, base | CLAIMED):
        return None
    span = read_payload_span(buf, size, key)
    if span is None:
        word.store(base | PUBLISHED)
        return None
    record_claim(buf, claim_word, pid, start, seq)
    return span


def record_claim(buf: Any, claim_word: Word, pid: int, start: int, seq: int) -> None:
    """The claimer's record for publish ``seq``: who (plain writes), then which claim it is
    (a release store of ``claim_seq``, so the producer never reads half a record)."""
    write_claimer(buf, pid, start)
    claim_word.store(seq)


def write_claim(buf: Any, pid: int, start: int) -> None:
    """A complete claim with plain writes: record, its seq, state CLAIMED (tests simulate
    consumers with it)."""
    write_claimer(buf, pid, start)
    word = _U64.unpack_from(buf, STAMP_OFFSET)[0]
    _U64.pack_into(buf, CLAIM_SEQ_OFFSET, word >> 8)
    write_state(buf, CLAIMED)


def write_publish_header(
    buf: Any,
    *,
    key: bytes,
    payload_len: int,
    owner_pid: int,
    owner_start: int,
    created_ns: int,
    from_stage: int,
    to_stage: int,
) -> None:
    """Write everything but the payload and the stamp: the caller has stored
    ``stamp(WRITING, seq)`` atomically before (readers may be watching the word) and
    publishes later by storing ``stamp(PUBLISHED, seq)``. Only the slot's owner calls
    this, while no reader can claim the slot."""
    buf[0:8] = MAGIC
    _AFTER_STAMP.pack_into(
        buf,
        16,
        len(key),
        owner_pid,
        payload_len,
        owner_start,
        0,
        from_stage,
        0,
        created_ns,
        to_stage,
        0,
        0,
    )
    buf[HEADER_SIZE : HEADER_SIZE + len(key)] = key

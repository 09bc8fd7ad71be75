"""Messages of the ``nixl`` connector's control channel and the layout of a registered object.

Two ZeroMQ channels carry them (msgpack, tagged):

* **notices**, producer → the reading stage's PULL socket (its endpoint, one per stage):
  :class:`Notice` (an object is published: where it lies, who to claim it from) and
  :class:`Retract` (it was withdrawn unclaimed: forget the notice);
* **claims**, reader DEALER → producer ROUTER (the endpoint a notice names): :class:`Claim`
  → :class:`Grant` (the object is the reader's; with the registration metadata the reader
  has not seen yet) or :class:`Gone` (withdrawn, or never there); then, after the READ,
  :class:`Ack` (the producer may reuse the memory).

An object's registered buffer holds ``HEADER`` bytes (magic and object id), the encoded
payload, and a trailer repeating the object id: a READ that met a reused buffer (a reader
that outlived its lease) fails the check instead of decoding someone else's object.
"""

from __future__ import annotations

import struct

import msgspec

__all__ = [
    "HEADER",
    "Ack",
    "Claim",
    "Gone",
    "Grant",
    "Notice",
    "Retract",
    "check_frame",
    "decode_claim_reply",
    "decode_notice",
    "decode_to_producer",
    "encode",
    "frame_size",
    "write_frame",
]

MAGIC = b"ORNX"
#: payload offset in a buffer: a multiple of the codec's tensor alignment
HEADER = 64
_HEAD = struct.Struct("<4sIQ")
_TRAIL = struct.Struct("<Q")


class Notice(msgspec.Struct, tag="n", array_like=True):
    key: bytes
    obj_id: int
    nbytes: int  # payload bytes
    addr: int  # of the buffer in the producer's memory
    agent: str  # the producer's NIXL agent
    claim_at: str  # the producer's claim endpoint
    from_stage: int
    to_stage: int


class Retract(msgspec.Struct, tag="r", array_like=True):
    key: bytes
    obj_id: int


class Claim(msgspec.Struct, tag="c", array_like=True):
    req: int
    obj_id: int
    key: bytes
    reader: str  # the reader's NIXL agent
    #: the NIXL agent the notice named: the producer's incarnation (pid and a random
    #: part); another process answering at the same claim endpoint refuses the claim
    producer: str = ""


class Ack(msgspec.Struct, tag="a", array_like=True):
    obj_id: int
    ok: bool


class Grant(msgspec.Struct, tag="g", array_like=True):
    req: int
    obj_id: int
    metadata: bytes | None


class Gone(msgspec.Struct, tag="x", array_like=True):
    req: int
    obj_id: int
    reason: str


_ENCODER = msgspec.msgpack.Encoder()
_NOTICES = msgspec.msgpack.Decoder(Notice | Retract)
_TO_PRODUCER = msgspec.msgpack.Decoder(Claim | Ack)
_REPLIES = msgspec.msgpack.Decoder(Grant | Gone)


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def decode_notice(data: bytes) -> Notice | Retract | None:
    """None for anything malformed (a notice is a hint: a bad one is dropped)."""
    try:
        return _NOTICES.decode(data)
    except msgspec.DecodeError:
        return None


def decode_to_producer(data: bytes) -> Claim | Ack | None:
    try:
        return _TO_PRODUCER.decode(data)
    except msgspec.DecodeError:
        return None


def decode_claim_reply(data: bytes) -> Grant | Gone | None:
    try:
        return _REPLIES.decode(data)
    except msgspec.DecodeError:
        return None


def frame_size(nbytes: int) -> int:
    """Bytes a buffer needs for a payload of ``nbytes`` (and what a reader READs)."""
    return HEADER + nbytes + _TRAIL.size


def write_frame(view: memoryview, obj_id: int, nbytes: int) -> None:
    """Stamp header and trailer around a payload already written at ``HEADER``."""
    _HEAD.pack_into(view, 0, MAGIC, 0, obj_id)
    _TRAIL.pack_into(view, HEADER + nbytes, obj_id)


def check_frame(view: memoryview, obj_id: int, nbytes: int) -> str | None:
    """None when ``view`` holds object ``obj_id`` whole, else what is wrong."""
    magic, _, head_id = _HEAD.unpack_from(view, 0)
    (tail_id,) = _TRAIL.unpack_from(view, HEADER + nbytes)
    if magic != MAGIC:
        return "the buffer read holds no object"
    if head_id != obj_id or tail_id != obj_id:
        return (
            f"the buffer read holds object {head_id}/{tail_id}, not {obj_id} (reused after its lease ran out)"
        )
    return None

"""The adapter's own wire type: the finish flags around an opaque body.

* :class:`ChunkEnvelope` — what the adapter puts for one chunk and what the receiver
  reads back: ``body`` (whatever the stage's processor built — a registered struct such
  as :class:`~omnirelay.payload.OmniPayload`, or plain data — or ``None`` at a boundary
  with nothing new), ``is_finished`` (the request's last chunk: the end of the stream
  downstream) and ``is_segment_finished`` (a segment end of a streaming session).
* :func:`check_envelope` — why a received object is not a well-formed envelope, or None.

The adapter reads and writes the two flags only; it never looks inside ``body``, so the
transfer layer knows no model field. The sender wraps what the processor returned and
sets the flags from the chunk's admission (``save_async``). A processor that decides its
own finish flag (one that streams and knows better than the scheduler when its stream
ends) returns a :class:`ChunkEnvelope` itself; the sender then puts it as it is.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnirelay.payload.schema import register_struct

__all__ = ["ChunkEnvelope", "check_envelope"]


class ChunkEnvelope(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chunk as the adapter puts it (a registered struct: the codec carries it)."""

    body: Any = None
    is_finished: bool = False
    is_segment_finished: bool = False


register_struct(ChunkEnvelope)


def check_envelope(obj: Any) -> str | None:
    """None when ``obj`` is an envelope a receiver may commit, else what is wrong with it.

    The codec checks the flag types of what it decodes; an object handed over in process
    (or built by a processor) is checked here. An envelope with no body and no flag says
    nothing: it is never committed (docs/protocol.md §4.8).
    """
    if type(obj) is not ChunkEnvelope:
        return f"expected a ChunkEnvelope, got {type(obj).__name__}"
    for name in ("is_finished", "is_segment_finished"):
        value = getattr(obj, name)
        if type(value) is not bool:
            return f"ChunkEnvelope.{name} must be a bool, got {type(value).__name__}"
    if obj.body is None and not (obj.is_finished or obj.is_segment_finished):
        return "the envelope carries nothing (no body, no finish flag)"
    return None

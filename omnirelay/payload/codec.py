"""The payload wire codec: a msgpack header describing the object tree, then raw tensor regions.

Interface (the connectors are written against exactly this):

* :func:`plan_encode` ``(obj) -> EncodePlan`` — walk ``obj`` once, validate it, encode the
  header; tensors are only referenced. ``plan.nbytes`` is the exact encoded length.
* :meth:`EncodePlan.write_into` ``(buf) -> int`` — write the encoding into a writable buffer
  (a shared-memory slot), one copy per tensor, straight from the (possibly strided) source.
* :func:`encode` ``(obj) -> bytes`` — plan + write into a fresh buffer.
* :func:`decode` ``(buf, *, copy=True, stock=None)`` — rebuild the object; the same struct
  types come back. ``stock``: a stream's :class:`OutputStock` (tensors made ahead, while the
  stream was idle, for the header it repeats).
* :func:`peek_total_size` ``(buf) -> int`` — the encoded length, from the prefix alone.
* GPU-direct edges (docs/protocol.md §3.9): ``plan_encode(obj, place=)`` offers each
  tensor to a :data:`Placer` (a device pool), whose reference then travels instead of the
  bytes; ``decode(buf, device=)`` rebuilds such tensors with a :data:`DeviceTaker`.

Implemented in three modules, one role each: ``wire.py`` (the layout, documented there,
and what both directions share), ``encoder.py`` and ``decoder.py``.

Plain data supported at any depth: dict (str or int keys), list, tuple, str, int
(-2**63 .. 2**64-1), float, bool, None, bytes, torch.Tensor, numpy.ndarray (bool, integer,
float or complex dtypes) and registered structs (:func:`register_struct`). Subclasses of
str, int and float travel as the base type. Anything else is a
:class:`~omnirelay.errors.PayloadEncodeError` naming the type and its path in the object.
Decoding untrusted bytes raises only :class:`~omnirelay.errors.PayloadDecodeError`
(or a subclass), never an ``IndexError``, ``KeyError`` or ``struct.error``.
"""

from __future__ import annotations

from omnirelay.payload.decoder import DeviceTaker, OutputStock, decode, peek_total_size
from omnirelay.payload.encoder import EncodePlan, Placer, encode, plan_encode
from omnirelay.payload.schema import lookup_struct, register_struct, struct_spec
from omnirelay.payload.wire import ALIGNMENT, MAGIC, PREFIX_SIZE, WIRE_VERSION

__all__ = [
    "ALIGNMENT",
    "MAGIC",
    "PREFIX_SIZE",
    "WIRE_VERSION",
    "DeviceTaker",
    "EncodePlan",
    "OutputStock",
    "Placer",
    "decode",
    "encode",
    "lookup_struct",
    "peek_total_size",
    "plan_encode",
    "register_struct",
    "struct_spec",
]

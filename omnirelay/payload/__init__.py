"""omnirelay.payload: the typed stage-edge payload and its wire codec.

* :mod:`~omnirelay.payload.schema` — :class:`OmniPayload` (codes, meta, embed,
  hidden_states, ids, speaker, language, request_id, extras), :class:`Codes`,
  :class:`Meta`, and :func:`register_struct` for other families' structs.
* :mod:`~omnirelay.payload.codec` — :func:`plan_encode` / :meth:`EncodePlan.write_into`
  (one copy per tensor into a caller's buffer), :func:`encode`, :func:`decode`,
  :func:`peek_total_size`. The receiver gets back the same struct types the sender built.
  Implemented by ``wire`` (the format), ``encoder`` and ``decoder``.

This layer knows nothing of transports or requests (docs/design.md §1).
"""

from omnirelay.payload.codec import (
    ALIGNMENT,
    MAGIC,
    PREFIX_SIZE,
    WIRE_VERSION,
    EncodePlan,
    decode,
    encode,
    peek_total_size,
    plan_encode,
)
from omnirelay.payload.schema import (
    Codes,
    Meta,
    OmniPayload,
    TensorLike,
    register_struct,
)

__all__ = [
    "ALIGNMENT",
    "MAGIC",
    "PREFIX_SIZE",
    "WIRE_VERSION",
    "Codes",
    "EncodePlan",
    "Meta",
    "OmniPayload",
    "TensorLike",
    "decode",
    "encode",
    "peek_total_size",
    "plan_encode",
    "register_struct",
]

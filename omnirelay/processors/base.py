"""What every stage input processor shares: the chunk-id cross-check.

Processors turn one stage's per-step output into what the next stage should see
(docs/protocol.md §5). They run on the sender's save thread, in the producing stage's
process, and know nothing about transports. Each returns a typed
:class:`~omnirelay.payload.OmniPayload` (or ``None``: nothing to send this step); the
transfer adapter carries it, unread, in its own envelope, which also says whether the
chunk ends the stream.

* :func:`check_chunk_id` — the cross-check between the transfer adapter's put counter
  and the number of payloads a request's state has built.

Input errors (a step output of the wrong shape or type) raise
:class:`~omnirelay.errors.PayloadEncodeError`: the step cannot be turned into a payload,
and the message says which tensor, what shape was expected and what arrived.
"""

from __future__ import annotations

from omnirelay.errors import PayloadEncodeError

__all__ = ["check_chunk_id"]


def check_chunk_id(chunk_id: int, num_payloads_built: int, *, processor: str) -> None:
    """Raise unless ``chunk_id`` (successful puts so far) equals the payloads built so far.

    The processor runs on the send thread right before each put, so the two counters move
    together. A difference means a built payload was never put (or put twice); the
    emission rule would then pick the wrong chunk size or left context, silently.
    """
    if isinstance(chunk_id, bool) or not isinstance(chunk_id, int) or chunk_id < 0:
        raise PayloadEncodeError(f"{processor}: chunk_id must be an int >= 0, got {chunk_id!r}")
    if chunk_id != num_payloads_built:
        raise PayloadEncodeError(
            f"{processor}: chunk_id {chunk_id} does not match the {num_payloads_built} payload(s) "
            "this request's state has built; a payload was lost or put twice "
            "(chunk_id must count successful puts on this edge)"
        )

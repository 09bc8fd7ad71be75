"""What every stage input processor shares: the payload builder and input helpers.

Processors turn one stage's per-step output into what the next stage should see
(SPEC §5). They run on the sender's save thread, in the producing stage's process, and
know nothing about transports.

* :data:`Payload` — the value a processor returns. Until ``omnirelay.payload.schema``
  lands this is a plain dict shaped like ``OmniPayload``::

      {"codes": {"audio": Tensor}, "meta": {"finished": bool, "left_context_size": int, …},
       "embed": {…}, "hidden_states": {…}, "ids": {…}, "speaker": str, "language": str}

* :func:`make_payload` — the **one** place a payload is constructed. Switching every
  processor to the typed struct means changing this function and :data:`Payload` only.
* :func:`check_chunk_id` — the cross-check between the transfer adapter's put counter
  and the number of payloads a request's state has built.

Input errors (a step output of the wrong shape or type) raise
:class:`~omnirelay.errors.PayloadEncodeError`: the step cannot be turned into a payload,
and the message says which tensor, what shape was expected and what arrived.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from omnirelay.errors import PayloadEncodeError

__all__ = ["Payload", "check_chunk_id", "make_payload"]

#: What a processor returns. A plain dict for now; becomes ``OmniPayload`` later.
Payload: TypeAlias = dict[str, Any]


def make_payload(
    *,
    meta: dict[str, Any],
    codes: dict[str, Any] | None = None,
    embed: dict[str, Any] | None = None,
    hidden_states: dict[str, Any] | None = None,
    ids: dict[str, Any] | None = None,
    speaker: str | None = None,
    language: str | None = None,
) -> Payload:
    """Build one payload. Sections that are ``None`` are left out.

    ``meta`` is always present: every payload says whether it is the stream's last.
    """
    payload: Payload = {"meta": dict(meta)}
    if codes is not None:
        payload["codes"] = dict(codes)
    if embed is not None:
        payload["embed"] = dict(embed)
    if hidden_states is not None:
        payload["hidden_states"] = dict(hidden_states)
    if ids is not None:
        payload["ids"] = dict(ids)
    if speaker is not None:
        payload["speaker"] = speaker
    if language is not None:
        payload["language"] = language
    return payload


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

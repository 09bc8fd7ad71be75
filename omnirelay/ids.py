"""The external request id: the one place its rules live.

An external request id names one request across the whole pipeline (docs/design.md,
identities): clients choose it (``request_id=``, ``X-Request-Id``), and it becomes part
of transfer keys, log lines and metrics. It is untrusted input, checked at every boundary
it crosses — the API, a stage engine's admission, the transfer layer's sender and
receiver — by :func:`request_id_problem`, each boundary raising or reporting in its own
way (the API raises :class:`~omnirelay.errors.InvalidRequestError`; the transfer layer
records a failure for the request; the engine answers with an error output).

Usable: a ``str`` of 1 to :data:`MAX_REQUEST_ID_LEN` characters, none of them a control
character (C0/C1, DEL) or a lone surrogate. Any other character is fine (``/``, ``..``,
spaces, emoji): a backend that needs safe names maps keys to them.
"""

from __future__ import annotations

import unicodedata

__all__ = ["MAX_REQUEST_ID_LEN", "request_id_problem"]

MAX_REQUEST_ID_LEN = 256


def request_id_problem(request_id: object, name: str = "request_id") -> str | None:
    """Why ``request_id`` is not a usable external request id, or None when it is.

    ``name`` is how the message calls the value (``"request_id"``, ``"X-Request-Id"`` …).
    Called once per request at each boundary (and by a receiver once per chunk it waits
    for): the common id is printable, and ``str.isprintable`` settles that in one call.
    """
    if not isinstance(request_id, str):
        return f"{name} must be a str, got {type(request_id).__name__}"
    if not request_id:
        return f"{name} is empty; pass a non-empty id"
    if len(request_id) > MAX_REQUEST_ID_LEN:
        return f"{name} is {len(request_id)} characters long; the limit is {MAX_REQUEST_ID_LEN}"
    if request_id.isprintable():  # no control character, no lone surrogate
        return None
    for i, ch in enumerate(request_id):
        if unicodedata.category(ch) in ("Cc", "Cs"):
            return f"{name} contains a control character {ch!r} at position {i}; use printable characters"
    return None

"""What the send side asks of the processor that builds each chunk (docs/protocol.md §5).

The processor/sender relation is a small protocol, not a set of callbacks:

* :class:`BuildRequest` — what the processor sees for one chunk (plain data).
* :class:`ChunkProcessor` — ``build(request)`` makes the chunk's body (on a send worker,
  outside every lock); ``release(external_id, scope)`` drops the processor's state of an
  id, told by a :class:`ReleaseScope`: the end of a segment (``SEGMENT``, after its last
  chunk was put) or the retirement of the id's sender generation (``REQUEST``). Release is
  the sender telling its processor what it decided, on the id's lane, never a timer.
* :class:`StatelessProcessor` — a plain build function as a processor (no state to drop).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = ["BuildRequest", "ChunkProcessor", "ReleaseScope", "StatelessProcessor"]


class BuildRequest(NamedTuple):
    """What the processor sees for one chunk (on a send worker, outside every lock).

    Immutable; a NamedTuple because one is built per chunk on the send path (a frozen
    dataclass costs about four times as much to build)."""

    internal_id: str
    external_id: str
    #: The stage output of this step, as given to ``save_async``.
    output: Any
    #: The caller's snapshot of the request (must not be mutated after ``save_async``).
    context: Any
    #: docs/protocol.md §4.4 step 3: a segment end or the request's end.
    is_finished: bool
    is_request_finished: bool
    is_segment_finished: bool
    #: Successful puts of this request on this edge so far: the chunk id this payload is
    #: put under (processors cross-check it against the payloads they built).
    chunk_id: int


class ReleaseScope(enum.Enum):
    """Which of a processor's state of an id must go."""

    #: a segment of the request ended (its last chunk was put): per-segment state
    SEGMENT = "segment"
    #: the id's sender generation retired (finished, cancelled, failed): all of it
    REQUEST = "request"


@runtime_checkable
class ChunkProcessor(Protocol):
    """Builds the body of each chunk of one edge, and keeps per-id state (see the module
    docstring). ``build`` returns the body (opaque to the adapter); ``None`` means "nothing
    to send this step" (at a boundary an envelope with no body still carries the finish
    flags); a :class:`~omnirelay.transfer.envelope.ChunkEnvelope` is put as it is (the
    processor decided its own flags). An exception is the chunk's failure, with its reason."""

    def build(self, request: BuildRequest) -> Any: ...

    def release(self, external_id: str, scope: ReleaseScope) -> None: ...


class StatelessProcessor:
    """A build function as a :class:`ChunkProcessor` that keeps no state."""

    __slots__ = ("build",)

    def __init__(self, build: Callable[[BuildRequest], Any]) -> None:
        self.build = build

    def release(self, external_id: str, scope: ReleaseScope) -> None:
        return None

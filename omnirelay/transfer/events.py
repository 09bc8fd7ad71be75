"""Plain data the adapter hands to the scheduler and the orchestrator, and its mailbox.

* :class:`ChunkInput` — one committed chunk of one request (docs/protocol.md §4.8), handed over once.
* :class:`TransferFailure` — a request failed in the transfer layer; carries both ids, a
  :class:`FailureKind` and a reason. It is data: nothing raises it.
* :class:`TransferEvents` — what one ``poll_events()`` call drains: ready inputs, failures,
  stall timeouts, and the external ids whose sender generation retired with its keys
  reclaimed (how a stage learns that a release by id may complete).
* :class:`SaveResult` — the value ``save_async`` returns.
* :class:`EventBox` — the thread-safe mailbox the background threads fill.

Failures are kept twice: by internal id for the stage scheduler (drained by
``poll_events``) and by external id for the orchestrator (drained by
``take_external_failures``), so each side drains its own copy.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["ChunkInput", "EventBox", "FailureKind", "SaveResult", "TransferEvents", "TransferFailure"]


class SaveResult(enum.Enum):
    """What ``save_async`` did with a chunk."""

    ENQUEUED = "enqueued"
    #: Stale (older segment generation, or tokens below the watermark): dropped, no failure.
    DROPPED = "dropped"
    #: Refused; a :class:`TransferFailure` was recorded for the request.
    REJECTED = "rejected"


class FailureKind(enum.Enum):
    """Why a request failed in the transfer layer."""

    #: a chunk could not be sent (the reason says why)
    SEND_FAILED = "send_failed"
    #: a chunk could not be received or committed
    RECEIVE_FAILED = "receive_failed"
    #: an external id reused while its previous sender generation still drains
    REUSE_REJECTED = "reuse_rejected"
    #: the edge's byte budget stayed exhausted past the wait bound
    BACKPRESSURE = "backpressure"
    #: no chunk arrived within the stall timeout
    TIMEOUT = "timeout"


class TransferFailure(msgspec.Struct, frozen=True):
    """One request failed in the transfer layer. Crosses processes (to the orchestrator)."""

    internal_id: str
    external_id: str
    kind: FailureKind
    reason: str
    stage_id: int


class ChunkInput(msgspec.Struct, frozen=True):
    """A committed chunk, handed to the scheduler once (ownership moves with it).

    ``payload`` is the body the upstream processor built, exactly as it came (``None``: a
    boundary with nothing new); what it means is the consuming stage's business. The two
    flags come from the chunk's envelope.
    """

    internal_id: str
    external_id: str
    chunk_id: int
    is_finished: bool
    is_segment_finished: bool
    payload: Any = None


class TransferEvents(msgspec.Struct, frozen=True):
    """What the scheduler drains at one tick."""

    ready: tuple[ChunkInput, ...] = ()
    failed: tuple[TransferFailure, ...] = ()
    timed_out: tuple[TransferFailure, ...] = ()
    #: External ids whose sender generation retired since the last drain, each once, and
    #: whose keys are reclaimed: reported after the retired generation's exact-key cleanup
    #: ran on its lane, or at retirement when it had nothing to clean; and after the
    #: release hook dropped the processor's per-id state. Like vLLM's ``finished_sending``.
    retired_senders: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.ready or self.failed or self.timed_out or self.retired_senders)


class EventBox:
    """Ready chunks, failure records and retired senders waiting to be drained; wakes
    ``wait`` callers.

    Its lock is a leaf: no other lock is taken while it is held.

    Waiters sleep on a plain condition, woken with the GIL held, not the way the lane
    executor wakes its workers (a :class:`~omnirelay.transfer.wakeup.Parker`, GIL
    released): that costs ``bench adapter``'s head-of-line latency more than it gains
    (docs/performance.md, "Measured and dropped").
    """

    def __init__(self, max_external: int) -> None:
        self._cv = threading.Condition(threading.Lock())  # a leaf lock: never re-entered
        self._ready: dict[str, ChunkInput] = {}
        self._failed: dict[str, list[TransferFailure]] = {}
        self._external: dict[str, list[TransferFailure]] = {}
        self._external_order: deque[str] = deque()
        self._retired: dict[str, None] = {}  # external ids, an ordered set
        self._max_external = max_external
        #: told (under no lock) after anything wakes the waiters: :meth:`set_listener`
        self._listener: Callable[[], None] | None = None
        self.num_external_dropped = 0
        self.num_by_kind: dict[str, int] = {}

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Also call ``listener()`` whenever waiters are woken (after this box's lock is
        released): a thread that waits for several boxes at once (a device group's loop)."""
        self._listener = listener

    def _tell(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()

    def publish_ready(self, item: ChunkInput) -> None:
        with self._cv:
            # Invariant: one undrained chunk per request (registration refuses a second one).
            assert item.internal_id not in self._ready, item.internal_id
            self._ready[item.internal_id] = item
            self._cv.notify_all()
        self._tell()

    def has_ready(self, internal_id: str) -> bool:
        with self._cv:
            return internal_id in self._ready

    def record(self, failure: TransferFailure) -> None:
        """A failure for both the scheduler (by internal id) and the orchestrator."""
        with self._cv:
            self._failed.setdefault(failure.internal_id, []).append(failure)
            self._record_external_locked(failure)
            self._cv.notify_all()
        self._tell()

    def record_external(self, failure: TransferFailure) -> None:
        """A failure the scheduler already has (a timeout it collected): orchestrator only."""
        with self._cv:
            self._record_external_locked(failure)

    def _record_external_locked(self, failure: TransferFailure) -> None:
        self._external.setdefault(failure.external_id, []).append(failure)
        self._external_order.append(failure.external_id)
        while len(self._external_order) > self._max_external:
            ext = self._external_order.popleft()
            lst = self._external.get(ext)
            if lst:
                lst.pop(0)
                self.num_external_dropped += 1
                if not lst:
                    del self._external[ext]
        self.num_by_kind[failure.kind.value] = self.num_by_kind.get(failure.kind.value, 0) + 1

    def record_retired(self, external_id: str) -> None:
        """A sender generation of ``external_id`` retired and its keys are reclaimed."""
        with self._cv:
            self._retired[external_id] = None
            self._cv.notify_all()
        self._tell()

    def discard_request(self, internal_id: str) -> None:
        """The scheduler no longer tracks the request: drop its undrained chunk and failures."""
        with self._cv:
            self._ready.pop(internal_id, None)
            self._failed.pop(internal_id, None)

    def drain(self) -> tuple[tuple[ChunkInput, ...], tuple[TransferFailure, ...], tuple[str, ...]]:
        """Ready chunks, failures and retired senders, each handed over once."""
        with self._cv:
            ready = tuple(self._ready.values())
            failed = tuple(f for lst in self._failed.values() for f in lst)
            retired = tuple(self._retired)
            self._ready.clear()
            self._failed.clear()
            self._retired.clear()
            return ready, failed, retired

    def take_external(self) -> dict[str, list[TransferFailure]]:
        with self._cv:
            out, self._external = self._external, {}
            self._external_order.clear()
            return out

    def notify(self) -> None:
        with self._cv:
            self._cv.notify_all()
        self._tell()

    def wait(self, timeout: float | None, wake_if: Callable[[], bool] | None = None) -> bool:
        """Wait until a ready chunk, a failure or a retired sender is there to drain, or
        ``wake_if()`` holds (re-checked on :meth:`notify`); False on timeout.

        ``wake_if`` runs under this box's lock: it must be cheap and take no lock.
        """
        with self._cv:
            if wake_if is None:
                return self._cv.wait_for(self._has_events_locked, timeout)
            return self._cv.wait_for(lambda: self._has_events_locked() or wake_if(), timeout)

    def _has_events_locked(self) -> bool:
        return bool(self._ready or self._failed or self._retired)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {
                "num_ready": len(self._ready),
                "num_undrained_failures": sum(len(v) for v in self._failed.values()),
                "num_undrained_external_failures": len(self._external_order),
                "num_undrained_retirements": len(self._retired),
                "num_external_dropped": self.num_external_dropped,
                "num_failures_by_kind": dict(self.num_by_kind),
            }

    def leak_state(self) -> dict[str, Any]:
        with self._cv:
            out: dict[str, Any] = {}
            if self._ready:
                out["ready"] = list(self._ready)
            if self._failed:
                out["undrained_failures"] = {k: [f.reason for f in v] for k, v in self._failed.items()}
            if self._external:
                out["undrained_external_failures"] = {
                    k: [f.reason for f in v] for k, v in self._external.items()
                }
            if self._retired:
                out["undrained_retirements"] = list(self._retired)
            return out

    def clear(self) -> None:
        with self._cv:
            self._ready.clear()
            self._failed.clear()
            self._external.clear()
            self._external_order.clear()
            self._retired.clear()

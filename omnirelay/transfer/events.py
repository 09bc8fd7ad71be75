"""Plain data the adapter hands to the scheduler and the orchestrator, and its mailbox.

* :class:`ChunkInput` — one committed chunk of one request (SPEC §4.8), handed over once.
* :class:`TransferFailure` — a request failed in the transfer layer; carries both ids and a
  reason. :meth:`TransferFailure.error` gives the matching :class:`TransferError`.
* :class:`TransferEvents` — what one ``poll_events()`` call drains: ready inputs, failures,
  stall timeouts.
* :class:`Admission` — the value ``save_async`` returns.
* :class:`EventBox` — the thread-safe mailbox the background threads fill.

Failures are kept twice: by internal id for the stage scheduler (drained by
``poll_events``) and by external id for the orchestrator (drained by
``take_external_failures``), so each side drains its own copy.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from omnirelay.errors import (
    BackpressureError,
    ChunkTimeoutError,
    ReceiveFailedError,
    ReuseRejectedError,
    SendFailedError,
    TransferError,
)
from omnirelay.transfer.wakeup import Parker, wake_all

__all__ = ["Admission", "ChunkInput", "EventBox", "FailureKind", "TransferEvents", "TransferFailure"]


class Admission(enum.Enum):
    """What ``save_async`` did with a chunk."""

    ENQUEUED = "enqueued"
    #: Stale (older segment generation, or tokens below the watermark): dropped, no failure.
    DROPPED = "dropped"
    #: Refused; a :class:`TransferFailure` was recorded for the request.
    REJECTED = "rejected"


class FailureKind(enum.Enum):
    SEND_FAILED = "send_failed"
    RECEIVE_FAILED = "receive_failed"
    REUSE_REJECTED = "reuse_rejected"
    BACKPRESSURE = "backpressure"
    TIMEOUT = "timeout"


_ERRORS: dict[FailureKind, type[TransferError]] = {
    FailureKind.SEND_FAILED: SendFailedError,
    FailureKind.RECEIVE_FAILED: ReceiveFailedError,
    FailureKind.REUSE_REJECTED: ReuseRejectedError,
    FailureKind.BACKPRESSURE: BackpressureError,
    FailureKind.TIMEOUT: ChunkTimeoutError,
}


class TransferFailure(msgspec.Struct, frozen=True):
    """One request failed in the transfer layer. Crosses processes (to the orchestrator)."""

    internal_id: str
    external_id: str
    kind: FailureKind
    reason: str
    stage_id: int

    def error(self) -> TransferError:
        return _ERRORS[self.kind](
            f"request {self.external_id!r} (internal {self.internal_id!r}) at stage {self.stage_id}: "
            f"{self.reason}"
        )


class ChunkInput(msgspec.Struct, frozen=True):
    """A committed chunk, handed to the scheduler once (ownership moves with it).

    AR receivers get ``payload`` (the scheduler applies it as a pending prompt update).
    Generation receivers get ``prompt_token_ids`` and the merged ``additional_information``;
    each such chunk is a fresh one-shot prefill (``num_computed_tokens`` resets to 0).
    ``committed_time`` is the receiver's clock at the commit; ``is_waited`` says the
    consumer had asked for the chunk before it arrived (so its next step waited for the
    upstream), as opposed to finding it already there. Step timelines use both.
    """

    internal_id: str
    external_id: str
    chunk_id: int
    is_finished: bool
    is_segment_finished: bool
    payload: Any = None
    prompt_token_ids: list[int] | None = None
    additional_information: dict[str, Any] | None = None
    committed_time: float | None = None
    is_waited: bool = False


class TransferEvents(msgspec.Struct, frozen=True):
    """What the scheduler drains at one tick."""

    ready: tuple[ChunkInput, ...] = ()
    failed: tuple[TransferFailure, ...] = ()
    timed_out: tuple[TransferFailure, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.ready or self.failed or self.timed_out)


class EventBox:
    """Ready chunks and failure records waiting to be drained; wakes ``wait`` callers.

    Its lock is a leaf: no other lock is taken while it is held. Waiters park on a
    :class:`~omnirelay.transfer.wakeup.Parker` and are woken with the GIL released, so a
    scheduler thread woken by a receive worker runs at once rather than after the worker's
    next GIL release (``wakeup.py``). :meth:`publish_ready` leaves the wake-up to its caller,
    which holds the receiver lock at that point; every other method wakes before returning.
    """

    def __init__(self, max_external: int, *, parker: Callable[[], Parker] = Parker) -> None:
        self._lock = threading.Lock()  # a leaf lock: never re-entered
        self._new_parker = parker  # injectable: tests force the park/wake interleavings
        self._waiters: list[Parker] = []
        self._spare: list[Parker] = []
        self._ready: dict[str, ChunkInput] = {}
        self._failed: dict[str, list[TransferFailure]] = {}
        self._external: dict[str, list[TransferFailure]] = {}
        self._external_order: deque[str] = deque()
        self._max_external = max_external
        self.num_external_dropped = 0
        self.num_by_kind: dict[str, int] = {}

    def _take_waiters_locked(self) -> list[Parker]:
        waiters = self._waiters
        if waiters:
            self._waiters = []
        return waiters

    def publish_ready(self, item: ChunkInput, wake: list[Parker]) -> None:
        """Add a committed chunk; the waiters to wake are appended to ``wake`` — the caller
        wakes them (:func:`~omnirelay.transfer.wakeup.wake_all`) once it holds no lock."""
        with self._lock:
            # Invariant: one undrained chunk per request (registration refuses a second one).
            assert item.internal_id not in self._ready, item.internal_id
            self._ready[item.internal_id] = item
            if self._waiters:
                wake += self._take_waiters_locked()

    def has_ready(self, internal_id: str) -> bool:
        with self._lock:
            return internal_id in self._ready

    def record(self, failure: TransferFailure) -> None:
        """A failure for both the scheduler (by internal id) and the orchestrator. Call it
        holding no other lock (it wakes waiters)."""
        with self._lock:
            self._failed.setdefault(failure.internal_id, []).append(failure)
            self._record_external_locked(failure)
            woken = self._take_waiters_locked()
        wake_all(woken)

    def record_external(self, failure: TransferFailure) -> None:
        """A failure the scheduler already has (a timeout it collected): orchestrator only."""
        with self._lock:
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

    def discard_request(self, internal_id: str) -> None:
        """The scheduler no longer tracks the request: drop its undrained chunk and failures."""
        with self._lock:
            self._ready.pop(internal_id, None)
            self._failed.pop(internal_id, None)

    def drain(self) -> tuple[tuple[ChunkInput, ...], tuple[TransferFailure, ...]]:
        with self._lock:
            ready = tuple(self._ready.values())
            failed = tuple(f for lst in self._failed.values() for f in lst)
            self._ready.clear()
            self._failed.clear()
            return ready, failed

    def take_external(self) -> dict[str, list[TransferFailure]]:
        with self._lock:
            out, self._external = self._external, {}
            self._external_order.clear()
            return out

    def notify(self) -> None:
        """Wake every waiter to re-check (its ``wake_if``, an injected clock)."""
        with self._lock:
            woken = self._take_waiters_locked()
        wake_all(woken)

    def wait(self, timeout: float | None, wake_if: Callable[[], bool] | None = None) -> bool:
        """Wait until a ready chunk or a failure is there to drain, or ``wake_if()`` holds
        (re-checked on :meth:`notify`); False on timeout.

        ``wake_if`` runs under this box's lock: it must be cheap and take no lock.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        me: Parker | None = None
        try:
            while True:
                # Invariant here: ``me`` is not parked (a waker, or the timeout below, took it off).
                with self._lock:
                    if self._ready or self._failed or (wake_if is not None and wake_if()):
                        return True
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    if me is None:
                        me = self._spare.pop() if self._spare else self._new_parker()
                    self._waiters.append(me)
                if not me.wait(left):
                    with self._lock:
                        is_owed = me not in self._waiters  # a waker took it: its write is coming
                        if not is_owed:
                            self._waiters.remove(me)
                    if is_owed:
                        me.wait(None)
        finally:
            if me is not None:
                with self._lock:
                    self._spare.append(me)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_ready": len(self._ready),
                "num_undrained_failures": sum(len(v) for v in self._failed.values()),
                "num_undrained_external_failures": len(self._external_order),
                "num_external_dropped": self.num_external_dropped,
                "num_failures_by_kind": dict(self.num_by_kind),
            }

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {}
            if self._ready:
                out["ready"] = list(self._ready)
            if self._failed:
                out["undrained_failures"] = {k: [f.reason for f in v] for k, v in self._failed.items()}
            if self._external:
                out["undrained_external_failures"] = {
                    k: [f.reason for f in v] for k, v in self._external.items()
                }
            return out

    def clear(self) -> None:
        with self._lock:
            self._ready.clear()
            self._failed.clear()
            self._external.clear()
            self._external_order.clear()

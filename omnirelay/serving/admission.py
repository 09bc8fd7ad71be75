"""Admission control at the API (docs/protocol.md §10.1): :class:`AdmissionGate` and :class:`Slot`.

A request holds one slot from the moment it is admitted until its response is fully
sent, aborted or failed. Over ``max_concurrency`` slots, or while the pipeline's live
transfer bytes (last health probe) are over ``max_live_bytes``, a new request is refused
with 429 and ``Retry-After``. Everything runs on the server's event loop thread; a
``threading.Lock`` still guards the books so tests may hold slots from another thread.
"""

from __future__ import annotations

import threading

from omnirelay.serving.errors import ApiError

__all__ = ["AdmissionGate", "Slot"]


class Slot:
    """One admitted request. :meth:`release` is idempotent (call it in every ``finally``)."""

    __slots__ = ("_admission", "_is_released")

    def __init__(self, admission: AdmissionGate) -> None:
        self._admission = admission
        self._is_released = False

    @property
    def is_released(self) -> bool:
        return self._is_released

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._admission._release()


class AdmissionGate:
    """Counts admitted requests against the limits; see the module docstring."""

    def __init__(
        self, max_concurrency: int, *, max_live_bytes: int | None = None, retry_after_s: int = 1
    ) -> None:
        self.max_concurrency = max_concurrency
        self.max_live_bytes = max_live_bytes
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._num_active = 0
        self.live_bytes = 0  # set by the health probe
        self.num_rejected = 0

    @property
    def num_active(self) -> int:
        with self._lock:
            return self._num_active

    def acquire(self) -> Slot:
        """A slot, or :class:`ApiError` 429 with ``Retry-After``."""
        with self._lock:
            reason = None
            if self._num_active >= self.max_concurrency:
                reason = f"the server is at its limit of {self.max_concurrency} concurrent requests"
            elif self.max_live_bytes is not None and self.live_bytes > self.max_live_bytes:
                reason = (
                    f"the pipeline holds {self.live_bytes} bytes of unconsumed transfers, over its "
                    f"budget of {self.max_live_bytes}"
                )
            if reason is None:
                self._num_active += 1
                return Slot(self)
            self.num_rejected += 1
        raise ApiError(
            429,
            f"{reason}; retry after {self.retry_after_s} s",
            type="rate_limit_error",
            code="server_busy",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def _release(self) -> None:
        with self._lock:
            assert self._num_active > 0, "a slot was released twice"
            self._num_active -= 1

    def refuse(self) -> None:
        """Count a request refused for another reason than these limits (the pipeline's
        real-time capacity), so ``num_rejected`` counts every 429."""
        with self._lock:
            self.num_rejected += 1

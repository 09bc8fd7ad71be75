"""Admission control at the API (docs/protocol.md §10.1): :class:`AdmissionGate` and :class:`Slot`.

The gate keeps two books, each against its own limit:

* **request slots** — a request holds one from the moment it is admitted until its
  response is fully sent, aborted or failed. Over ``max_concurrency`` slots, or while the
  pipeline's live transfer bytes (last health probe) are over ``max_live_bytes``, a new
  request is refused with 429 and ``Retry-After``;
* **connection slots** — an open WebSocket (a ``/v1/audio/speech/stream`` session or a
  ``/v1/realtime`` session) holds one for its whole life, from before its handshake is
  accepted until it is closed, whichever way it ends. Over ``max_websockets`` (by default
  ``max_concurrency``) a new socket is refused before its session starts.

The pools are separate: an open socket holds no request slot (idle sessions never starve
HTTP requests), and each response a socket asks for takes a request slot while it runs,
as any request does (a full server answers it ``server_busy``, the socket stays open).
Everything runs on the server's event loop thread; a ``threading.Lock`` still guards the
books so tests may hold slots from another thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from omnirelay.serving.errors import ApiError

__all__ = ["BUSY_CLOSE_CODE", "BUSY_CLOSE_REASON", "AdmissionGate", "Slot"]

#: How a WebSocket refused at ``max_websockets`` is closed, after an error message that
#: says why: 1013 (try again later), with a reason a browser's ``CloseEvent`` shows (a
#: close reason is at most 123 bytes). A refused handshake (an HTTP 429 to the upgrade)
#: would reach a browser's page as a bare 1006 with no reason at all.
BUSY_CLOSE_CODE = 1013
BUSY_CLOSE_REASON = "server busy: at its limit of open WebSockets; retry later"


class Slot:
    """One admitted request or open WebSocket. :meth:`release` is idempotent (call it in
    every ``finally``)."""

    __slots__ = ("_is_released", "_on_release")

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._on_release = on_release
        self._is_released = False

    @property
    def is_released(self) -> bool:
        return self._is_released

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._on_release()


class AdmissionGate:
    """Counts admitted requests and open WebSockets against the limits; see the module
    docstring. ``max_websockets`` None: as many as ``max_concurrency``."""

    def __init__(
        self,
        max_concurrency: int,
        *,
        max_live_bytes: int | None = None,
        retry_after_s: int = 1,
        max_websockets: int | None = None,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.max_live_bytes = max_live_bytes
        self.retry_after_s = retry_after_s
        self.max_websockets = max_concurrency if max_websockets is None else max_websockets
        self._lock = threading.Lock()
        self._num_active = 0
        self._num_websockets = 0
        self.live_bytes = 0  # set by the health probe
        self.num_rejected = 0
        self.num_websockets_refused = 0

    @property
    def num_active(self) -> int:
        with self._lock:
            return self._num_active

    @property
    def num_websockets(self) -> int:
        with self._lock:
            return self._num_websockets

    def acquire(self) -> Slot:
        """A request slot, or :class:`ApiError` 429 with ``Retry-After``."""
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
                return Slot(self._release)
            self.num_rejected += 1
        raise self._busy(reason)

    def open_websocket(self) -> Slot:
        """A connection slot for one WebSocket, held until it closes; or :class:`ApiError`
        429 (the route refuses the socket with it before its session starts)."""
        with self._lock:
            if self._num_websockets < self.max_websockets:
                self._num_websockets += 1
                return Slot(self._close_websocket)
            self.num_websockets_refused += 1
        reason = f"the server is at its limit of {self.max_websockets} open WebSocket connections"
        raise self._busy(reason)

    def _busy(self, reason: str) -> ApiError:
        return ApiError(
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

    def _close_websocket(self) -> None:
        with self._lock:
            assert self._num_websockets > 0, "a connection slot was released twice"
            self._num_websockets -= 1

    def refuse(self) -> None:
        """Count a request refused for another reason than these limits (the pipeline's
        real-time capacity), so ``num_rejected`` counts every 429."""
        with self._lock:
            self.num_rejected += 1

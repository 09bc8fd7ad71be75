"""Admission by real-time capacity: how many audio streams a pipeline takes at once.

Past the machine's real-time capacity every stream degrades: each one's frames come
slower than it plays, and every listener hears gaps. :class:`StreamGate` keeps a new
audio stream out instead — it waits (the Python API) or is refused with 429 and
``Retry-After`` (``serve``) — while either

* ``max_streams`` audio streams are admitted already (the pipeline file's
  ``max_audio_streams``, or ``serve --max-audio-streams``; None: no fixed limit), or
* with ``min_headroom_s`` set (the pipeline file's ``hold_audio_while_dry: true``: 0), an
  admitted stream is running dry: by its own clock (audio delivered against the time
  since its first audio) a player would have less than ``min_headroom_s`` of audio in
  hand. The machine is already behind; another stream would push it, and the others,
  further. The gate opens again once every admitted stream is ahead again, or has
  ended. Off by default: a pipeline whose streams pause by design (a voice that speaks
  one finished sentence at a time) runs "dry" between sentences at any load.

The books are pure (every call takes ``now``); :meth:`StreamGate.acquire` blocks on a
condition for callers on threads. A request that asks for no audio never touches the gate.

:class:`StreamQueue` is the front's queue in front of the gate: a request for audio that
finds the gate shut, or earlier requests still waiting, waits there in arrival order, and
is handed back (:meth:`StreamQueue.pop_admitted`) once the gate lets it through.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from omnirelay.errors import ConfigError

__all__ = ["DEFAULT_MIN_HEADROOM_S", "StreamGate", "StreamGateHealth", "StreamQueue"]

P = TypeVar("P")

#: With the brake on: an admitted stream with less audio in hand holds new streams back.
DEFAULT_MIN_HEADROOM_S = 0.0


@dataclass(frozen=True, slots=True)
class StreamGateHealth:
    """The gate's books as ``/health`` shows them."""

    max_streams: int | None
    num_streams: int
    num_waiting: int
    num_running_low: int
    num_refused: int

    def to_dict(self) -> dict[str, int | None]:
        return {
            "max_audio_streams": self.max_streams,
            "num_audio_streams": self.num_streams,
            "num_waiting": self.num_waiting,
            "num_running_low": self.num_running_low,
            "num_refused": self.num_refused,
        }


@dataclass(slots=True)
class _Stream:
    first_audio_s: float | None = None
    audio_s: float = 0.0

    def headroom(self, now: float) -> float | None:
        """Audio in hand at ``now`` (None before its first audio: nothing plays yet)."""
        if self.first_audio_s is None:
            return None
        return self.audio_s - (now - self.first_audio_s)


class StreamGate:
    """The audio streams admitted and waiting; see the module docstring. Thread-safe."""

    def __init__(
        self,
        max_streams: int | None = None,
        *,
        min_headroom_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if max_streams is not None and (
            isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1
        ):
            raise ConfigError(f"max_audio_streams must be an int >= 1 or null, got {max_streams!r}")
        if min_headroom_s is not None and (
            not isinstance(min_headroom_s, int | float)
            or not math.isfinite(min_headroom_s)
            or min_headroom_s < 0
        ):
            raise ConfigError(f"min_headroom_s must be seconds >= 0 or None, got {min_headroom_s!r}")
        self.max_streams = max_streams
        #: None: no brake (only the fixed limit holds streams back)
        self.min_headroom_s = None if min_headroom_s is None else float(min_headroom_s)
        self._clock = clock if clock is not None else time.monotonic
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._num_waiting = 0
        self.num_refused = 0

    # ----------------------------------------------------------------- the books

    def why_not(self, now: float) -> str | None:
        """Why a new stream cannot start at ``now`` (None: it can)."""
        with self._cond:
            return self._why_not(now)

    def _why_not(self, now: float) -> str | None:
        if self.max_streams is not None and len(self._streams) >= self.max_streams:
            return f"the pipeline is at its real-time capacity of {self.max_streams} audio streams"
        low = self._running_low(now)
        if low:
            threshold = self.min_headroom_s or 0.0
            return (
                f"{low} admitted audio stream(s) are running dry (less than {threshold * 1000:.0f} ms "
                "of audio in hand); another stream now would make it worse"
            )
        return None

    def _running_low(self, now: float) -> int:
        limit = self.min_headroom_s
        if limit is None:
            return 0
        return sum(1 for s in self._streams.values() if (h := s.headroom(now)) is not None and h < limit)

    def try_acquire(self, rid: str, now: float | None = None) -> str | None:
        """Admit ``rid`` now, or say why not (None: admitted). Idempotent per id."""
        now = self._clock() if now is None else now
        with self._cond:
            if rid in self._streams:
                return None
            reason = self._why_not(now)
            if reason is None:
                self._streams[rid] = _Stream()
            else:
                self.num_refused += 1
            return reason

    def acquire(self, rid: str, timeout_s: float | None = None) -> str | None:
        """Wait until ``rid`` is admitted (None) or ``timeout_s`` passed (the reason).
        Waiters are woken by every release and every audio note; a stream running low
        is re-checked at least every 50 ms."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            self._num_waiting += 1
            try:
                while True:
                    now = self._clock()
                    if rid in self._streams:
                        return None
                    reason = self._why_not(now)
                    if reason is None:
                        self._streams[rid] = _Stream()
                        return None
                    left = None if deadline is None else deadline - now
                    if left is not None and left <= 0:
                        self.num_refused += 1
                        return reason
                    self._cond.wait(0.05 if left is None else min(0.05, left))
            finally:
                self._num_waiting -= 1

    def note_audio(self, rid: str, seconds: float, now: float | None = None) -> None:
        """``seconds`` of ``rid``'s audio reached its client at ``now``."""
        if seconds <= 0:
            return
        now = self._clock() if now is None else now
        with self._cond:
            stream = self._streams.get(rid)
            if stream is None:
                return
            if stream.first_audio_s is None:
                stream.first_audio_s = now
            stream.audio_s += seconds
            self._cond.notify_all()

    def release(self, rid: str) -> None:
        """``rid``'s stream ended (idempotent)."""
        with self._cond:
            if self._streams.pop(rid, None) is not None:
                self._cond.notify_all()

    def __contains__(self, rid: object) -> bool:
        with self._cond:
            return rid in self._streams

    def health(self, now: float | None = None, *, num_queued: int = 0) -> StreamGateHealth:
        """The books at ``now``; ``num_queued``: requests an owner keeps waiting in a queue
        of its own (counted with those blocked in :meth:`acquire`)."""
        now = self._clock() if now is None else now
        with self._cond:
            return StreamGateHealth(
                max_streams=self.max_streams,
                num_streams=len(self._streams),
                num_waiting=self._num_waiting + num_queued,
                num_running_low=self._running_low(now),
                num_refused=self.num_refused,
            )

    def leak_state(self) -> dict[str, list[str]]:
        with self._cond:
            return {"audio_streams": sorted(self._streams)} if self._streams else {}


class StreamQueue(Generic[P]):
    """The requests for audio waiting for a stream of ``gate``, first come first served
    (``P``: whatever the owner needs to admit one later). The owner's thread only, except
    :meth:`__len__`."""

    def __init__(self, gate: StreamGate, *, speaks: bool) -> None:
        self.gate = gate
        #: the pipeline has an audio output: a request for it takes a stream
        self.speaks = speaks
        self._waiting: dict[str, P] = {}

    def takes_stream(self, modalities: tuple[str, ...] | None) -> bool:
        """Whether a request for ``modalities`` takes an audio stream (None: every output)."""
        return self.speaks and (modalities is None or "audio" in modalities)

    def enter(self, request_id: str, modalities: tuple[str, ...] | None, item: P) -> bool:
        """A request arrives: it takes a stream now (or needs none, or holds one already),
        False; or it waits behind earlier waiters, or while the gate is shut, True."""
        if not self.takes_stream(modalities) or request_id in self.gate:
            return False
        if self._waiting or self.gate.try_acquire(request_id) is not None:
            self._waiting[request_id] = item
            return True
        return False

    def pop_admitted(self) -> P | None:
        """The first waiter, once the gate admitted it (it holds its stream now); None
        while the gate keeps it waiting, or none waits."""
        if not self._waiting:
            return None
        request_id, item = next(iter(self._waiting.items()))
        if self.gate.try_acquire(request_id) is not None:
            return None
        del self._waiting[request_id]
        return item

    def withdraw(self, request_id: str) -> P | None:
        """Take a waiter out of the queue (an abort); None when it does not wait."""
        return self._waiting.pop(request_id, None)

    def drain(self) -> list[tuple[str, P]]:
        """Take every waiter out of the queue (shutdown), in arrival order."""
        items = list(self._waiting.items())
        self._waiting.clear()
        return items

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting_ids(self) -> list[str]:
        return sorted(self._waiting)

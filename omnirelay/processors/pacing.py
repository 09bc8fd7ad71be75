"""Adaptive chunk sizes for a streamed audio edge: never let the player run dry (pure).

A Talker makes codec frames one step at a time; Code2Wav turns each chunk of frames into
audio. Small chunks start the audio early but each one re-decodes its left context, so
they cost the vocoder far more per second of audio; large chunks are cheap but a player
that has less audio in hand than the next chunk takes to make runs dry. The pacer sizes
each chunk from the stream's **playback headroom** — the audio already sent that has not
played yet — and its **measured frame interval**:

* the first chunk goes out as soon as its frames would play for longer than the next
  frame may take to make — the recent peak interval, not the mean: a busy step (another
  request's prefill) is what runs a fresh stream dry — plus a little slack, at least
  ``min_first_frames`` of them: one frame when frames come fast and steadily, two or more
  when the GPU is busy;
* after it, frames are held while the headroom stays above ``margin_s`` plus the mean
  and the peak frame interval (to make the next frame, and to survive a slow one), and
  sent as soon as waiting for one more frame would leave less; a chunk never exceeds
  ``max_frames``.

So chunks start small and grow as the stream banks headroom (a ramp that follows the
machine's load), and a stream whose frames slow down is sent smaller chunks sooner.

Headroom is judged from the producer's side: the player is taken to start when the first
chunk is sent, and every chunk to reach it after the same delay, so the delay cancels.
A vocoder queue that grows from chunk to chunk is what ``margin_s`` absorbs. The decoder
holds the last ``holdback_s`` of each window back until the next chunk (docs/protocol.md
§6.2), so the first chunk plays that much less than its frames.

The frame interval is an exponentially weighted mean of the gaps between a stream's
frames, and its peak a maximum that decays by :data:`PEAK_DECAY` per frame; a stream's
first frames use the edge's figures over its other streams (:class:`FrameRate`, shared
by every stream of one edge and safe across threads).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from omnirelay.errors import ConfigError

__all__ = ["FrameRate", "PacingConfig", "StreamPacer"]

#: Weight of the newest gap in the frame-interval means.
DEFAULT_ALPHA = 0.3
#: Slack the first chunk keeps over one frame interval, seconds.
FIRST_CHUNK_SLACK_S = 0.020
#: How much of a peak frame interval is left after one more frame (half-life ~14 frames).
PEAK_DECAY = 0.95


@dataclass(frozen=True, slots=True)
class PacingConfig:
    """The pacer's settings (docs/protocol.md §5.3); validated at construction."""

    frame_s: float = 0.080
    holdback_s: float = 0.0
    max_frames: int = 25
    margin_s: float = 0.150
    alpha: float = DEFAULT_ALPHA

    def __post_init__(self) -> None:
        for name, value, low in (
            ("frame_s", self.frame_s, 0.0),
            ("holdback_s", self.holdback_s, 0.0),
            ("margin_s", self.margin_s, 0.0),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"pacing {name} must be a finite number, got {value!r}")
            if value < low or (name == "frame_s" and value == 0):
                raise ConfigError(
                    f"pacing {name} must be {'> 0' if name == 'frame_s' else '>= 0'}, got {value}"
                )
        if self.holdback_s >= self.frame_s:
            raise ConfigError(
                f"pacing holdback_s ({self.holdback_s}) must be shorter than one frame ({self.frame_s})"
            )
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"pacing alpha must be in (0, 1], got {self.alpha}")
        if isinstance(self.max_frames, bool) or not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ConfigError(f"pacing max_frames must be an int >= 1, got {self.max_frames!r}")


def _mean_and_peak(mean: float | None, peak: float | None, gap: float, alpha: float) -> tuple[float, float]:
    if mean is None or peak is None:
        return gap, gap
    return mean + alpha * (gap - mean), max(gap, peak * PEAK_DECAY)


@dataclass(slots=True)
class FrameRate:
    """The edge's mean and peak frame interval over all its streams (seconds; None until
    measured)."""

    alpha: float = DEFAULT_ALPHA
    interval_s: float | None = None
    peak_s: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, interval_s: float) -> None:
        with self._lock:
            self.interval_s, self.peak_s = _mean_and_peak(
                self.interval_s, self.peak_s, interval_s, self.alpha
            )


@dataclass(slots=True)
class StreamPacer:
    """One stream's pacing state; the owner calls :meth:`on_frames` for each step that
    brought frames, asks :meth:`should_send` with the frames not sent yet, and reports
    each chunk it sends with :meth:`on_sent`. ``now`` is any monotonic clock, seconds."""

    config: PacingConfig
    edge: FrameRate
    #: the first chunk's least size (clamped to ``[1, max_frames]``)
    min_first_frames: int = 1
    interval_s: float | None = None
    peak_s: float | None = None
    last_frame_s: float | None = None
    first_sent_s: float | None = None
    audio_sent_s: float = 0.0
    num_chunks: int = 0

    def on_frames(self, now: float, num_frames: int) -> None:
        """``num_frames`` (> 0) new frames arrived at ``now``."""
        if num_frames <= 0:
            return
        if self.last_frame_s is not None:
            gap = max(0.0, now - self.last_frame_s) / num_frames
            self.interval_s, self.peak_s = _mean_and_peak(
                self.interval_s, self.peak_s, gap, self.config.alpha
            )
            self.edge.observe(gap)
        self.last_frame_s = now

    def frame_interval(self) -> float | None:
        """The expected time to the next frame: this stream's mean, else the edge's."""
        return self.interval_s if self.interval_s is not None else self.edge.interval_s

    def peak_interval(self) -> float | None:
        """The longest recent time to a frame, of this stream or of the edge."""
        peaks = [p for p in (self.peak_s, self.edge.peak_s) if p is not None]
        return max(peaks) if peaks else None

    def headroom(self, now: float) -> float:
        """Audio sent and not yet played at ``now`` (0 before the first chunk; negative:
        the player ran dry that long ago)."""
        if self.first_sent_s is None:
            return 0.0
        return self.audio_sent_s - (now - self.first_sent_s)

    def first_chunk_frames(self) -> int:
        """Frames of the first chunk: the fewest that play longer than the next frame may
        take to make (the peak interval, plus slack), at least ``min_first_frames``, at
        most ``max_frames``."""
        cfg = self.config
        least = min(max(1, self.min_first_frames), cfg.max_frames)
        peak = self.peak_interval()
        if peak is None:
            peak = cfg.frame_s  # nothing measured yet: assume frames come in real time
        need = peak + FIRST_CHUNK_SLACK_S + cfg.holdback_s
        return min(max(least, math.ceil(need / cfg.frame_s - 1e-9)), cfg.max_frames)

    def should_send(self, now: float, num_pending: int) -> bool:
        """Whether the ``num_pending`` frames not sent yet should go out now."""
        if num_pending <= 0:
            return False
        cfg = self.config
        if num_pending >= cfg.max_frames:
            return True
        if self.first_sent_s is None:
            return num_pending >= self.first_chunk_frames()
        interval = self.frame_interval()
        peak = self.peak_interval()
        if interval is None or peak is None:
            interval = peak = cfg.frame_s
        return self.headroom(now) < cfg.margin_s + interval + peak

    def on_sent(self, now: float, num_frames: int) -> None:
        """A chunk of ``num_frames`` new frames went out at ``now``."""
        if num_frames <= 0:
            return
        audio = num_frames * self.config.frame_s
        if self.first_sent_s is None:
            self.first_sent_s = now
            audio -= self.config.holdback_s
        self.audio_sent_s += audio
        self.num_chunks += 1

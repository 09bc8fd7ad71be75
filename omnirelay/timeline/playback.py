"""What a listener hears of one audio stream: first playable audio, gaps and silence (pure).

A stream is the sequence of its audio chunks as the client received them: each chunk's
arrival time and how much audio it carries. Time to first audio alone hides a stream
that starts fast and then runs dry; these figures do not:

* **first audio** — the first chunk's arrival;
* **first playable audio** — the earliest moment a player could start and never run dry:
  the maximum over chunks of (arrival − audio delivered before it);
* a player that starts at the first audio and, when it runs dry, waits for the next chunk
  and resumes from there: each **gap** it hears, the **worst gap**, the **total silence**
  and the **number of underruns** (gaps longer than zero);
* **gap-free** — the worst gap is at most :data:`GAP_FREE_MAX_S` (50 ms: a stream whose
  worst underrun a listener barely notices).

:func:`playback_of` computes them; every place that measures audio latency (``omnirelay
run --json``, ``omnirelay bench pipeline``, the server's Prometheus metrics) uses it, so
the figures mean the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["GAP_FREE_MAX_S", "Playback", "playback_of"]

#: A stream is gap-free when its worst gap is at most this long.
GAP_FREE_MAX_S = 0.050


@dataclass(frozen=True, slots=True)
class Playback:
    """One stream as a listener hears it (seconds; arrival times count from the submit)."""

    num_chunks: int
    audio_s: float
    first_audio_s: float | None
    first_playable_s: float | None
    worst_gap_s: float
    silence_s: float
    num_underruns: int
    #: every gap heard, in order (``num_underruns`` of them)
    gaps_s: tuple[float, ...] = ()
    #: the index (among the chunks with audio) of the chunk that came after the worst gap
    worst_gap_at: int | None = None

    @property
    def is_gap_free(self) -> bool:
        return self.worst_gap_s <= GAP_FREE_MAX_S

    def to_dict(self) -> dict[str, float | int | bool | None]:
        return {
            "num_chunks": self.num_chunks,
            "audio_s": self.audio_s,
            "first_audio_s": self.first_audio_s,
            "first_playable_s": self.first_playable_s,
            "worst_gap_s": self.worst_gap_s,
            "silence_s": self.silence_s,
            "num_underruns": self.num_underruns,
            "worst_gap_at": self.worst_gap_at,
            "is_gap_free": self.is_gap_free,
        }


def playback_of(chunks: Iterable[tuple[float, float]]) -> Playback:
    """The :class:`Playback` of a stream given as ``(arrival_s, duration_s)`` per chunk, in
    arrival order. Chunks without audio (duration 0) are skipped; a stream with no audio
    has no first audio and no gaps."""
    first_audio: float | None = None
    first_playable = 0.0
    delivered = 0.0  # audio delivered before the chunk at hand
    played_until = 0.0  # when the player runs dry, with the pauses it already took
    gaps: list[float] = []
    worst_at: int | None = None
    num_chunks = 0
    for arrival, duration in chunks:
        if duration <= 0:
            continue
        if arrival < 0:
            raise ValueError(f"a chunk arrival time must be >= 0, got {arrival}")
        num_chunks += 1
        if first_audio is None:
            first_audio = arrival
            played_until = arrival
        first_playable = max(first_playable, arrival - delivered)
        if arrival > played_until:
            gap = arrival - played_until
            if not gaps or gap > max(gaps):
                worst_at = num_chunks - 1
            gaps.append(gap)
            played_until = arrival
        played_until += duration
        delivered += duration
    return Playback(
        num_chunks=num_chunks,
        audio_s=delivered,
        first_audio_s=first_audio,
        first_playable_s=None if first_audio is None else first_playable,
        worst_gap_s=max(gaps, default=0.0),
        silence_s=sum(gaps, 0.0),
        num_underruns=len(gaps),
        gaps_s=tuple(gaps),
        worst_gap_at=worst_at,
    )

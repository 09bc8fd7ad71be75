"""Where the speech of a whole clip starts and ends: :func:`speech_span`, weight-free.

The recognizer hears a clip cut to its speech, with fixed silence around it
(:mod:`omnirelay.models.asr.sphinx`), so that what it hears does not depend on how much
background the clip carried: a chat clip (the whole recording) and a realtime turn (the
server VAD's segment of the same recording: its speech, ``prefix_padding_ms`` before it,
``silence_duration_ms`` after it) are heard alike. For that the span must depend only on
the audio near the speech, not on the clip's length or on what the rest of it holds.

The clip is cut into 10 ms frames from its first sample, each frame's level its mean
power in dB relative to full scale. The **noise floor** at a frame is the quietest level
within :data:`FLOOR_MS` around it on the side away from the speech — before a candidate
onset, after a candidate end (frames beyond the clip count as :data:`OUTSIDE_DB`): a
floor that only looks at the background next to the speech, as the realtime detector's
adaptive floor does (``serving/realtime/vad.py``), but looking both ways, which a whole
clip allows. A frame is **loud** over ``floor + margin`` and over :data:`MIN_LEVEL_DB`;
the speech **starts** at the first run of :data:`MIN_SPEECH_MS` loud frames and **ends**
with the last such run; each edge then extends over the frames next to it still over half
the margin (soft word edges, as the realtime detector's hysteresis keeps them). The
parameters are the realtime detector's defaults: a 12 dB margin (``threshold`` 0.5),
-55 dBFS, 60 ms.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["FLOOR_MS", "FRAME_MS", "speech_span"]

#: Frame length.
FRAME_MS = 10
#: How far the noise floor looks, away from the speech.
FLOOR_MS = 200
#: The level over the floor that is speech (the realtime detector's default margin).
MARGIN_DB = 12.0
#: Frames quieter than this (dBFS) are never speech.
MIN_LEVEL_DB = -55.0
#: The level of the background assumed beyond the clip's ends (dBFS).
OUTSIDE_DB = -50.0
#: Loud audio needed to count as speech (shorter bursts — clicks — are not).
MIN_SPEECH_MS = 60


def _levels(x: np.ndarray, frame: int) -> np.ndarray:
    n = x.size // frame + (1 if x.size % frame else 0)
    padded = np.zeros(n * frame, dtype=np.float64)
    padded[: x.size] = x
    frames = padded.reshape(n, frame)
    return 10.0 * np.log10(np.mean(frames * frames, axis=1) + 1e-12)


def _floors(levels: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(before, after)``: per frame, the quietest of the ``width`` frames before it and
    of the ``width`` frames after it."""
    outside = np.full(width, OUTSIDE_DB)
    padded = np.concatenate([outside, levels, outside])
    window = sliding_window_view(padded, width).min(axis=1)
    # window[k] covers padded[k : k + width]; frame i sits at padded[i + width].
    return window[: levels.size], window[width + 1 : width + 1 + levels.size]


def _runs(loud: np.ndarray, run: int) -> np.ndarray:
    """Where a run of ``run`` loud frames starts."""
    if loud.size < run:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(sliding_window_view(loud, run).all(axis=1))


def speech_span(waveform: Any, sample_rate: int) -> tuple[int, int] | None:
    """``(start, end)`` sample indices of a mono clip's speech, frame-aligned and within
    the clip; None when it holds no speech (see the module docstring)."""
    x = np.asarray(waveform, dtype=np.float32).reshape(-1)
    frame = max(1, round(sample_rate * FRAME_MS / 1000))
    if x.size == 0:
        return None
    levels = _levels(x, frame)
    before, after = _floors(levels, max(1, round(FLOOR_MS / FRAME_MS)))
    run = max(1, round(MIN_SPEECH_MS / FRAME_MS))
    starts = _runs(levels > np.maximum(before + MARGIN_DB, MIN_LEVEL_DB), run)
    ends = _runs(levels > np.maximum(after + MARGIN_DB, MIN_LEVEL_DB), run)
    if starts.size == 0 or ends.size == 0 or ends[-1] + run <= starts[0]:
        return None
    first, last = int(starts[0]), int(ends[-1]) + run - 1
    while first > 0 and levels[first - 1] > max(before[first - 1] + MARGIN_DB / 2, MIN_LEVEL_DB):
        first -= 1
    while last + 1 < levels.size and levels[last + 1] > max(after[last + 1] + MARGIN_DB / 2, MIN_LEVEL_DB):
        last += 1
    return first * frame, min((last + 1) * frame, x.size)

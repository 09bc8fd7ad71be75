"""Server voice activity detection for ``/v1/realtime``: :class:`EnergyVad`, weight-free.

The detector cuts the input into 10 ms frames and compares each frame's level (its mean
power in dB relative to full scale) with an **adaptive noise floor**:

* a frame is **loud** when its level is over ``floor + margin`` and over
  :attr:`VadParams.min_level_db` (so digital silence with a little dither is never speech);
  the margin is ``threshold * 24 dB`` (OpenAI's ``threshold`` in 0..1: higher needs
  louder speech; the default 0.5 asks for 12 dB over the noise);
* **speech starts** after :attr:`VadParams.min_speech_ms` of consecutive loud frames; its
  onset is the first of them. Inside speech a frame still counts as voiced down to half
  the margin (hysteresis: soft word endings do not cut an utterance);
* **speech stops** after ``silence_duration_ms`` without a voiced frame; its end is the
  end of the last voiced frame;
* the floor follows the level of unvoiced frames outside speech (falling within a few
  frames, rising with a :attr:`VadParams.noise_rise_ms` time constant), and inside speech
  rises only slowly (:attr:`VadParams.noise_rise_in_speech_ms`), so a noise that switches
  on and stays is taken for speech for a few seconds at most. The first
  :attr:`VadParams.calibration_ms` of audio only set the floor (the quietest of their
  frames, or :attr:`VadParams.initial_noise_db` if that is louder): a steady background
  from the very start is not speech, and speech that starts within them is found at the
  first pause.

Positions are sample indices since the detector started (or was reset), so results do
not depend on how the audio was split into pushes: the same samples give the same
events. The session turns them into OpenAI's ``audio_start_ms`` (the onset less
``prefix_padding_ms``) and ``audio_end_ms`` (the end plus ``silence_duration_ms``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FRAME_MS", "EnergyVad", "VadEvent", "VadParams"]

#: Frame length of the detector.
FRAME_MS = 10


@dataclass(frozen=True, slots=True)
class VadParams:
    """The detector's parameters. The first three are OpenAI's ``turn_detection`` fields."""

    #: 0..1; the loudness over the noise floor that counts as speech: ``threshold * 24`` dB
    threshold: float = 0.5
    #: audio kept before the speech onset, in the committed turn and ``audio_start_ms``
    prefix_padding_ms: int = 300
    #: silence that ends an utterance
    silence_duration_ms: int = 500
    #: loud audio needed to start an utterance (shorter bursts — clicks — are ignored)
    min_speech_ms: int = 60
    #: frames quieter than this (dBFS) are never speech
    min_level_db: float = -55.0
    #: the noise floor before any audio was heard (dBFS)
    initial_noise_db: float = -50.0
    #: audio at the start that only measures the background
    calibration_ms: int = 100
    #: time constant of the floor rising to a louder background, outside speech
    noise_rise_ms: float = 400.0
    #: the same inside speech: slow, so speech never raises the floor much
    noise_rise_in_speech_ms: float = 15000.0

    @property
    def margin_db(self) -> float:
        return 24.0 * self.threshold


@dataclass(frozen=True, slots=True)
class VadEvent:
    """``kind`` ``"start"`` (``sample``: the onset) or ``"stop"`` (``sample``: the end of the
    last voiced frame); ``at_sample``: where the detector decided (the end of the frame
    that settled it)."""

    kind: str
    sample: int
    at_sample: int


class EnergyVad:
    """See the module docstring. ``push`` audio as int16 PCM or floats in [-1, 1]."""

    def __init__(self, params: VadParams, sample_rate: int) -> None:
        if sample_rate < 1000:
            raise ValueError(f"sample_rate must be >= 1000 Hz, got {sample_rate}")
        self.params = params
        self.sample_rate = sample_rate
        self.frame = max(1, round(sample_rate * FRAME_MS / 1000))
        frame_s = self.frame / sample_rate
        self._rise = 1.0 - math.exp(-frame_s * 1000.0 / params.noise_rise_ms)
        self._rise_in_speech = 1.0 - math.exp(-frame_s * 1000.0 / params.noise_rise_in_speech_ms)
        self._calibration = math.ceil(params.calibration_ms / (frame_s * 1000.0))
        self._min_loud = max(1, math.ceil(params.min_speech_ms / (frame_s * 1000.0)))
        self._max_quiet = max(1, math.ceil(params.silence_duration_ms / (frame_s * 1000.0)))
        self.reset()

    def reset(self) -> None:
        """Forget everything heard: positions count from 0 again."""
        self.noise_db = self.params.initial_noise_db
        self.in_speech = False
        self._pending = np.zeros(0, dtype=np.float32)
        self._pos = 0  # samples framed so far
        self._loud_run = 0
        self._quiet_run = 0
        self._last_voiced_end = 0
        self._quietest = math.inf

    def push(self, samples: np.ndarray) -> list[VadEvent]:
        """Feed audio; the events it settles, in order."""
        x = samples.astype(np.float32)
        if samples.dtype == np.int16:
            x /= 32768.0
        data = np.concatenate([self._pending, x.reshape(-1)]) if self._pending.size else x.reshape(-1)
        n = data.size // self.frame
        self._pending = data[n * self.frame :].copy()
        if n == 0:
            return []
        frames = data[: n * self.frame].reshape(n, self.frame).astype(np.float64)
        levels = 10.0 * np.log10(np.mean(frames * frames, axis=1) + 1e-12)
        events: list[VadEvent] = []
        for level in levels.tolist():
            event = self._step(level)
            if event is not None:
                events.append(event)
            self._pos += self.frame
        return events

    def _step(self, level: float) -> VadEvent | None:
        p = self.params
        end = self._pos + self.frame
        if self._pos < self._calibration * self.frame:
            self._quietest = min(level, self._quietest)
            self.noise_db = max(self._quietest, p.initial_noise_db)
            return None
        if not self.in_speech:
            if level > max(self.noise_db + p.margin_db, p.min_level_db):
                self._loud_run += 1
                if self._loud_run >= self._min_loud:
                    self.in_speech = True
                    self._quiet_run = 0
                    self._last_voiced_end = end
                    return VadEvent("start", end - self._loud_run * self.frame, end)
                return None
            self._loud_run = 0
            self._follow_noise(level, self._rise)
            return None
        voiced = level > max(self.noise_db + p.margin_db / 2, p.min_level_db)
        self._follow_noise(level, self._rise_in_speech)
        if voiced:
            self._quiet_run = 0
            self._last_voiced_end = end
            return None
        self._quiet_run += 1
        if self._quiet_run >= self._max_quiet:
            self.in_speech = False
            self._loud_run = 0
            return VadEvent("stop", self._last_voiced_end, end)
        return None

    def _follow_noise(self, level: float, rise: float) -> None:
        if level < self.noise_db:  # a quieter background shows at once (half way per frame)
            self.noise_db += 0.5 * (level - self.noise_db)
        else:
            self.noise_db += rise * (level - self.noise_db)

"""The recognizer hears a clip's speech the same way whatever surrounds it
(:mod:`omnirelay.models.asr.speech_span`, :class:`~omnirelay.models.asr.sphinx.Recognizer`),
on its own (no process, no server):

* the speech span of an utterance in background noise lies on its edges, and is the same
  samples for the whole recording and for any cut of it that keeps the background a
  realtime turn keeps (its ``prefix_padding_ms`` before, ``silence_duration_ms`` after);
  noise, silence and a click hold none;
* the recognizer hears a clip the same after other clips as first (no state carried over),
  hears the recording and the realtime-like cut alike, gives word times in the clip's own
  time, and hears nothing in a clip without speech.

The spoken clip is ``tests/fixtures/espeak-en-us-question.wav``, another voice than the
pipeline's, made once with eSpeak NG 1.51::

    espeak-ng -v en-us -w tests/fixtures/espeak-en-us-question.wav "What is the capital of France?"
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omnirelay.models.asr.speech_span import FRAME_MS, speech_span
from omnirelay.models.asr.sphinx import Recognizer
from omnirelay.serving.media.audio_in import decode_audio
from tests.realtime_support import noise, speechlike

RATE = 16_000
FRAME = RATE * FRAME_MS // 1000
QUESTION_WAV = Path(__file__).parent / "fixtures" / "espeak-en-us-question.wav"


@pytest.fixture(scope="module")
def recognizer() -> Recognizer:
    return Recognizer()


@pytest.fixture(scope="module")
def question() -> np.ndarray:
    """The question at 16 kHz, between 0.7 s and 1.1 s of -60 dBFS background."""
    clip = decode_audio(QUESTION_WAV.read_bytes(), "wav", sample_rate=RATE)
    return np.concatenate([noise(RATE, 0.7), clip, noise(RATE, 1.1, seed=3)]).astype(np.float32)


def test_the_span_lies_on_the_speech_edges_and_ignores_the_background() -> None:
    signal = np.concatenate(
        [noise(RATE, 0.7), noise(RATE, 1.2, seed=2) + speechlike(RATE, 1.2), noise(RATE, 1.0, seed=3)]
    )
    span = speech_span(signal, RATE)
    assert span is not None
    start, end = span
    assert abs(start - round(0.7 * RATE)) <= 2 * FRAME and abs(end - round(1.9 * RATE)) <= 2 * FRAME
    # A realtime turn's cut: 300 ms before the speech, 500 ms after it; or more, or less.
    for before_s, after_s in ((0.3, 0.5), (0.5, 0.8), (0.21, 0.21)):
        a = (start - round(before_s * RATE)) // FRAME * FRAME  # on the recording's frame grid
        cut = signal[a : end + round(after_s * RATE)]
        assert speech_span(cut, RATE) == (start - a, end - a), (before_s, after_s)


def test_noise_silence_and_a_click_hold_no_speech() -> None:
    assert speech_span(noise(RATE, 2.0), RATE) is None
    assert speech_span(np.zeros(RATE, np.float32), RATE) is None
    assert speech_span(np.zeros(0, np.float32), RATE) is None
    click = noise(RATE, 1.0)
    click[8000:8480] += speechlike(RATE, 0.03)  # 30 ms: shorter than speech
    assert speech_span(click, RATE) is None


def test_the_recognizer_hears_a_clip_alike_first_or_later_whole_or_cut(
    recognizer: Recognizer, question: np.ndarray
) -> None:
    first = recognizer.transcribe(question, RATE)
    assert first, "nothing heard"
    recognizer.words(question[: RATE * 2][::-1].copy(), RATE)  # something else in between
    assert recognizer.transcribe(question, RATE) == first  # nothing carried over
    span = speech_span(question, RATE)
    assert span is not None
    a = (span[0] - round(0.3 * RATE)) // FRAME * FRAME
    cut = question[a : span[1] + round(0.5 * RATE)]
    shift_ms = a * 1000 // RATE
    assert [(w, s + shift_ms, e + shift_ms) for w, s, e in recognizer.transcribe(cut, RATE)] == first
    # Word times are the clip's: a second more of silence before it, a second later.
    later = recognizer.transcribe(np.concatenate([np.zeros(RATE, np.float32), question]), RATE)
    assert [(w, s - 1000, e - 1000) for w, s, e in later] == first
    duration_ms = question.size * 1000 // RATE
    assert all(0 <= s <= e <= duration_ms for _, s, e in first)


def test_a_clip_without_speech_is_heard_as_nothing(recognizer: Recognizer) -> None:
    assert recognizer.transcribe(noise(RATE, 1.5), RATE) == []
    assert recognizer.words(np.zeros(RATE // 2, np.float32), RATE) == []

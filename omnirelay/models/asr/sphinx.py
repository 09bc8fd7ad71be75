"""``aligner.pocketsphinx``: word timestamps from a forced alignment with PocketSphinx (BSD).

The ``pocketsphinx`` wheel bundles a US English acoustic model, a dictionary and a
language model; nothing is downloaded.

* :class:`ForcedAligner` — ``align(waveform, sample_rate, text)`` → ``[{"word",
  "start_ms", "end_ms"}, ...]``, one entry per written word of ``text``: the text is read
  as the voice reads it (:func:`~omnirelay.models.text.spoken.spoken_tokens`: ``1889`` is
  three spoken words), the spoken words are aligned against the audio (words the
  dictionary lacks get their pronunciation from the voice's phonemizer), and each written
  word spans its spoken words. Times are integer milliseconds, monotonic, never past the
  end of the audio. When the decoder cannot align (noise, a text that was not said), the
  weight-free VAD allocation of :mod:`omnirelay.models.asr.vad_aligner` answers instead.
* :class:`Recognizer` — free recognition with the bundled language model: what a
  listener would have heard (the recognizer stage, the intelligibility checks and the
  benchmarks use it). Each clip is heard on its own and the same way whatever surrounds
  its speech: the decoder starts every utterance afresh (its feature state — cepstral
  mean, noise estimate — would otherwise carry over from the clips before, and the same
  clip would be heard differently in turn), and it hears the clip's speech
  (:func:`~omnirelay.models.asr.speech_span.speech_span`) between :data:`PAD_MS` of
  silence, not the background around it: a chat clip and a realtime turn cut from the
  same recording are heard alike. Word times are the clip's own.
* :func:`word_error_rate` — the edit distance of two word lists over the reference's length.
* :class:`SphinxAlignerExecutor` / :func:`create_sphinx_aligner` — the aligner stage's
  generation executor: one step per request on the complete waveform and text that the
  ``code2wav_to_aligner`` input builder forwards; the output ``text`` is the JSON of the
  timestamps (what the serving layer reads, as for ``aligner.vad``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.asr import SPHINX_ALIGNER_EXECUTOR
from omnirelay.models.asr.speech_span import speech_span
from omnirelay.models.asr.vad_aligner import align_words
from omnirelay.models.text.phonemizer import Phonemizer
from omnirelay.models.text.spoken import spoken_tokens

__all__ = [
    "PAD_MS",
    "SPHINX_ALIGNER_EXECUTOR",
    "SPHINX_RATE",
    "ForcedAligner",
    "Recognizer",
    "SphinxAlignerExecutor",
    "create_sphinx_aligner",
    "resample",
    "word_error_rate",
]

#: The acoustic model's sample rate.
SPHINX_RATE = 16_000
#: The silence the recognizer hears before and after a clip's speech.
PAD_MS = 200
_FRAME_MS = 10  # one feature frame
_FILLERS = ("<s>", "</s>", "<sil>", "[NOISE]", "[SPEECH]")


def resample(waveform: Any, rate: int, target: int = SPHINX_RATE) -> np.ndarray:
    """Band-limited resampling (FFT) of a mono waveform to ``target`` Hz."""
    x = np.asarray(waveform, dtype=np.float64).reshape(-1)
    if rate == target or x.size == 0:
        return x.astype(np.float32)
    n_out = max(1, round(x.size * target / rate))
    spectrum = np.fft.rfft(x)
    keep = n_out // 2 + 1
    if keep <= spectrum.size:
        spectrum = spectrum[:keep]
    else:
        spectrum = np.concatenate([spectrum, np.zeros(keep - spectrum.size, dtype=spectrum.dtype)])
    return (np.fft.irfft(spectrum, n_out) * (n_out / x.size)).astype(np.float32)


def _pcm16(waveform: Any, rate: int) -> bytes:
    return _to_pcm16(resample(waveform, rate))


def _to_pcm16(y: np.ndarray) -> bytes:
    """Samples at :data:`SPHINX_RATE` as the decoder takes them (scaled down past full scale)."""
    peak = float(np.abs(y).max()) if y.size else 0.0
    if peak > 1.0:
        y = y / peak
    return (np.clip(y, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _decoder(**options: Any) -> Any:
    try:
        from pocketsphinx import Decoder
    except ImportError as exc:  # pragma: no cover - a default install has it
        raise ModelError(
            "the pocketsphinx aligner needs the pocketsphinx wheel: pip install pocketsphinx"
        ) from exc
    return Decoder(samprate=SPHINX_RATE, loglevel="FATAL", **options)


def _base_word(name: str) -> str:
    """``the(2)`` → ``the``: the decoder names alternative pronunciations so."""
    return re.sub(r"\(\d+\)$", "", name)


class Recognizer:
    """Free recognition (bundled language model); one utterance at a time, each heard on
    its own (see the module docstring)."""

    def __init__(self) -> None:
        self._decoder = _decoder()

    def transcribe(self, waveform: Any, sample_rate: int) -> list[tuple[str, int, int]]:
        """``[(word, start_ms, end_ms), ...]`` heard in the waveform (fillers left out), in
        the clip's own time; ``[]`` when it holds no speech."""
        y = resample(waveform, sample_rate)
        span = speech_span(y, SPHINX_RATE)
        if span is None:
            return []
        start, end = span
        pad = np.zeros(PAD_MS * SPHINX_RATE // 1000, dtype=np.float32)
        heard = np.concatenate([pad, y[start:end], pad])
        d = self._decoder
        d.reinit_feat()  # nothing of the clips heard before
        d.start_utt()
        d.process_raw(_to_pcm16(heard), full_utt=True)
        d.end_utt()
        # The padded clip's time → the clip's: less the padding, plus where the speech starts.
        shift = start * 1000 // SPHINX_RATE - PAD_MS
        duration = y.size * 1000 // SPHINX_RATE
        out = []
        for seg in d.seg():
            if seg.word in _FILLERS or seg.word.startswith("["):
                continue
            a = min(max(seg.start_frame * _FRAME_MS + shift, 0), duration)
            b = min(max((seg.end_frame + 1) * _FRAME_MS + shift, a), duration)
            out.append((_base_word(seg.word), a, b))
        return out

    def words(self, waveform: Any, sample_rate: int) -> list[str]:
        return [w for w, _, _ in self.transcribe(waveform, sample_rate)]


def word_error_rate(reference: Sequence[str], hypothesis: Sequence[str]) -> float:
    """(substitutions + deletions + insertions) / len(reference); 0.0 for two empty lists."""
    ref, hyp = list(reference), list(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / len(ref)


class ForcedAligner:
    """Word timestamps of a known text over its audio; see the module docstring."""

    def __init__(self, phonemizer: Phonemizer | None = None) -> None:
        # The language model is never used here; skipping it saves most of the load time.
        self._decoder = _decoder(lm=None)
        self._phonemizer = phonemizer or Phonemizer()
        self._known: set[str] = set()

    def _ensure_word(self, word: str) -> None:
        if word in self._known:
            return
        if self._decoder.lookup_word(word) is None:
            phones = " ".join(p.rstrip("012") for p in self._phonemizer.arpabet(word))
            if not phones:
                raise ModelError(f"cannot pronounce {word!r}")
            self._decoder.add_word(word, phones, True)
        self._known.add(word)

    def align(self, waveform: Any, sample_rate: int, text: str) -> list[dict[str, Any]]:
        """Timestamps of every written word of ``text``; ``[]`` when it has none."""
        samples = np.asarray(waveform, dtype=np.float32).reshape(-1)
        duration_ms = int(samples.size * 1000 // sample_rate)
        written: list[str] = []
        spoken: list[tuple[str, int]] = []  # (spoken word, index of its written word)
        for tok in spoken_tokens(text):
            if tok.words:
                for w in tok.words:
                    spoken.append((w, len(written)))
                written.append(tok.written.rstrip(".") or tok.written)
        if not written:
            return []
        spans = self._spoken_spans(samples, sample_rate, [w for w, _ in spoken])
        if spans is None:
            # Not alignable: share the voiced time in proportion to the words' lengths.
            return align_words(samples, sample_rate, written)
        bounds: list[list[int]] = [[-1, -1] for _ in written]
        for (start, end), (_, index) in zip(spans, spoken):
            b = bounds[index]
            b[0] = start if b[0] < 0 else b[0]
            b[1] = end
        out = []
        prev_end = 0
        for word, (start, end) in zip(written, bounds):
            start = min(max(start, prev_end), duration_ms)
            end = min(max(end, start), duration_ms)
            out.append({"word": word, "start_ms": start, "end_ms": end})
            prev_end = end
        return out

    def _spoken_spans(self, samples: np.ndarray, rate: int, words: list[str]) -> list[tuple[int, int]] | None:
        """``(start_ms, end_ms)`` of each spoken word, or None when the decoder fails."""
        d = self._decoder
        try:
            for w in words:
                self._ensure_word(w)
            d.set_align_text(" ".join(words))
            d.start_utt()
            d.process_raw(_pcm16(samples, rate), full_utt=True)
            d.end_utt()
            segs = [s for s in d.seg() or () if s.word not in _FILLERS and not s.word.startswith("[")]
        except (RuntimeError, ValueError, ModelError):
            return None
        if [_base_word(s.word) for s in segs] != words:
            return None
        return [(s.start_frame * _FRAME_MS, (s.end_frame + 1) * _FRAME_MS) for s in segs]


class SphinxAlignerExecutor:
    """A generation executor: one step per request, on its complete input."""

    execution_type = "generation"
    supports_batching = True

    def __init__(self, aligner: ForcedAligner | None = None) -> None:
        self.aligner = aligner or ForcedAligner()
        self.num_aligned = 0

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        return [self._align(item) for item in batch]

    def _align(self, item: BatchItem) -> ItemResult:
        inputs = item.inputs
        if not isinstance(inputs, Mapping) or "waveform" not in inputs:
            raise ModelError(
                f"request {item.external_id!r}: the aligner needs the complete waveform and text "
                "(the code2wav_to_aligner input builder's inputs)"
            )
        rate = int(inputs.get("sample_rate") or SPHINX_RATE)
        text = inputs.get("text")
        if not isinstance(text, str):
            text = " ".join(str(w) for w in inputs.get("words") or [])
        stamps = self.aligner.align(inputs["waveform"], rate, text)
        self.num_aligned += 1
        return ItemResult(
            internal_id=item.internal_id, finished=True, text=json.dumps(stamps, separators=(",", ":"))
        )

    def release(self, internal_id: str) -> None:
        """Nothing is kept between steps."""

    def num_live_requests(self) -> int:
        return 0

    def leak_state(self) -> dict[str, Any]:
        return {}


def create_sphinx_aligner(**executor_args: Any) -> SphinxAlignerExecutor:
    """Registry factory of ``aligner.pocketsphinx`` (``device``: ``cpu`` only)."""
    unknown = set(executor_args) - {"device"}
    if unknown:
        raise ModelError(f"{SPHINX_ALIGNER_EXECUTOR}: unknown executor_args {sorted(unknown)}")
    if executor_args.get("device", "cpu") not in (None, "cpu"):
        raise ModelError(f"{SPHINX_ALIGNER_EXECUTOR} runs on the CPU")
    return SphinxAlignerExecutor()

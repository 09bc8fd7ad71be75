"""Code2Wav → forced aligner: the full-waveform input builder (docs/protocol.md §5.4, §8 item 11).

The aligner needs the whole utterance, so this runs on the orchestrator once the audio
stage has **finished** the request (not over a connector, not per chunk).

* :func:`build_aligner_input` — a finished Code2Wav output plus the original prompt →
  :class:`AlignerInput`; an unfinished output (or an empty waveform) gives ``None``.
* :func:`extract_waveform` — the output's ``audio`` (else ``model_outputs``) as mono
  float32 and its sample rate (``sr``, default 24000).
* :func:`segment_words` / :func:`build_aligner_prompt` — the aligner's word units and its
  text prompt with two timestamp markers (start, end) per word.

A list of waveform pieces is taken as the ordered segments of one utterance and
concatenated. (The reference keeps only the first element, which would align a third of
an utterance accumulated from three segments.) The worker-side decode of the aligner's
logits into ``[n_words, 2]`` milliseconds belongs to the aligner executor.
"""

from __future__ import annotations

import logging
import numbers
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnirelay.errors import PayloadEncodeError

__all__ = [
    "AUDIO_PLACEHOLDER",
    "DEFAULT_SAMPLE_RATE",
    "TIMESTAMP_MARKER",
    "AlignerInput",
    "build_aligner_input",
    "build_aligner_prompt",
    "extract_waveform",
    "segment_words",
]

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_RATE = 24000
TIMESTAMP_MARKER = "<timestamp>"
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"

_PROCESSOR = "code2wav->aligner"

# CJK ideographs are aligned one character per word.
_CJK_RANGES = (
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0x20000, 0x2CEAF),
)


@dataclass(frozen=True, slots=True)
class AlignerInput:
    """One aligner request: a text prompt, the waveform, and what the decode needs back."""

    prompt: str
    waveform: np.ndarray  # mono float32, 1-D
    sample_rate: int
    text: str
    words: tuple[str, ...]
    language: str | None
    audio_duration_ms: float

    @property
    def multi_modal_data(self) -> dict[str, Any]:
        return {"audio": (self.waveform, self.sample_rate)}

    @property
    def additional_information(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "text": self.text,
            "words": list(self.words),
            "audio_duration_ms": self.audio_duration_ms,
        }
        if self.language is not None:
            info["language"] = self.language
        return info


def _mono(piece: object) -> np.ndarray:
    if isinstance(piece, torch.Tensor):
        arr = piece.detach().to(device="cpu", dtype=torch.float32).numpy()
    elif isinstance(piece, np.ndarray):
        arr = piece.astype(np.float32, copy=False)
    else:
        raise PayloadEncodeError(
            f"{_PROCESSOR}: a waveform must be a tensor or numpy array, got {type(piece).__name__}"
        )
    if sum(1 for n in arr.shape if n != 1) > 1:
        raise PayloadEncodeError(
            f"{_PROCESSOR}: the waveform has shape {arr.shape}; expected mono audio "
            "(one dimension longer than 1)"
        )
    return arr.reshape(-1)


def _sample_rate(raw: object) -> int:
    if isinstance(raw, list | tuple):
        raw = raw[-1] if raw else None
    if isinstance(raw, torch.Tensor):
        raw = raw.reshape(-1)[-1].item() if raw.numel() else None
    elif isinstance(raw, np.ndarray):
        raw = raw.reshape(-1)[-1].item() if raw.size else None
    if raw is None:
        return DEFAULT_SAMPLE_RATE
    value = float(raw) if isinstance(raw, numbers.Real) and not isinstance(raw, bool) else 0.0
    if not value.is_integer() or value <= 0:
        raise PayloadEncodeError(f"{_PROCESSOR}: sample rate must be a positive int, got {raw!r}")
    return int(value)


def extract_waveform(audio_output: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """``(mono float32 waveform, sample rate)`` of one Code2Wav output (may be empty)."""
    wav = audio_output.get("audio")
    if wav is None:
        wav = audio_output.get("model_outputs")
    if wav is None:
        samples = np.zeros(0, dtype=np.float32)
    elif isinstance(wav, list | tuple):
        pieces = [_mono(p) for p in wav]
        samples = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    else:
        samples = _mono(wav)
    return np.ascontiguousarray(samples, dtype=np.float32), _sample_rate(audio_output.get("sr"))


def _is_cjk(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def segment_words(text: str, language: str | None = None) -> list[str]:
    """Split ``text`` into aligner word units.

    Whitespace separates words; punctuation is dropped (letters, digits and the
    apostrophe stay); each CJK ideograph is a word of its own. ``language`` is accepted
    for languages that need their own segmenter (Japanese, Korean); none is built in,
    so they fall back to whitespace splitting.
    """
    del language  # no language-specific segmenter yet
    words: list[str] = []
    for segment in text.split():
        kept = "".join(ch for ch in segment if ch == "'" or unicodedata.category(ch)[0] in "LN")
        buf = ""
        for ch in kept:
            if _is_cjk(ch):
                if buf:
                    words.append(buf)
                    buf = ""
                words.append(ch)
            else:
                buf += ch
        if buf:
            words.append(buf)
    return words


def build_aligner_prompt(words: Sequence[str]) -> str:
    """The aligner's chat prompt: audio, then each word followed by two timestamp markers.

    With no words it carries one marker, so the decode always has a position to read and
    reports an empty result instead of failing.
    """
    pair = TIMESTAMP_MARKER * 2
    body = "".join(w + pair for w in words) if words else TIMESTAMP_MARKER
    return f"<|im_start|>user\n{AUDIO_PLACEHOLDER}{body}<|im_end|>\n<|im_start|>assistant\n"


def _pick(value: object, index: int) -> str | None:
    if isinstance(value, list | tuple):
        value = value[index] if index < len(value) else None
    return None if value is None else str(value)


def build_aligner_input(
    audio_output: Mapping[str, Any],
    *,
    is_finished: bool,
    prompt: Mapping[str, Any] | None,
    index: int = 0,
) -> AlignerInput | None:
    """The aligner input for one Code2Wav output, or ``None`` when there is none to build.

    Only a finished output counts: alignment runs once, on the whole utterance. The text
    comes from ``prompt["additional_information"]["text"]`` (item ``index`` of a list),
    the language from ``prompt["language"]`` or the additional information. An empty
    waveform is logged and skipped.
    """
    if not is_finished:
        return None
    waveform, sample_rate = extract_waveform(audio_output)
    if waveform.size == 0:
        logger.warning("%s: the finished output has an empty waveform; skipping alignment", _PROCESSOR)
        return None
    info = (prompt or {}).get("additional_information") or {}
    text = _pick(info.get("text"), index) or ""
    language = _pick((prompt or {}).get("language") or info.get("language"), index)
    words = segment_words(text, language)
    return AlignerInput(
        prompt=build_aligner_prompt(words),
        waveform=waveform,
        sample_rate=sample_rate,
        text=text,
        words=tuple(words),
        language=language,
        audio_duration_ms=waveform.size / sample_rate * 1000.0,
    )

"""``aligner.vad``: a forced aligner that needs no trained weights (docs/protocol.md §5.4).

The stage gets the complete waveform and the words of one utterance (the
``code2wav_to_aligner`` input builder's ``inputs``) and answers once, with word timestamps
in milliseconds as the output ``text``: the JSON ``[{"word", "start_ms", "end_ms"}, ...]``
(``[]``: no words, or nothing but silence).

:func:`align_words` is the algorithm:

1. **Voice activity** — RMS energy in 20 ms frames; a frame is voiced above a threshold
   between the quietest frames (the noise floor) and the loud ones (10 % of the way from
   the 10th to the 95th percentile, and above an absolute floor). Voiced runs closer than
   120 ms are merged; runs shorter than 40 ms are dropped.
2. **Allocation** — the words share the voiced time in proportion to their length in
   characters (a stand-in for syllables), laid over the voiced regions in order, so a
   word never starts inside a pause that a region boundary marks.
3. **Repair** — integer milliseconds, monotonic, ``start <= end``, no overlap, nothing
   past the audio's duration.

A trained aligner checkpoint (``executor_args.model_dir``) is not supported yet: the
factory says so instead of silently ignoring it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import ModelError
from omnirelay.models.asr import ALIGNER_EXECUTOR

__all__ = ["ALIGNER_EXECUTOR", "VadAligner", "align_words", "create_aligner", "voiced_regions"]


FRAME_MS = 20
MERGE_GAP_MS = 120
MIN_REGION_MS = 40
ABS_FLOOR = 1e-3  # RMS below this is silence whatever the recording's level


def _as_array(waveform: Any) -> np.ndarray:
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().to("cpu", torch.float32).numpy()
    return np.asarray(waveform, dtype=np.float32).reshape(-1)


def voiced_regions(waveform: Any, sample_rate: int) -> list[tuple[int, int]]:
    """Voiced ``(start_ms, end_ms)`` regions of a mono waveform, in order."""
    x = _as_array(waveform)
    frame = max(1, sample_rate * FRAME_MS // 1000)
    n = len(x) // frame + (1 if len(x) % frame else 0)
    if n == 0:
        return []
    padded = np.zeros(n * frame, dtype=np.float64)
    padded[: len(x)] = x
    rms = np.sqrt(np.mean(padded.reshape(n, frame) ** 2, axis=1))
    lo, hi = np.percentile(rms, 10), np.percentile(rms, 95)
    threshold = max(ABS_FLOOR, lo + 0.1 * (hi - lo))
    voiced = rms > threshold
    if hi <= ABS_FLOOR or not voiced.any():
        return []
    runs: list[list[int]] = []
    for i, v in enumerate(voiced):
        if not v:
            continue
        if runs and (i - runs[-1][1]) * FRAME_MS <= MERGE_GAP_MS:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    duration_ms = len(x) * 1000 / sample_rate
    out = []
    for a, b in runs:
        start, end = a * FRAME_MS, min(b * FRAME_MS, duration_ms)
        if end - start >= MIN_REGION_MS:
            out.append((int(start), math.ceil(end)))
    return out


def align_words(waveform: Any, sample_rate: int, words: list[str]) -> list[dict[str, Any]]:
    """Word timestamps of ``words`` over ``waveform`` (see the module docstring)."""
    if not words:
        return []
    x = _as_array(waveform)
    duration_ms = int(len(x) * 1000 // sample_rate)
    regions = voiced_regions(x, sample_rate)
    if not regions:
        return []  # silence: nothing was said
    weights = np.array([max(1, len(w)) for w in words], dtype=np.float64)
    total_voiced = sum(b - a for a, b in regions)
    bounds = np.concatenate([[0.0], np.cumsum(weights) / weights.sum() * total_voiced])

    def to_time(t: float) -> float:
        """Voiced time (ms from the first voiced sample, pauses removed) → audio time."""
        for a, b in regions:
            if t <= b - a:
                return a + t
            t -= b - a
        return float(regions[-1][1])

    out: list[dict[str, Any]] = []
    prev_end = 0
    for i, word in enumerate(words):
        start = round(to_time(bounds[i] + (1e-9 if i else 0.0)))
        end = round(to_time(bounds[i + 1]))
        start = min(max(start, prev_end), duration_ms)  # monotonic, no overlap
        end = min(max(end, start), duration_ms)
        out.append({"word": word, "start_ms": start, "end_ms": end})
        prev_end = end
    return out


class VadAligner:
    """A generation executor: one step per request, on its complete input."""

    execution_type = "generation"
    supports_batching = True

    def __init__(self) -> None:
        self.num_aligned = 0

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        return [self._align(item) for item in batch]

    def _align(self, item: BatchItem) -> ItemResult:
        inputs = item.inputs
        if not isinstance(inputs, dict) or "waveform" not in inputs:
            raise ModelError(
                f"request {item.external_id!r}: the aligner needs the complete waveform and words "
                "(the code2wav_to_aligner input builder's inputs)"
            )
        rate = int(inputs.get("sample_rate") or 24000)
        words = [str(w) for w in inputs.get("words") or []]
        stamps = align_words(inputs["waveform"], rate, words)
        self.num_aligned += 1
        return ItemResult(
            internal_id=item.internal_id,
            finished=True,
            text=json.dumps(stamps, separators=(",", ":")),
        )

    def release(self, internal_id: str) -> None:
        """Nothing is kept between steps."""

    def leak_state(self) -> dict[str, Any]:
        return {}


def create_aligner(**executor_args: Any) -> VadAligner:
    """Registry factory of ``aligner.vad``. ``tiny``/``seed``/``device`` are accepted (no
    weights, nothing to seed); ``model_dir`` (a trained checkpoint) is refused for now."""
    unknown = set(executor_args) - {"tiny", "seed", "device", "dtype", "model_dir"}
    if unknown:
        raise ModelError(f"aligner.vad: unknown executor_args {sorted(unknown)}")
    if executor_args.get("model_dir"):
        raise ModelError(
            "aligner.vad: loading a trained aligner checkpoint is not supported yet; "
            "drop executor_args.model_dir to use the weight-free VAD aligner"
        )
    return VadAligner()

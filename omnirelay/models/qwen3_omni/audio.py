"""A request's audio input, as the stage that hears it receives it (docs/protocol.md §1.9).

The contract of a request's audio on its way into a pipeline: the entry stage's full
input (``inputs``) is ``{"audio": [clip, ...], "sample_rate": AUDIO_INPUT_RATE}``, each
clip a 1-D float32 mono waveform at :data:`AUDIO_INPUT_RATE` (16 kHz, the rate of both
Qwen3-Omni's audio encoder and PocketSphinx's acoustic model), in the order the clips
appear in the conversation.

* :func:`audio_inputs` — that mapping from waveforms (the serving layer builds it).
* :func:`read_audio_inputs` — the clips of an entry stage's ``inputs`` (an empty list when
  the request carries none), checked: a stage given something else fails the request
  with a message that names the contract.
* :func:`num_audio_tokens` — how many ``<|audio_pad|>`` positions Qwen3-Omni's audio
  encoder fills for a clip of ``num_samples`` samples (the prompt reserves exactly that
  many; :class:`QwenAudioEncoder` checks it).
* :class:`QwenAudioEncoder` — a Thinker's audio tower with a Whisper-style feature
  extractor built from the tower's config (no files read): clips → one embedding row per
  audio token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from omnirelay.errors import ModelError

__all__ = [
    "AUDIO_INPUT_RATE",
    "QwenAudioEncoder",
    "audio_inputs",
    "num_audio_tokens",
    "read_audio_inputs",
]

#: The rate of every clip of a request's audio input.
AUDIO_INPUT_RATE = 16_000
#: Whisper-style features: a 25 ms window every 10 ms at 16 kHz.
_HOP = 160
_N_FFT = 400
#: the shortest clip the features are computed on (shorter ones are zero-padded): the
#: STFT's reflection padding needs more samples than half its window
_MIN_FRAMES = 3


def audio_inputs(clips: Sequence[Any]) -> dict[str, Any]:
    """The entry stage's ``inputs`` for ``clips`` (float32 mono at :data:`AUDIO_INPUT_RATE`)."""
    return {
        "audio": [torch.as_tensor(np.asarray(c, dtype=np.float32)).reshape(-1) for c in clips],
        "sample_rate": AUDIO_INPUT_RATE,
    }


def read_audio_inputs(inputs: Any, who: str) -> list[torch.Tensor]:
    """The audio clips of an entry stage's ``inputs`` (see the module docstring); ``[]``
    when it carries none. ``who`` names the stage and request in errors."""
    if not isinstance(inputs, Mapping) or "audio" not in inputs:
        return []
    clips = inputs["audio"]
    rate = inputs.get("sample_rate")
    if rate != AUDIO_INPUT_RATE:
        raise ModelError(f"{who}: audio input at {rate!r} Hz; the contract is {AUDIO_INPUT_RATE} Hz mono")
    if not isinstance(clips, list | tuple):
        raise ModelError(f"{who}: inputs['audio'] must be a list of waveforms, got {type(clips).__name__}")
    out = []
    for i, clip in enumerate(clips):
        t = torch.as_tensor(clip)
        if t.dim() != 1 or t.numel() == 0 or not t.is_floating_point():
            raise ModelError(
                f"{who}: audio clip {i} must be a non-empty 1-D float waveform, got shape {tuple(t.shape)}"
            )
        out.append(t.to(torch.float32))
    return out


def _conv_out(n: int) -> int:
    """The length after one of the encoder's stride-2 convolutions (kernel 3, padding 1)."""
    return (n - 1) // 2 + 1


def _num_frames(num_samples: int) -> int:
    """Feature frames of a clip: one per 10 ms, the clip zero-padded to whole frames (and
    to at least :data:`_MIN_FRAMES`)."""
    return max(-(-num_samples // _HOP), _MIN_FRAMES)


def num_audio_tokens(num_samples: int, n_window: int) -> int:
    """Audio tokens of a clip of ``num_samples`` samples at 16 kHz: one feature frame per
    10 ms (:func:`_num_frames`), cut into chunks of ``2 * n_window`` frames that three
    stride-2 convolutions each shorten (100 frames → 13 tokens)."""
    frames = _num_frames(num_samples)
    chunk = 2 * n_window
    per_chunk = _conv_out(_conv_out(_conv_out(chunk)))
    tail = frames % chunk
    return (frames // chunk) * per_chunk + (_conv_out(_conv_out(_conv_out(tail))) if tail else 0)


class QwenAudioEncoder:
    """Clips → audio-token embeddings through a Qwen3-Omni Thinker's ``audio_tower``."""

    def __init__(self, audio_tower: Any) -> None:
        from transformers import WhisperFeatureExtractor

        config = audio_tower.config
        self.tower = audio_tower
        self.n_window = int(config.n_window)
        self.features = WhisperFeatureExtractor(
            feature_size=int(config.num_mel_bins),
            sampling_rate=AUDIO_INPUT_RATE,
            hop_length=_HOP,
            n_fft=_N_FFT,
            padding_value=0.0,
            return_attention_mask=True,
        )
        weight = next(audio_tower.parameters())
        self.device, self.dtype = weight.device, weight.dtype

    def embed(self, clips: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[sum of num_audio_tokens(clip), output_dim]``: every clip's tokens, in order."""
        rows = []
        for clip in clips:
            # Whole frames: the prompt's token count is computed from the same length.
            frames = _num_frames(clip.numel())
            samples = np.zeros(frames * _HOP, dtype=np.float32)
            samples[: clip.numel()] = clip.numpy()
            feats = self.features(
                samples,
                sampling_rate=AUDIO_INPUT_RATE,
                padding="do_not_pad",
                return_tensors="pt",
                truncation=False,
            )
            mel = feats["input_features"][0]  # [mel bins, frames]
            mel = mel[:, :frames].to(self.device, self.dtype)
            lengths = torch.tensor([frames], dtype=torch.long, device=self.device)
            out = self.tower(mel, feature_lens=lengths, return_dict=True).last_hidden_state
            expected = num_audio_tokens(clip.numel(), self.n_window)
            if out.shape[0] != expected:
                raise ModelError(
                    f"the audio encoder made {out.shape[0]} tokens of a {clip.numel()}-sample clip; "
                    f"the prompt reserves {expected}"
                )
            rows.append(out)
        return torch.cat(rows) if rows else torch.zeros(0)

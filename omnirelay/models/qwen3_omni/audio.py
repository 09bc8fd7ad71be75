"""Qwen3-Omni's audio encoder: how many audio tokens a clip takes, and clips → embeddings.

A request's clips arrive as :mod:`omnirelay.models.inputs` says (16 kHz mono float32).

* :func:`num_audio_tokens` — how many ``<|audio_pad|>`` positions Qwen3-Omni's audio
  encoder fills for a clip of ``num_samples`` samples (the prompt reserves exactly that
  many; :class:`QwenAudioEncoder` checks it).
* :class:`QwenAudioEncoder` — a Thinker's audio tower with a Whisper-style feature
  extractor built from the tower's config (no files read): clips → one embedding row per
  audio token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnirelay.errors import ModelError
from omnirelay.models.inputs import AUDIO_INPUT_RATE

__all__ = [
    "QwenAudioEncoder",
    "num_audio_tokens",
]

#: Whisper-style features: a 25 ms window every 10 ms at 16 kHz.
_HOP = 160
_N_FFT = 400
#: the shortest clip the features are computed on (shorter ones are zero-padded): the
#: STFT's reflection padding needs more samples than half its window
_MIN_FRAMES = 3


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

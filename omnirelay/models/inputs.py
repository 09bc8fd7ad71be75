"""A request's audio and image input, as the stage that hears or sees it receives it
(docs/protocol.md §1.9).

The contract of a request's media on its way into a pipeline, the same for every family:
the entry stage's full input (``inputs``) is ``{"audio": [clip, ...], "sample_rate":
AUDIO_INPUT_RATE}``, each clip a 1-D float32 mono waveform at :data:`AUDIO_INPUT_RATE`
(16 kHz, the rate of both Qwen3-Omni's audio encoder and PocketSphinx's acoustic model),
and ``"images": [image, ...]``, each an RGB ``uint8`` tensor ``[height, width, 3]``
already resized to the size the model takes it at
(:meth:`~omnirelay.models.family.PromptSide.fit_image`), both in the order the clips and
images appear in the conversation.

* :func:`audio_inputs` / :func:`image_inputs` — those entries from waveforms and pixel
  arrays (the serving layer builds them).
* :func:`read_audio_inputs` / :func:`read_image_inputs` — the clips and images of an
  entry stage's ``inputs`` (an empty list when the request carries none), checked: a stage
  given something else fails the request with a message that names the contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from omnirelay.errors import ModelError

__all__ = ["AUDIO_INPUT_RATE", "audio_inputs", "image_inputs", "read_audio_inputs", "read_image_inputs"]

#: The rate of every clip of a request's audio input.
AUDIO_INPUT_RATE = 16_000


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


def image_inputs(images: Sequence[Any]) -> list[torch.Tensor]:
    """The ``"images"`` entry of an entry stage's ``inputs`` (RGB uint8 ``[H, W, 3]``)."""
    # torch shares a numpy array's memory and needs it writable (Pillow's arrays are not)
    return [torch.from_numpy(np.require(img, dtype=np.uint8, requirements=["C", "W"])) for img in images]


def read_image_inputs(inputs: Any, who: str) -> list[torch.Tensor]:
    """The images of an entry stage's ``inputs``; ``[]`` when it carries none. ``who``
    names the stage and request in errors."""
    if not isinstance(inputs, Mapping) or "images" not in inputs:
        return []
    images = inputs["images"]
    if not isinstance(images, list | tuple):
        raise ModelError(f"{who}: inputs['images'] must be a list of images, got {type(images).__name__}")
    out = []
    for i, img in enumerate(images):
        t = torch.as_tensor(img)
        if t.dim() != 3 or t.shape[2] != 3 or t.dtype != torch.uint8 or t.numel() == 0:
            raise ModelError(
                f"{who}: image {i} must be an RGB uint8 [height, width, 3] tensor, got "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
        out.append(t)
    return out

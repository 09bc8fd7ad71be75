"""The Thinker's own encoders of a request's audio clips and images (docs/protocol.md §1.9).

:class:`ThinkerMedia` builds each tower's encoder on first use and checks that a prompt
reserves exactly one pad position per encoded row; the Thinker executor
(:mod:`omnirelay.models.qwen3_omni.thinker`) places the rows into the prompt's embeddings.
"""

from __future__ import annotations

from typing import Any

import torch

from omnirelay.engine.interfaces import BatchItem
from omnirelay.errors import ModelError
from omnirelay.models.inputs import read_audio_inputs, read_image_inputs
from omnirelay.models.qwen3_omni.audio import QwenAudioEncoder
from omnirelay.models.qwen3_omni.vision import ImageEmbeds, QwenImageEncoder, VisionLayout

__all__ = ["ThinkerMedia"]


class ThinkerMedia:
    """Encodes a request's images and audio clips with the Thinker's own towers."""

    def __init__(self, model: Any, vision: VisionLayout | None) -> None:
        self.model = model  # Qwen3OmniMoeThinkerForConditionalGeneration
        self.vision = vision
        self.audio_token_id: int | None = getattr(model.config, "audio_token_id", None)
        self.image_token_id: int | None = getattr(model.config, "image_token_id", None)
        self._audio_encoder: QwenAudioEncoder | None = None
        self._image_encoder: QwenImageEncoder | None = None
        #: audio clips and images encoded so far
        self.num_audio_clips = 0
        self.num_images = 0

    def images(self, item: BatchItem, *, static: bool) -> ImageEmbeds | None:
        """The vision tower's rows of the request's images; None without images. The
        prompt must reserve exactly one ``<|image_pad|>`` per row; ``static`` (the static
        runner) takes none."""
        who = f"request {item.external_id!r}"
        images = read_image_inputs(item.inputs, who)
        token = self.image_token_id
        num_pads = 0 if token is None else item.all_token_ids.count(token)
        if not images:
            if num_pads:
                raise ModelError(f"{who}: the prompt has {num_pads} image positions but no image input")
            return None
        if token is None or self.vision is None:
            raise ModelError(f"{who}: this Thinker has no vision tower; it cannot take image input")
        if static:
            raise ModelError(
                f"{who}: the static runner takes no image input (its captured decoder has no 3-D "
                "positions or deepstack inputs); run the Thinker with executor_args.runner: dynamic"
            )
        if self._image_encoder is None:
            visual = getattr(self.model.model, "visual", None) or self.model.visual
            self._image_encoder = QwenImageEncoder(visual, self.vision)
        embeds = self._image_encoder.embed(images)
        if embeds.rows.shape[0] != num_pads:
            raise ModelError(
                f"{who}: the prompt has {num_pads} image positions but its {len(images)} image(s) make "
                f"{embeds.rows.shape[0]} image tokens"
            )
        self.num_images += len(images)
        return embeds

    def audio(self, item: BatchItem) -> torch.Tensor | None:
        """The audio-token rows of the request's clips; None without audio. The prompt must
        reserve exactly one ``<|audio_pad|>`` per row."""
        who = f"request {item.external_id!r}"
        clips = read_audio_inputs(item.inputs, who)
        num_pads = 0 if self.audio_token_id is None else item.all_token_ids.count(self.audio_token_id)
        if not clips:
            if num_pads:
                raise ModelError(f"{who}: the prompt has {num_pads} audio positions but no audio input")
            return None
        if self.audio_token_id is None:
            raise ModelError(f"{who}: this Thinker has no audio token; it cannot take audio input")
        if self._audio_encoder is None:
            # Where the text decoder is, the encoders are too (see the executor's __init__).
            tower = getattr(self.model.model, "audio_tower", None) or self.model.audio_tower
            self._audio_encoder = QwenAudioEncoder(tower)
        rows = self._audio_encoder.embed(clips)
        if rows.shape[0] != num_pads:
            raise ModelError(
                f"{who}: the prompt has {num_pads} audio positions but its {len(clips)} clip(s) make "
                f"{rows.shape[0]} audio tokens"
            )
        self.num_audio_clips += len(clips)
        return rows

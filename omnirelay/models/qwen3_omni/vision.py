"""Qwen3-Omni's image input: its layout, its vision encoder, its rotary positions.

A request's images arrive as :mod:`omnirelay.models.inputs` says (RGB ``uint8``, already
resized to the Thinker's processor grid, :meth:`VisionLayout.fit`). The prompt lays each
image out as ``<|vision_start|>`` + N × ``<|image_pad|>`` +
``<|vision_end|>`` with N = :meth:`VisionLayout.num_tokens`.

* :class:`VisionLayout` — the image processor's numbers (patch size, temporal patch size,
  merge size, min/max pixels, mean/std): from the vision config and the checkpoint's
  ``preprocessor_config.json`` when it has one (no download); the front and the Thinker
  use the same one. :func:`vision_layout` reads it for a stage's ``executor_args``.
* :class:`QwenImageEncoder` — images → the vision tower's merged embeddings (one row per
  image token) and its deepstack features (fed into the first text layers), through
  ``transformers``' Qwen2-VL image processor built from the layout (no files read).
* :func:`mrope_positions` — the 3-D (temporal, height, width) rotary positions of a
  prompt with images, and the rope delta that positions after the prompt continue from:
  exactly ``get_rope_index`` of ``transformers``' Qwen3-Omni Thinker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnirelay.errors import ModelError

__all__ = [
    "ImageEmbeds",
    "QwenImageEncoder",
    "VisionLayout",
    "mrope_positions",
    "vision_layout",
]

#: Qwen2-VL's processor defaults where a checkpoint has no preprocessor file: at least 4
#: and at most 1280 image tokens per image.
_MIN_TOKENS, _MAX_TOKENS = 4, 1280
#: Qwen3's vision towers normalize to [-1, 1]
_MEAN = (0.5, 0.5, 0.5)
_STD = (0.5, 0.5, 0.5)
#: the largest aspect ratio Qwen's processor takes
_MAX_ASPECT = 200


@dataclass(frozen=True, slots=True)
class VisionLayout:
    """How an image becomes vision tokens (see the module docstring)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...] = _MEAN
    image_std: tuple[float, ...] = _STD

    @classmethod
    def from_config(cls, vision_config: Any, preprocessor: Mapping[str, Any] | None = None) -> VisionLayout:
        """The layout of a vision tower's config, with a checkpoint's preprocessor values
        (``min_pixels``/``max_pixels`` or ``size.shortest_edge``/``longest_edge``, mean, std)."""
        pre = dict(preprocessor or {})
        patch = int(vision_config.patch_size)
        merge = int(vision_config.spatial_merge_size)
        factor = (patch * merge) ** 2
        given = pre.get("size")
        size: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
        min_pixels = pre.get("min_pixels", size.get("shortest_edge", _MIN_TOKENS * factor))
        max_pixels = pre.get("max_pixels", size.get("longest_edge", _MAX_TOKENS * factor))
        return cls(
            patch_size=patch,
            temporal_patch_size=int(vision_config.temporal_patch_size),
            merge_size=merge,
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=tuple(float(v) for v in pre.get("image_mean", _MEAN)),
            image_std=tuple(float(v) for v in pre.get("image_std", _STD)),
        )

    @property
    def factor(self) -> int:
        """Image sides are multiples of this (one merged token is factor × factor pixels)."""
        return self.patch_size * self.merge_size

    def fit(self, height: int, width: int) -> tuple[int, int]:
        """The size Qwen's processor resizes a ``height`` × ``width`` image to: sides
        rounded to multiples of :attr:`factor`, scaled (keeping the aspect ratio) into
        [min_pixels, max_pixels]. ValueError for an aspect ratio past 200."""
        if height <= 0 or width <= 0:
            raise ValueError(f"an image of {width}x{height} pixels has no area")
        if max(height, width) / min(height, width) > _MAX_ASPECT:
            raise ValueError(
                f"a {width}x{height} image is too narrow: the aspect ratio must be at most {_MAX_ASPECT}"
            )
        f = self.factor
        h = max(f, round(height / f) * f)
        w = max(f, round(width / f) * f)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return h, w

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patches of an image already at a :meth:`fit` size."""
        if height % self.factor or width % self.factor:
            raise ValueError(f"{width}x{height} is not a multiple of {self.factor} pixels a side")
        return 1, height // self.patch_size, width // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """``<|image_pad|>`` positions of an image at a :meth:`fit` size."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size**2


def vision_layout(**executor_args: Any) -> VisionLayout | None:
    """The :class:`VisionLayout` of the Thinker a stage's ``executor_args`` name (None
    when it has no vision tower)."""
    from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs

    args = ModelArgs.from_executor_args(executor_args)
    checkpoint = Checkpoint.open(args.resolve_dir(), load_format=args.load_format)
    return layout_of_checkpoint(checkpoint.config, checkpoint.path)


def layout_of_checkpoint(config: Any, path: Path | None) -> VisionLayout | None:
    """The layout of a composite config, with ``path``'s ``preprocessor_config.json``."""
    vision = getattr(getattr(config, "thinker_config", None), "vision_config", None)
    if vision is None or getattr(config.thinker_config, "image_token_id", None) is None:
        return None
    preprocessor = None
    file = path / "preprocessor_config.json" if path is not None else None
    if file is not None and file.is_file():
        try:
            preprocessor = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {file}: {exc}") from exc
    return VisionLayout.from_config(vision, preprocessor)


@dataclass(slots=True)
class ImageEmbeds:
    """A request's images through the vision tower, in prompt order."""

    #: one row per image token ``[N, D]``
    rows: torch.Tensor
    #: per deepstack layer, one row per image token ``[N, D]``
    deepstack: list[torch.Tensor] = field(default_factory=list)
    #: each image's ``(t, h, w)`` patch grid
    grids: list[tuple[int, int, int]] = field(default_factory=list)


class QwenImageEncoder:
    """Images → vision-token embeddings through a Qwen3-Omni Thinker's ``visual`` tower."""

    def __init__(self, visual: Any, layout: VisionLayout) -> None:
        import transformers

        # The Pillow backend (torchvision is not a dependency); in earlier 5.x releases it
        # is the class itself.
        processor_class: Any = getattr(transformers, "Qwen2VLImageProcessorPil", None)
        if processor_class is None:
            processor_class = transformers.Qwen2VLImageProcessor

        self.visual = visual
        self.layout = layout
        self.processor = processor_class(
            patch_size=layout.patch_size,
            temporal_patch_size=layout.temporal_patch_size,
            merge_size=layout.merge_size,
            size={"shortest_edge": layout.min_pixels, "longest_edge": layout.max_pixels},
            image_mean=list(layout.image_mean),
            image_std=list(layout.image_std),
        )
        weight = next(visual.parameters())
        self.device, self.dtype = weight.device, weight.dtype

    def pixels(self, images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of the processor for ``images``."""
        arrays = [img.numpy() for img in images]
        # channels_last said outright: a tiny image ([1, 1, 3]) looks channels-first otherwise
        out = self.processor(images=arrays, return_tensors="pt", input_data_format="channels_last")
        return out["pixel_values"], out["image_grid_thw"]

    def embed(self, images: Sequence[torch.Tensor]) -> ImageEmbeds:
        """Every image's tokens, in order; each image's count checked against the layout."""
        pixel_values, grid_thw = self.pixels(images)
        for img, grid in zip(images, grid_thw.tolist()):
            expected = self.layout.grid(int(img.shape[0]), int(img.shape[1]))
            if tuple(grid) != expected:
                raise ModelError(
                    f"the image processor made a {tuple(grid)} grid of a {img.shape[1]}x{img.shape[0]} "
                    f"image; the prompt reserves {expected}"
                )
        out = self.visual(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw.to(self.device))
        rows = out.pooler_output
        deepstack = list(out.deepstack_features or [])
        return ImageEmbeds(rows=rows, deepstack=deepstack, grids=[tuple(g) for g in grid_thw.tolist()])


def mrope_positions(
    token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]], merge_size: int
) -> tuple[torch.Tensor, int]:
    """``[3, len(token_ids)]`` positions and the rope delta (every later position ``i``
    is ``i + delta`` on all three axes). Text (and audio) tokens count up one by one; the
    tokens of image ``k`` (a run of ``image_token_id``) sit on its merged grid — temporal
    0, height row, width column, each offset by the position the image starts at — and
    the text after it starts past the grid's largest position."""
    ids = [int(t) for t in token_ids]
    out = torch.empty((3, len(ids)), dtype=torch.long)
    pos = 0
    i = 0
    k = 0
    n = len(ids)
    while i < n:
        if ids[i] != image_token_id:
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        if k >= len(grids):
            raise ModelError(f"the prompt has more image runs than its {len(grids)} image(s)")
        t, h, w = grids[k]
        if t != 1:
            raise ModelError(f"image {k} has a temporal grid of {t}; an image has one (t = 1)")
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        if ids[i : i + count] != [image_token_id] * count or (
            i + count < n and ids[i + count] == image_token_id
        ):
            raise ModelError(f"image {k} needs {count} consecutive image tokens in the prompt")
        rows = torch.arange(gh).view(gh, 1).expand(gh, gw).reshape(-1)
        cols = torch.arange(gw).view(1, gw).expand(gh, gw).reshape(-1)
        out[0, i : i + count] = pos
        out[1, i : i + count] = pos + rows
        out[2, i : i + count] = pos + cols
        pos += max(gh, gw)
        i += count
        k += 1
    if k != len(grids):
        raise ModelError(f"the prompt lays out {k} image(s) but the request carries {len(grids)}")
    return out, pos - n

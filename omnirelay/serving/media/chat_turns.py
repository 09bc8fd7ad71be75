"""A user turn that carries audio or images, into the pipeline (docs/protocol.md §1.9, §7.1).

* :func:`decode_turns` — the ``input_audio`` parts of chat turns decoded
  (:mod:`omnirelay.serving.media.audio_in`) at :data:`~omnirelay.models.inputs.AUDIO_INPUT_RATE`,
  and the ``image_url`` parts (:mod:`omnirelay.serving.media.image_in`) resized to the
  size the model takes them at (:meth:`~omnirelay.models.family.PromptSide.fit_image`),
  with the server's limits over all parts together; 400s name the part.
* :func:`submit_turns` — decoded turns (text, waveforms at that rate, images) submitted
  the way the pipeline hears audio and sees images:

  - a pipeline with an ``entry_input: audio`` stage (``voice-cpu``): the request enters at
    the recognizer with the clips as its input; the turns travel in ``extras`` with each
    clip's place marked, and the recognizer's transcript takes it (``asr_to_thinker``);
  - a prompt stage whose model hears audio or sees images in its prompt (a Qwen3-Omni
    Thinker): its prompt side lays each clip and each image out as the model expects
    (:meth:`~omnirelay.models.family.PromptSide.encode_chat_media`) and the clips and
    images go with it (:mod:`omnirelay.models.inputs`), for its own encoders;
  - turns without audio: the plain chat prompt, at the prompt stage (nothing is paid for
    the recognizer: the request skips it).

  Anything else (audio for a pipeline that cannot hear, images for one that cannot see)
  is a 400. With ``tooling`` (:class:`~omnirelay.models.tools.ToolPrompt`) each path
  makes the prompt in the model's own chat template with the tools, calls and tool
  results (:meth:`~omnirelay.models.family.PromptSide.encode_chat_tools`; after
  recognition, the tools travel in ``extras``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from omnirelay.api import SamplingParams
from omnirelay.models.family import AudioSlot, ImageSlot
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs, image_inputs
from omnirelay.models.tools import TOOLS_EXTRA, ToolPrompt
from omnirelay.serving.errors import ApiError
from omnirelay.serving.frontend import STREAMED, Frontend, RequestStream
from omnirelay.serving.media.audio_in import AudioInputError, AudioLimits, decode_base64_audio
from omnirelay.serving.media.image_in import ImageInputError, ImageLimits, decode_image_url
from omnirelay.serving.protocol import AudioPart, ImagePart, Turn

__all__ = ["DecodedImage", "DecodedTurn", "decode_turns", "hears_audio", "sees_images", "submit_turns"]


class DecodedImage:
    """An image part decoded and resized to the model's size: RGB uint8 ``[H, W, 3]``."""

    __slots__ = ("pixels",)

    def __init__(self, pixels: np.ndarray) -> None:
        self.pixels = pixels


#: One message with its media decoded: role, then text, waveforms (float32, 16 kHz) and images.
DecodedTurn = tuple[str, list[str | np.ndarray | DecodedImage]]


def hears_audio(fe: Frontend) -> bool:
    """Whether the pipeline takes audio input (a recognizer stage, or a prompt stage that
    hears audio in its prompt)."""
    if fe.pipeline.config.audio_entry_stage_id is not None:
        return True
    return fe.prompts.hears_audio


def sees_images(fe: Frontend) -> tuple[bool, str | None]:
    """Whether the pipeline takes image input (a Thinker with a vision tower on a runner
    that feeds it), and why not when it has a tower it cannot use."""
    return fe.prompts.sees_images, fe.prompts.image_refusal


async def decode_turns(fe: Frontend, turns: Sequence[Turn]) -> list[DecodedTurn]:
    """Every ``input_audio`` and ``image_url`` part decoded (in a worker thread: FFmpeg's
    and Pillow's decoding is not the event loop's work); a 400 for the first part that
    breaks a limit or cannot be read."""
    media = [p for _, ps in turns for p in ps if not isinstance(p, str)]
    if not media:
        return [(role, [p for p in ps if isinstance(p, str)]) for role, ps in turns]
    decoded = await asyncio.to_thread(_decode_media, fe, media)
    it = iter(decoded)
    return [(role, [p if isinstance(p, str) else next(it) for p in ps]) for role, ps in turns]


def _decode_media(fe: Frontend, media: list[AudioPart | ImagePart]) -> list[np.ndarray | DecodedImage]:
    audio = [p for p in media if isinstance(p, AudioPart)]
    images = [p for p in media if isinstance(p, ImagePart)]
    clips = iter(_decode_all(audio, _audio_limits(fe)) if audio else [])
    pictures = iter(_decode_images(images, fe) if images else [])
    return [next(clips) if isinstance(p, AudioPart) else next(pictures) for p in media]


def _audio_limits(fe: Frontend) -> AudioLimits:
    return AudioLimits(max_bytes=fe.config.max_audio_input_bytes, max_duration_s=fe.config.max_audio_input_s)


def _decode_images(parts: list[ImagePart], fe: Frontend) -> list[DecodedImage]:
    """Each image decoded within the limits and resized (bicubic, as Qwen's processor) to
    the size the model takes it at."""
    from PIL import Image

    prompts = fe.prompts
    if not prompts.sees_images:  # parts() refused them already
        raise ApiError(400, f"model {fe.model_name!r} takes no image input; send text parts only")
    limits = ImageLimits(
        max_bytes=fe.config.max_image_input_bytes, max_pixels=fe.config.max_image_input_pixels
    )
    out = []
    total_bytes = 0
    for part in parts:
        total_bytes += len(part.url) * 3 // 4
        try:
            pixels = decode_image_url(part.url, limits=limits, param=part.param)
            if total_bytes > limits.max_bytes:
                raise ImageInputError(
                    f"{part.param}.url: the request's images are about {total_bytes} bytes; the limit is "
                    f"{limits.max_bytes} bytes for all parts together (max_image_input_bytes)",
                    param=f"{part.param}.url",
                )
            height, width = pixels.shape[:2]
            try:
                size = prompts.fit_image(height, width)
            except ValueError as exc:
                raise ImageInputError(f"{part.param}.url: {exc}", param=f"{part.param}.url") from exc
        except ImageInputError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        if size != (height, width):
            img = Image.fromarray(pixels).resize((size[1], size[0]), Image.Resampling.BICUBIC)
            pixels = np.asarray(img, dtype=np.uint8)
        out.append(DecodedImage(pixels))
    return out


def _decode_all(parts: list[AudioPart], limits: AudioLimits) -> list[np.ndarray]:
    out = []
    total_bytes = 0
    total_samples = 0
    for part in parts:
        total_bytes += len(part.data) * 3 // 4
        try:
            # A part over the limits on its own is refused as such, before the totals.
            clip = decode_base64_audio(
                part.data, part.format, sample_rate=AUDIO_INPUT_RATE, limits=limits, param=part.param
            )
            if total_bytes > limits.max_bytes:
                raise AudioInputError(
                    f"{part.param}.data: the request's input audio is about {total_bytes} bytes; the "
                    f"limit is {limits.max_bytes} bytes for all parts together (max_audio_input_bytes)",
                    param=f"{part.param}.data",
                )
            total_samples += clip.size
            if total_samples > limits.max_duration_s * AUDIO_INPUT_RATE:
                raise AudioInputError(
                    f"{part.param}.data: the request's input audio is {total_samples / AUDIO_INPUT_RATE:.1f} s; "
                    f"the limit is {limits.max_duration_s:g} s for all parts together (max_audio_input_s)",
                    param=f"{part.param}.data",
                )
        except AudioInputError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        out.append(clip)
    return out


def submit_turns(
    fe: Frontend,
    *,
    endpoint: str,
    turns: Sequence[DecodedTurn],
    modalities: Sequence[str],
    request_id: str,
    sampling: SamplingParams | None = None,
    extras: dict[str, Any] | None = None,
    session: str | None = None,
    delivery: str = STREAMED,
    tooling: ToolPrompt | None = None,
) -> tuple[RequestStream, list[int]]:
    """Start a chat request of ``turns`` (see the module docstring); returns its stream
    and the prompt the front made (empty when the prompt is made after recognition).
    ``session``: the conversation it belongs to (replica affinity); ``delivery``: how the
    route hands the answer to its client (:meth:`Frontend.submit`)."""
    extras = dict(extras or {})
    clips = [p for _, ps in turns for p in ps if isinstance(p, np.ndarray)]
    images = [p.pixels for _, ps in turns for p in ps if isinstance(p, DecodedImage)]
    config = fe.pipeline.config
    # Images, or audio without a recognizer stage: the prompt stage's model sees them itself.
    if images or (clips and config.audio_entry_stage_id is None):
        return _submit_media(
            fe,
            endpoint,
            turns,
            modalities,
            request_id,
            sampling,
            extras,
            clips=clips,
            images=images,
            tooling=tooling,
            session=session,
            delivery=delivery,
        )
    if not clips:
        prompt = _encode_text(fe, [(role, "".join(str(p) for p in ps)) for role, ps in turns], tooling)
        stream = fe.submit(
            endpoint=endpoint,
            prompt_token_ids=prompt,
            modalities=modalities,
            request_id=request_id,
            sampling=sampling,
            extras=extras,
            session=session,
            delivery=delivery,
        )
        return stream, prompt
    # Audio, heard first by the recognizer stage: the front makes no prompt.
    marked: list[list[Any]] = []
    k = 0
    for role, ps in turns:
        parts: list[Any] = []
        for p in ps:
            if isinstance(p, np.ndarray):
                parts.append({"audio": k})
                k += 1
            else:
                parts.append(p)
        marked.append([role, parts])
    extras["chat_turns"] = marked
    if tooling is not None:
        extras[TOOLS_EXTRA] = tooling.extra()
    stream = fe.submit(
        endpoint=endpoint,
        prompt_token_ids=[0],  # a generation stage's prompt: its input is the audio
        modalities=modalities,
        request_id=request_id,
        sampling=sampling,
        extras=extras,
        inputs=audio_inputs(clips),
        entry_stage_id=config.audio_entry_stage_id,
        session=session,
        delivery=delivery,
    )
    return stream, []


def _submit_media(
    fe: Frontend,
    endpoint: str,
    turns: Sequence[DecodedTurn],
    modalities: Sequence[str],
    request_id: str,
    sampling: SamplingParams | None,
    extras: dict[str, Any],
    *,
    clips: list[np.ndarray],
    images: list[np.ndarray],
    session: str | None = None,
    delivery: str = STREAMED,
    tooling: ToolPrompt | None = None,
) -> tuple[RequestStream, list[int]]:
    """A request with clips and images laid out in the prompt stage's own prompt."""
    prompts = fe.prompts
    if clips and not prompts.hears_audio:
        raise ApiError(400, f"model {fe.model_name!r} takes no audio input; send text parts only")
    if images and not prompts.sees_images:
        raise ApiError(400, f"model {fe.model_name!r} takes no image input; send text parts only")
    laid_out = [(role, [_slot(p) for p in ps]) for role, ps in turns]
    try:
        prompt = prompts.encode_chat_media(laid_out, tooling)
    except ValueError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from exc
    inputs: dict[str, Any] = audio_inputs(clips) if clips else {}
    if images:
        inputs["images"] = image_inputs(images)
    stream = fe.submit(
        endpoint=endpoint,
        prompt_token_ids=prompt,
        modalities=modalities,
        request_id=request_id,
        sampling=sampling,
        extras=extras,
        inputs=inputs,
        session=session,
        delivery=delivery,
    )
    return stream, prompt


def _encode_text(fe: Frontend, turns: list[tuple[str, str]], tooling: ToolPrompt | None) -> list[int]:
    if tooling is None:
        return fe.prompts.encode_chat(turns)
    try:
        return fe.prompts.encode_chat_tools(turns, tooling)
    except ValueError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from exc


def _slot(part: str | np.ndarray | DecodedImage) -> str | AudioSlot | ImageSlot:
    if isinstance(part, str):
        return part
    if isinstance(part, DecodedImage):
        height, width = part.pixels.shape[:2]
        return ImageSlot(height, width)
    return AudioSlot(part.size)

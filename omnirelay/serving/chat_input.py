"""A user turn that carries audio, into the pipeline (docs/protocol.md §1.9, §7.1).

* :func:`decode_turns` — the ``input_audio`` parts of chat turns decoded
  (:mod:`omnirelay.serving.audio_input`) at :data:`~omnirelay.models.audio_in.AUDIO_INPUT_RATE`,
  with the server's limits over all parts together; 400s name the part.
* :func:`submit_turns` — decoded turns (text, and waveforms at that rate) submitted the
  way the pipeline hears audio:

  - a pipeline with an ``entry_input: audio`` stage (``voice-cpu``): the request enters at
    the recognizer with the clips as its input; the turns travel in ``extras`` with each
    clip's place marked, and the recognizer's transcript takes it (``asr_to_thinker``);
  - a Qwen3-Omni Thinker: the prompt lays each clip out as audio placeholders
    (``<|audio_start|>``, one ``<|audio_pad|>`` per audio token, ``<|audio_end|>``) and the
    clips go with it, for the Thinker's own audio encoder;
  - turns without audio: the plain chat prompt, at the prompt stage (nothing is paid for
    the recognizer: the request skips it).

  Anything else (audio for a pipeline that cannot hear) is a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.models.audio_in import AUDIO_INPUT_RATE, audio_inputs, num_audio_tokens
from omnirelay.serving.audio_input import AudioInputError, AudioLimits, decode_base64_audio
from omnirelay.serving.errors import ApiError
from omnirelay.serving.frontend import Frontend, RequestStream
from omnirelay.serving.protocol import AudioPart, Turn
from omnirelay.serving.text import ChatMLCodec

__all__ = ["DecodedTurn", "decode_turns", "hears_audio", "submit_turns"]

#: One message with its audio decoded: role, then text and waveforms (float32, 16 kHz).
DecodedTurn = tuple[str, list[str | np.ndarray]]


def hears_audio(fe: Frontend) -> bool:
    """Whether the pipeline takes audio input (a recognizer stage, or a Thinker with an
    audio encoder)."""
    if fe.pipeline.config.audio_entry_stage_id is not None:
        return True
    return isinstance(fe.codec, ChatMLCodec) and fe.codec.audio_window is not None


async def decode_turns(fe: Frontend, turns: Sequence[Turn]) -> list[DecodedTurn]:
    """Every ``input_audio`` part decoded (in a worker thread: FFmpeg's decoding is not
    the event loop's work); a 400 for the first part that breaks a limit or cannot be read."""
    limits = AudioLimits(
        max_bytes=fe.config.max_audio_input_bytes, max_duration_s=fe.config.max_audio_input_s
    )
    parts = [p for _, ps in turns for p in ps if isinstance(p, AudioPart)]
    if not parts:
        return [(role, [p for p in ps if isinstance(p, str)]) for role, ps in turns]
    decoded = await asyncio.to_thread(_decode_all, parts, limits)
    it = iter(decoded)
    return [(role, [next(it) if isinstance(p, AudioPart) else p for p in ps]) for role, ps in turns]


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
) -> tuple[RequestStream, list[int]]:
    """Start a chat request of ``turns`` (see the module docstring); returns its stream
    and the prompt the front made (empty when the prompt is made after recognition)."""
    extras = dict(extras or {})
    clips = [p for _, ps in turns for p in ps if isinstance(p, np.ndarray)]
    if not clips:
        prompt = fe.codec.encode_chat([(role, "".join(str(p) for p in ps)) for role, ps in turns])
        stream = fe.submit(
            endpoint=endpoint,
            prompt_token_ids=prompt,
            modalities=modalities,
            request_id=request_id,
            sampling=sampling,
            extras=extras,
        )
        return stream, prompt
    config = fe.pipeline.config
    if config.audio_entry_stage_id is not None:
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
        stream = fe.submit(
            endpoint=endpoint,
            prompt_token_ids=[0],  # a generation stage's prompt: its input is the audio
            modalities=modalities,
            request_id=request_id,
            sampling=sampling,
            extras=extras,
            inputs=audio_inputs(clips),
            entry_stage_id=config.audio_entry_stage_id,
        )
        return stream, []
    codec = fe.codec
    if not isinstance(codec, ChatMLCodec) or codec.audio_window is None:
        raise ApiError(400, f"model {fe.model_name!r} takes no audio input; send text parts only")
    window = codec.audio_window
    laid_out = [
        (role, [num_audio_tokens(p.size, window) if isinstance(p, np.ndarray) else p for p in ps])
        for role, ps in turns
    ]
    try:
        prompt = codec.encode_chat_audio(laid_out)
    except ValueError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from exc
    stream = fe.submit(
        endpoint=endpoint,
        prompt_token_ids=prompt,
        modalities=modalities,
        request_id=request_id,
        sampling=sampling,
        extras=extras,
        inputs=audio_inputs(clips),
    )
    return stream, prompt

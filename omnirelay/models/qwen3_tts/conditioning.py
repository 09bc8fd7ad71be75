"""What the Talker reads for one request: the prefill and the text fed frame by frame.

A speech request's prompt is the assistant turn the reference writes,
``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`` (token ids), and the
request's voice: a speaker (CustomVoice), a language (``auto`` by default), and an
instruction in natural language (``<|im_start|>user\\n{instruction}<|im_end|>\\n``, the
1.7B models). :func:`build_conditioning` lays them out as the reference's ``generate``
does:

* the instruction's projected text embeddings first, when there is one;
* the turn header (3 rows), then TTS pad rows and TTS BOS, each summed with the codec
  prefix: think (with the language id) or no-think, the speaker, codec pad;
* **text in the prefill** (``text_streaming=False``, the reference's default for
  CustomVoice and VoiceDesign): every text token and TTS EOS with codec pad, then TTS pad
  with codec BOS; each frame after reads TTS pad;
* **text streamed** (``text_streaming=True``): only the first text token (with codec BOS)
  in the prefill; frame ``k`` reads text token ``k + 1``, then TTS EOS, then TTS pad.

A dialect speaker (Sichuan's ``eric``, Beijing's ``dylan``) speaks its dialect when the
language is ``auto`` or ``chinese``. Unknown speakers and languages are a
:class:`~omnirelay.errors.ModelError` that lists the known ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnirelay.errors import ModelError
from omnirelay.models.qwen3_tts.model_config import TTSConfig
from omnirelay.models.qwen3_tts.talker_model import TTSTalker

__all__ = ["Conditioning", "Voice", "build_conditioning", "codec_prefix", "spoken_ids"]

#: ``<|im_start|>assistant\n`` before the text, ``<|im_end|>\n<|im_start|>assistant\n`` after.
_HEAD, _TAIL = 3, 5


@dataclass(frozen=True, slots=True)
class Voice:
    """How a request is spoken: ``speaker`` (None: the model names none — VoiceDesign),
    ``language`` (``auto`` or one of the model's), ``instruct_ids`` (the instruction turn's
    token ids, or None)."""

    speaker: str | None = None
    language: str = "auto"
    instruct_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Conditioning:
    """``prefill [L, H]``; ``text [n, H]``: the rows frames ``0 .. n−1`` add (then ``pad [1, H]``)."""

    prefill: torch.Tensor
    text: torch.Tensor
    pad: torch.Tensor

    def text_row(self, frame: int) -> torch.Tensor:
        """The text row the Talker's input for frame ``frame`` (0: the first decode) adds."""
        return self.text[frame : frame + 1] if frame < self.text.shape[0] else self.pad


def spoken_ids(config: TTSConfig, prompt: Sequence[int]) -> list[int]:
    """The text ids of a speech prompt (between the turn header and its end), checked."""
    ids = [int(t) for t in prompt]
    start, end = config.im_start_token_id, config.im_end_token_id
    if len(ids) < _HEAD + _TAIL + 1 or ids[0] != start or ids[-_TAIL] != end or ids[-3] != start:
        raise ModelError(
            "a Qwen3-TTS prompt is <|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n "
            f"with a non-empty text; got {len(ids)} ids that are not (a Talker request is not recomputed "
            "after a preemption either: its codes cannot be taken back)"
        )
    return ids[_HEAD:-_TAIL]


def codec_prefix(config: TTSConfig, voice: Voice) -> list[int]:
    """The codec ids of the prefill: think/no-think (with the language), the speaker, pad, BOS."""
    talker = config.talker_config
    language = voice.language.lower()
    language_id: int | None = None
    if language != "auto":
        if language not in talker.codec_language_id:
            raise ModelError(
                f"unknown language {voice.language!r}; this model knows {list(talker.languages)}"
            )
        language_id = talker.codec_language_id[language]
    speaker = voice.speaker.lower() if voice.speaker else None
    if speaker is not None and speaker not in talker.spk_id:
        raise ModelError(f"unknown speaker {voice.speaker!r}; this model has {list(talker.speakers)}")
    if speaker is not None and language in ("auto", "chinese"):
        dialect = talker.spk_is_dialect.get(speaker, False)
        if dialect is not False:
            language_id = talker.codec_language_id[dialect]
    if language_id is None:
        prefix = [talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id]
    else:
        prefix = [talker.codec_think_id, talker.codec_think_bos_id, language_id, talker.codec_think_eos_id]
    if speaker is not None:
        prefix.append(talker.spk_id[speaker])
    return [*prefix, talker.codec_pad_id, talker.codec_bos_id]


def build_conditioning(
    talker: TTSTalker, config: TTSConfig, prompt: Sequence[int], voice: Voice, *, text_streaming: bool
) -> Conditioning:
    """The prefill and the per-frame text rows of one request (see the module docstring)."""
    text = spoken_ids(config, prompt)
    device = talker.codec_head.weight.device

    def ids(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    tts = talker.text_rows(ids([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]))
    bos, eos, pad = tts[0:1], tts[1:2], tts[2:3]
    codec = talker.codec_rows(ids(codec_prefix(config, voice)))
    n = codec.shape[0]
    parts = []
    if voice.instruct_ids:
        parts.append(talker.text_rows(ids(voice.instruct_ids)))
    parts.append(talker.text_rows(ids(prompt[:_HEAD])))
    parts.append(torch.cat([pad.expand(n - 2, -1), bos]) + codec[:-1])
    talker_cfg = config.talker_config
    if text_streaming:
        parts.append(talker.text_rows(ids(text[:1])) + codec[-1:])
        rest = torch.cat([talker.text_rows(ids(text[1:])), eos]) if len(text) > 1 else eos
    else:
        spoken = torch.cat([talker.text_rows(ids(text)), eos])
        parts.append(spoken + talker.codec_rows(ids([talker_cfg.codec_pad_id])))
        parts.append(pad + talker.codec_rows(ids([talker_cfg.codec_bos_id])))
        rest = pad[:0]
    return Conditioning(prefill=torch.cat(parts), text=rest, pad=pad)

"""The prompt side of Qwen3-TTS: the text to speak, the voice, the language, the instruction.

* :class:`TTSPromptSide` — the :class:`~omnirelay.models.family.PromptSide` of the Talker
  stage. A speech request's prompt is the assistant turn the reference writes,
  ``<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``; its full input
  (``SpeechPrompt.inputs``) is the voice the Talker reads (:func:`~omnirelay.models.qwen3_tts.talker.voice_of_inputs`):
  the speaker, the language and, on the models that take one, the instruction's token
  ids (``<|im_start|>user\\n{instruction}<|im_end|>\\n``). A chat prompt speaks its last
  user turn (``omnirelay run --prompt``). Which models take instructions is the
  config's (:attr:`~omnirelay.models.qwen3_tts.model_config.TTSConfig.takes_instructions`: the
  1.7B CustomVoice and VoiceDesign); the others refuse them (:meth:`instructions_refusal`).
* :func:`open_prompt_side` — that prompt side for a stage's ``executor_args`` (the
  tokenizer and both configs; no weights are read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omnirelay.models.detokenizer import IncrementalDetokenizer
from omnirelay.models.family import Detokenizer, PromptSide, SpeechPrompt
from omnirelay.models.qwen3_tts.model_config import TTSConfig

__all__ = ["TTSPromptSide", "default_speaker", "open_prompt_side"]


class TTSPromptSide(PromptSide):
    """See the module docstring; ``default_speaker``: the voice of a request that names none."""

    def __init__(self, tokenizer: Any, config: TTSConfig, default_speaker: str | None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.default_speaker = default_speaker
        self.speakers = config.talker_config.speakers
        self.languages = config.talker_config.languages

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def encode_text(self, text: str) -> list[int]:
        """The prompt ids that speak ``text``."""
        return self._encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        said = [content for role, content in turns if role == "user"] or [content for _, content in turns]
        if not said or not said[-1].strip():
            raise ValueError("a Qwen3-TTS prompt needs a non-empty text to speak")
        return self.encode_text(said[-1])

    def instructions_refusal(self, voice: str | None) -> str | None:
        if self.config.takes_instructions:
            return None
        return (
            f"{self.config.label} does not take instructions (the 1.7B CustomVoice and VoiceDesign models "
            "do); drop instructions or serve one of those"
        )

    def speech_prompt(
        self,
        text: str,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
    ) -> SpeechPrompt:
        if not text.strip():
            raise ValueError("the text to speak is empty")
        speaker = voice.lower() if voice else self.default_speaker
        if speaker is not None and speaker not in self.speakers:
            speaker = None  # a model without speakers (VoiceDesign): its one voice
        if language is not None and language.lower() not in self.languages:
            raise ValueError(f"unknown language {language!r}; supported: {list(self.languages)}")
        inputs: dict[str, Any] = {"speaker": speaker, "language": (language or "auto").lower()}
        if instructions and instructions.strip():
            refusal = self.instructions_refusal(voice)
            if refusal is not None:
                raise ValueError(refusal)
            inputs["instruct_ids"] = self._encode(f"<|im_start|>user\n{instructions}<|im_end|>\n")
        return SpeechPrompt(self.encode_text(text), inputs=inputs)

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return IncrementalDetokenizer(self.tokenizer, context)


def open_prompt_side(executor_args: Mapping[str, Any]) -> TTSPromptSide:
    """The prompt side of a Qwen3-TTS Talker stage with these ``executor_args``."""
    from omnirelay.models.qwen3_tts.loader import TTSCheckpoint, TTSModelArgs

    args = TTSModelArgs.from_executor_args(dict(executor_args))
    checkpoint = TTSCheckpoint.open(args)
    return TTSPromptSide(
        checkpoint.load_tokenizer(), checkpoint.config, default_speaker(checkpoint.config, args.speaker)
    )


def default_speaker(config: TTSConfig, chosen: str | None) -> str | None:
    """``chosen`` (lower case), else the config's first speaker (None: it has none)."""
    speakers = config.talker_config.speakers
    if chosen:
        return chosen.lower()
    return speakers[0] if speakers else None

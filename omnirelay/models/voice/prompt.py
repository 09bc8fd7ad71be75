"""The prompt side of SmolLM2: its own chat template, and speech read verbatim.

:class:`SmolPromptSide` is the :class:`~omnirelay.models.family.PromptSide` of a
``smollm2.thinker`` stage over :class:`~omnirelay.models.voice.smollm2.SmolTokenizer`.
A speech request is answered verbatim: the prompt stage gets
``inputs={"speak_text": text}`` and the SmolLM2 Thinker then streams exactly that text to
the voice, one token a step, instead of an answer of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omnirelay.models.detokenizer import IncrementalDetokenizer
from omnirelay.models.family import SPEAK_INSTRUCTION, Detokenizer, PromptSide, SpeechPrompt

__all__ = ["SmolPromptSide"]


class SmolPromptSide(PromptSide):
    """SmolLM2's tokenizer and its own chat template (the default system turn when the
    turns have none); speech is read verbatim (see the module docstring)."""

    voice_skips_tool_calls = True  # SmolLM2Executor: a call never reaches the voice

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # a checkpoint's template may take tools (ChatTokenizer); the built-in SmolLM2's takes none
        self.chat_tools = getattr(tokenizer, "chat_tools", None)

    @property
    def tool_refusal(self) -> str:
        if self.chat_tools is None:  # the built-in SmolLM2
            return (
                "the built-in SmolLM2-135M-Instruct's chat template takes no tools; serve a --model "
                "checkpoint whose template does (Qwen2.5-0.5B-Instruct's, for one)"
            )
        return super().tool_refusal

    def encode_rendered(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        return [int(t) for t in self.tokenizer.chat_ids(list(turns))]

    def encode_speech(self, text: str) -> list[int]:
        return self.encode_chat([("system", SPEAK_INSTRUCTION), ("user", text)])

    def speech_prompt(
        self,
        text: str,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
    ) -> SpeechPrompt:
        # One voice, told nothing: voice, instructions and language do not apply.
        # One token a step, then the end-of-turn token: the answer is exactly this long.
        num_tokens = len(self.tokenizer.encode(text)) + 1
        return SpeechPrompt(self.encode_speech(text), inputs={"speak_text": text}, max_tokens=num_tokens)

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return IncrementalDetokenizer(self.tokenizer, context)

"""Text in and out of a pipeline for the server: the prompt side the endpoints use.

The endpoints speak to the pipeline's prompt stage through a
:class:`~omnirelay.models.family.PromptSide` (chat and speech prompts, media
placeholders, detokenization): the model family's own, which the pipeline gives
(:meth:`omnirelay.api.Pipeline.prompt_side`), or, for a pipeline without a text model
(the toy pipeline), :class:`ByteCodec`: a prompt is its UTF-8 bytes, a token id is one
character.

:func:`prompt_side_for` picks one for a started pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from omnirelay.models.family import Detokenizer, PromptSide, SpeechPrompt

if TYPE_CHECKING:
    from omnirelay.api import Pipeline

__all__ = ["ByteCodec", "prompt_side_for"]


class _ByteDetokenizer:
    def push(self, token_ids: Sequence[int]) -> str:
        out = []
        for t in token_ids:
            ch = chr(int(t)) if 0 <= int(t) < 0x110000 else "?"
            out.append(ch if ch.isprintable() else "?")
        return "".join(out)

    def flush(self) -> str:
        return ""


class ByteCodec(PromptSide):
    """No tokenizer: prompt ids are UTF-8 bytes, each generated id is one character
    (non-printable ones show as ``?``)."""

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        return list("\n".join(f"{role}: {content}" for role, content in turns).encode())

    def encode_speech(self, text: str) -> list[int]:
        return list(text.encode())

    def speech_prompt(
        self,
        text: str,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
    ) -> SpeechPrompt:
        return SpeechPrompt(self.encode_speech(text))

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()


def prompt_side_for(pipeline: Pipeline) -> PromptSide:
    """The prompt side of ``pipeline``'s prompt stage, else :class:`ByteCodec`."""
    found = pipeline.prompt_side()
    return found if found is not None else ByteCodec()

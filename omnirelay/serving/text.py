"""Text in and out of a pipeline for the server: :class:`TextCodec` and its two kinds.

* :class:`ChatMLCodec` — a ``transformers`` tokenizer (the Thinker's): chat messages in
  the Qwen ChatML form (:func:`format_chat` — the same text as
  :func:`omnirelay.models.format_chat_prompt` for one system and one user turn), and
  incremental detokenization for stages that report token ids without text.
* :class:`SmolChatCodec` — SmolLM2's tokenizer and chat template; a speech request is
  answered verbatim: stage 0 gets ``inputs={"speak_text": text}`` (the SmolLM2 Thinker
  then streams exactly that text to the voice instead of an answer of its own).
* :class:`ByteCodec` — for pipelines without a tokenizer (the toy pipeline): a prompt is
  its UTF-8 bytes, a token id is one character.

:func:`codec_for_pipeline` picks one from the prompt stage's executor (stage 0, or the
stage behind a speech recognizer). :class:`SpeechPrompt` is
what a codec makes of a speech request's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from omnirelay.models.tokenizer import IncrementalDetokenizer
from omnirelay.pipeline import PipelineConfig

if TYPE_CHECKING:
    from omnirelay.models.qwen3_omni.vision import VisionLayout

__all__ = [
    "AUDIO_END",
    "AUDIO_PAD",
    "AUDIO_START",
    "IMAGE_PAD",
    "SPEAK_INSTRUCTION",
    "ByteCodec",
    "ChatMLCodec",
    "Detokenizer",
    "MediaSlot",
    "SmolChatCodec",
    "SpeechPrompt",
    "TextCodec",
    "codec_for_pipeline",
    "format_chat",
    "thinker_vision",
]

#: The system turn of a speech request on a chat pipeline (Thinker first).
SPEAK_INSTRUCTION = "Read the user's text aloud exactly as written, and say nothing else."


@dataclass(frozen=True, slots=True)
class SpeechPrompt:
    """What stage 0 gets for a speech request: its prompt ids, a full input (``None``:
    none), and the ``max_tokens`` the answer needs (``None``: the stage's default)."""

    prompt_token_ids: list[int]
    inputs: Any = None
    max_tokens: int | None = None


class Detokenizer(Protocol):
    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class TextCodec(Protocol):
    """Prompt ids for chat and speech requests; text of generated ids."""

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """``(role, content)`` turns → prompt ids ending in an open assistant turn."""
        ...

    def encode_speech(self, text: str) -> list[int]:
        """The prompt ids of a speech request for ``text``."""
        ...

    def speech_prompt(self, text: str) -> SpeechPrompt:
        """Everything stage 0 gets for a speech request of ``text``."""
        ...

    def detokenizer(self, context: Sequence[int]) -> Detokenizer: ...


def format_chat(messages: Sequence[tuple[str, str]]) -> str:
    """ChatML turns, then the open assistant turn. ``developer`` is a ``system`` turn."""
    parts = []
    for role, content in messages:
        role = "system" if role == "developer" else role
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


#: Qwen3-Omni's audio placeholders: one clip is start, n pads (one per audio token), end.
AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"
#: Qwen3-Omni's image placeholders: one image is start, n pads (one per image token), end.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
_RESERVED = (AUDIO_START, AUDIO_PAD, AUDIO_END, VISION_START, IMAGE_PAD, VISION_END, "<|video_pad|>")


@dataclass(frozen=True, slots=True)
class MediaSlot:
    """Where a clip or an image sits in a turn: its kind and its token count."""

    kind: Literal["audio", "image"]
    tokens: int


class ChatMLCodec:
    """A ``transformers`` tokenizer with the Qwen chat template. ``audio_window``: the
    Thinker's audio encoder window (``n_window``) when it takes audio input, else None.
    ``vision``: the Thinker's image layout when it takes image input, else None;
    ``image_refusal``: why it takes none although it has a vision tower (a 400 says it)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        audio_window: int | None = None,
        vision: VisionLayout | None = None,
        image_refusal: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.audio_window = audio_window
        self.vision = vision
        self.image_refusal = image_refusal

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        ids = self.tokenizer.encode(format_chat(messages), add_special_tokens=False)
        return [int(t) for t in ids]

    def encode_chat_media(self, messages: Sequence[tuple[str, Sequence[str | MediaSlot]]]) -> list[int]:
        """Turns whose parts are text or a clip's / an image's slot, each laid out as
        Qwen3-Omni's processor does (start, one pad per token, end). Raises ValueError when
        the text itself holds an audio or vision placeholder (the counts would no longer
        match)."""
        flat = []
        for role, parts in messages:
            content = []
            for part in parts:
                if isinstance(part, str):
                    held = [tok for tok in _RESERVED if tok in part]
                    if held:
                        raise ValueError(f"the text holds {held[0]!r}, reserved for audio and image input")
                    content.append(part)
                elif part.kind == "audio":
                    content.append(AUDIO_START + AUDIO_PAD * part.tokens + AUDIO_END)
                else:
                    content.append(VISION_START + IMAGE_PAD * part.tokens + VISION_END)
            flat.append((role, "".join(content)))
        return self.encode_chat(flat)

    def encode_speech(self, text: str) -> list[int]:
        return self.encode_chat([("system", SPEAK_INSTRUCTION), ("user", text)])

    def speech_prompt(self, text: str) -> SpeechPrompt:
        return SpeechPrompt(self.encode_speech(text))

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return IncrementalDetokenizer(self.tokenizer, context)


class SmolChatCodec:
    """SmolLM2's tokenizer (:class:`~omnirelay.models.voice.smollm2.SmolTokenizer`) and its own
    chat template; speech is read verbatim (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return [int(t) for t in self.tokenizer.chat_ids(list(messages))]

    def encode_speech(self, text: str) -> list[int]:
        return self.encode_chat([("system", SPEAK_INSTRUCTION), ("user", text)])

    def speech_prompt(self, text: str) -> SpeechPrompt:
        # One token a step, then the end-of-turn token: the answer is exactly this long.
        num_tokens = len(self.tokenizer.encode(text)) + 1
        return SpeechPrompt(self.encode_speech(text), inputs={"speak_text": text}, max_tokens=num_tokens)

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return IncrementalDetokenizer(self.tokenizer, context)


class _ByteDetokenizer:
    def push(self, token_ids: Sequence[int]) -> str:
        out = []
        for t in token_ids:
            ch = chr(int(t)) if 0 <= int(t) < 0x110000 else "?"
            out.append(ch if ch.isprintable() else "?")
        return "".join(out)

    def flush(self) -> str:
        return ""


class ByteCodec:
    """No tokenizer: prompt ids are UTF-8 bytes, each generated id is one character
    (non-printable ones show as ``?``)."""

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return list("\n".join(f"{role}: {content}" for role, content in messages).encode())

    def encode_speech(self, text: str) -> list[int]:
        return list(text.encode())

    def speech_prompt(self, text: str) -> SpeechPrompt:
        return SpeechPrompt(self.encode_speech(text))

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return _ByteDetokenizer()


def codec_for_pipeline(config: PipelineConfig) -> TextCodec:
    """The Qwen tokenizer when the prompt stage runs a Qwen3-Omni executor, SmolLM2's when it runs
    SmolLM2 (prepared first if needed), else :class:`ByteCodec`."""
    stage0 = config.stages[config.prompt_stage_id]
    if stage0.executor == "smollm2.thinker":
        from omnirelay.models.voice.smollm2 import load_smol_tokenizer

        return SmolChatCodec(load_smol_tokenizer(**dict(stage0.executor_args)))
    if stage0.executor.startswith("qwen3_omni."):
        from omnirelay.models import load_tokenizer
        from omnirelay.models.tokenizer import thinker_audio_window

        args = dict(stage0.executor_args)
        is_thinker = stage0.executor == "qwen3_omni.thinker"
        window = thinker_audio_window(**args) if is_thinker else None
        vision, refusal = thinker_vision(args) if is_thinker else (None, None)
        return ChatMLCodec(load_tokenizer(**args), audio_window=window, vision=vision, image_refusal=refusal)
    return ByteCodec()


def thinker_vision(args: dict[str, Any]) -> tuple[VisionLayout | None, str | None]:
    """The image layout of the Thinker a stage's ``executor_args`` name, or why it takes no
    images although it has a vision tower (the static runner)."""
    from omnirelay.models.qwen3_omni.loader import ModelArgs
    from omnirelay.models.qwen3_omni.vision import vision_layout

    layout = vision_layout(**args)
    if layout is not None and ModelArgs.from_executor_args(args).uses_static_runner():
        return None, (
            "image input is not supported on the Thinker's static (CUDA graph) runner; serve a "
            "pipeline whose Thinker has executor_args.runner: dynamic"
        )
    return layout, None

"""The prompt side of Qwen3-Omni: ChatML, the audio and image placeholders, its tokenizer.

* :func:`format_chat` — the one ChatML writer: turns, then the open assistant turn
  (``<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n``). The Talker finds the
  user turn and the open assistant turn by these tokens, so every prompt uses this form.
* :class:`QwenPromptSide` — the :class:`~omnirelay.models.family.PromptSide` of a
  Qwen3-Omni stage: chat and speech prompts, and, for a Thinker with an audio encoder
  or a vision tower, each clip laid out as ``<|audio_start|>`` + one ``<|audio_pad|>``
  per audio token + ``<|audio_end|>`` and each image as ``<|vision_start|>`` + one
  ``<|image_pad|>`` per image token + ``<|vision_end|>``, as Qwen's processor does.
* :func:`open_prompt_side` — that prompt side for a stage's ``executor_args`` (the tiny
  model built first when it is not cached yet, announced).
* :func:`load_tokenizer` — the tokenizer of a stage's ``executor_args`` (the tiny one or
  the checkpoint's); :func:`encode_chat_prompt` / :func:`format_chat_prompt` — one user
  turn on a bare tokenizer (tools and tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from omnirelay.models.detokenizer import IncrementalDetokenizer
from omnirelay.models.family import (
    SPEAK_INSTRUCTION,
    Announce,
    AudioSlot,
    Detokenizer,
    ImageSlot,
    PromptSide,
    SpeechPrompt,
    quiet,
)
from omnirelay.models.tools import ChatTemplateTools, ToolPrompt

if TYPE_CHECKING:
    from omnirelay.models.qwen3_omni.vision import VisionLayout

__all__ = [
    "AUDIO_END",
    "AUDIO_PAD",
    "AUDIO_START",
    "IMAGE_PAD",
    "QwenPromptSide",
    "encode_chat_prompt",
    "format_chat",
    "format_chat_prompt",
    "load_tokenizer",
    "open_prompt_side",
    "thinker_audio_window",
    "thinker_vision",
]

#: Qwen3-Omni's audio placeholders: one clip is start, n pads (one per audio token), end.
AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"
#: Qwen3-Omni's image placeholders: one image is start, n pads (one per image token), end.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
_RESERVED = (AUDIO_START, AUDIO_PAD, AUDIO_END, VISION_START, IMAGE_PAD, VISION_END, "<|video_pad|>")


def format_chat(turns: Sequence[tuple[str, str]]) -> str:
    """ChatML turns, then the open assistant turn. ``developer`` is a ``system`` turn."""
    parts = []
    for role, content in turns:
        role = "system" if role == "developer" else role
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def format_chat_prompt(text: str, *, system: str | None = None) -> str:
    """One user turn (after an optional system turn) and the open assistant turn."""
    return format_chat(([("system", system)] if system is not None else []) + [("user", text)])


def encode_chat_prompt(tokenizer: Any, text: str, *, system: str | None = None) -> list[int]:
    """Token ids of :func:`format_chat_prompt` on a bare Qwen tokenizer (no extra BOS/EOS)."""
    return QwenPromptSide(tokenizer).encode_prompt(text, system=system)


class QwenPromptSide(PromptSide):
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
        self.hears_audio = audio_window is not None
        self.sees_images = vision is not None
        if getattr(tokenizer, "chat_template", None):  # the checkpoint's own; the tiny one has none
            self.chat_tools = ChatTemplateTools(tokenizer.apply_chat_template)

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        ids = self.tokenizer.encode(format_chat(turns), add_special_tokens=False)
        return [int(t) for t in ids]

    def encode_rendered(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def encode_speech(self, text: str) -> list[int]:
        """The prompt ids of a speech request for ``text``: read it aloud, verbatim."""
        return self.encode_chat([("system", SPEAK_INSTRUCTION), ("user", text)])

    def speech_prompt(
        self,
        text: str,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
    ) -> SpeechPrompt:
        # The Talker hears the voice from the request's extras; the Thinker is told no style.
        return SpeechPrompt(self.encode_speech(text))

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        return IncrementalDetokenizer(self.tokenizer, context)

    def fit_image(self, height: int, width: int) -> tuple[int, int]:
        if self.vision is None:
            return super().fit_image(height, width)
        return self.vision.fit(height, width)

    def encode_chat_media(
        self,
        turns: Sequence[tuple[str, Sequence[str | AudioSlot | ImageSlot]]],
        tooling: ToolPrompt | None = None,
    ) -> list[int]:
        from omnirelay.models.qwen3_omni.audio import num_audio_tokens

        flat = []
        for role, parts in turns:
            content = []
            for part in parts:
                if isinstance(part, str):
                    held = [tok for tok in _RESERVED if tok in part]
                    if held:
                        raise ValueError(f"the text holds {held[0]!r}, reserved for audio and image input")
                    content.append(part)
                elif isinstance(part, AudioSlot):
                    if self.audio_window is None:
                        raise ValueError("this model takes no audio input in its prompt")
                    tokens = num_audio_tokens(part.num_samples, self.audio_window)
                    content.append(AUDIO_START + AUDIO_PAD * tokens + AUDIO_END)
                else:
                    if self.vision is None:
                        raise ValueError("this model takes no image input")
                    tokens = self.vision.num_tokens(part.height, part.width)
                    content.append(VISION_START + IMAGE_PAD * tokens + VISION_END)
            flat.append((role, "".join(content)))
        return self.encode_chat_tools(flat, tooling) if tooling is not None else self.encode_chat(flat)


def open_prompt_side(
    executor: str, executor_args: dict[str, Any], announce: Announce = quiet
) -> QwenPromptSide:
    """The prompt side of a Qwen3-Omni stage. A Thinker's includes its audio window and
    image layout; the tiny model is built first (inside ``announce``) when it is not cached."""
    from omnirelay.models.qwen3_omni.loader import ModelArgs
    from omnirelay.models.qwen3_omni.tiny import build_tiny, cached_tiny_dir

    args = ModelArgs.from_executor_args(executor_args)
    if args.is_tiny and not (cached_tiny_dir(args.seed) / "config.json").is_file():
        label = (
            f"building the tiny Qwen3-Omni model (seed {args.seed}; first use only, cached in "
            f"{cached_tiny_dir(args.seed)})"
        )
        with announce(label, done="built"):
            build_tiny(None, seed=args.seed)
    is_thinker = executor == "qwen3_omni.thinker"
    window = thinker_audio_window(**executor_args) if is_thinker else None
    vision, refusal = thinker_vision(executor_args) if is_thinker else (None, None)
    return QwenPromptSide(
        load_tokenizer(**executor_args), audio_window=window, vision=vision, image_refusal=refusal
    )


def load_tokenizer(**executor_args: Any) -> Any:
    """The tokenizer of the checkpoint a stage's ``executor_args`` name (same keys)."""
    from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs

    args = ModelArgs.from_executor_args(executor_args)
    return Checkpoint.open(args.resolve_dir(), load_format=args.load_format).load_tokenizer()


def thinker_audio_window(**executor_args: Any) -> int | None:
    """The audio encoder window (``n_window``) of the Thinker a stage's ``executor_args``
    name, read from its config (None when it has no audio encoder): the prompt lays out a
    clip's audio tokens with it."""
    from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs

    args = ModelArgs.from_executor_args(executor_args)
    config = Checkpoint.open(args.resolve_dir(), load_format=args.load_format).config
    audio = getattr(config.thinker_config, "audio_config", None)
    window = getattr(audio, "n_window", None)
    return int(window) if window is not None else None


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

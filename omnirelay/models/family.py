"""What the front layers ask of the models behind a pipeline: the model family interface.

``serving``, ``api``, ``cli`` and ``orchestrator`` never import a family's modules (a
test checks it from the import graph). They ask :mod:`omnirelay.models` about a
pipeline's stages, and get these types back:

* :class:`ModelFamily` — one family (a package under ``omnirelay/models/``): the
  executor names it registers and, per stage, what the front needs —
  :meth:`~ModelFamily.prompt_side` (the stage is a text model the front writes prompts
  for), :meth:`~ModelFamily.prepare` (models made ready once, on first use),
  :meth:`~ModelFamily.voice` (the voice a speaking stage speaks with) and
  :meth:`~ModelFamily.checkpoint_options` (how a stage's model loads from a checkpoint:
  a local directory or a Hugging Face repo id).
* :class:`PromptSide` — the prompt side of a text model: chat formatting, speech
  prompts, media placeholders, incremental detokenization. The base class takes no
  media; a family whose model hears audio or sees images in its prompt overrides the
  media part, and one whose chat template takes tools the tool part
  (:mod:`omnirelay.models.tools`).
* :class:`SpeechPrompt`, :class:`AudioSlot`, :class:`ImageSlot`, :class:`StageVoice`,
  :class:`CheckpointOptions`, :class:`Detokenizer` — the plain data and the one protocol
  those methods speak in.

Nothing here imports a model library: a family's heavy imports happen when one of its
methods needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from omnirelay.models.tools import ChatTemplateTools, ToolFormat, ToolPrompt
    from omnirelay.pipeline.config import StageConfig
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "SPEAK_INSTRUCTION",
    "Announce",
    "AudioSlot",
    "CheckpointOptions",
    "Detokenizer",
    "ImageSlot",
    "ModelFamily",
    "PromptSide",
    "SpeechPrompt",
    "StageVoice",
    "quiet",
]


class Announce(Protocol):
    """``announce(label, done=...)`` — a context manager around one step of model
    preparation that reports its progress (``omnirelay run``'s progress lines: ``label…``,
    then ``done in 1.2 s``); :func:`quiet` says nothing."""

    def __call__(self, label: str, *, done: str = "ready") -> AbstractContextManager[Any]: ...


def quiet(label: str, *, done: str = "ready") -> AbstractContextManager[Any]:
    """An :class:`Announce` that reports nothing."""
    return nullcontext()


#: The system turn of a speech request on a chat model: read the text, verbatim.
SPEAK_INSTRUCTION = "Read the user's text aloud exactly as written, and say nothing else."


@dataclass(frozen=True, slots=True)
class SpeechPrompt:
    """What the prompt stage gets for a speech request: its prompt ids, a full input
    (``None``: none), and the ``max_tokens`` the answer needs (``None``: the stage's
    default)."""

    prompt_token_ids: list[int]
    inputs: Any = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class AudioSlot:
    """Where a clip of ``num_samples`` samples (at the audio input rate) sits in a turn."""

    num_samples: int


@dataclass(frozen=True, slots=True)
class ImageSlot:
    """Where an image of ``height`` x ``width`` pixels (already fitted,
    :meth:`PromptSide.fit_image`) sits in a turn."""

    height: int
    width: int


#: One turn whose parts are text, or the place of a clip or an image.
MediaTurn = tuple[str, Sequence["str | AudioSlot | ImageSlot"]]


class Detokenizer(Protocol):
    """The text deltas of a growing list of generated ids."""

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class PromptSide:
    """The prompt side of a text model (see the module docstring).

    Turns are ``(role, text)``; a ``developer`` turn is a ``system`` turn. Every encode
    ends in the open assistant turn. Subclasses implement :meth:`encode_chat`,
    :meth:`speech_prompt` and :meth:`detokenizer`; the media and tool parts default to
    "none" (one whose chat template takes tools sets :attr:`chat_tools` and implements
    :meth:`encode_rendered`).
    """

    #: Whether the prompt can carry audio (the model's own audio encoder hears it).
    hears_audio: bool = False
    #: Whether the prompt can carry images.
    sees_images: bool = False
    #: Why the model takes no images although it could (a 400 says it); None otherwise.
    image_refusal: str | None = None
    #: The languages a speech request may name (empty: the model is told none).
    languages: tuple[str, ...] = ()
    #: The model's chat template seen for tools (None: the model has no such template);
    #: :attr:`tool_format` and :attr:`tool_refusal` read it.
    chat_tools: ChatTemplateTools | None = None
    #: Whether the family's Thinker leaves tool calls out of the text its voice reads: a
    #: spoken answer may then come with tools (else the voice would read the calls).
    voice_skips_tool_calls: bool = False

    def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        """Prompt ids of ``turns`` and the open assistant turn."""
        raise NotImplementedError

    def encode_prompt(self, text: str, *, system: str | None = None) -> list[int]:
        """One user turn (after an optional system turn)."""
        turns = ([("system", system)] if system is not None else []) + [("user", text)]
        return self.encode_chat(turns)

    def speech_prompt(
        self,
        text: str,
        *,
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
    ) -> SpeechPrompt:
        """Everything the prompt stage gets for a speech request of ``text``, spoken by
        ``voice`` (one of the pipeline's voices), following ``instructions`` (only where
        :meth:`instructions_refusal` has none) in ``language`` (one of :attr:`languages`).
        A model that speaks with one voice whatever the request names ignores the three."""
        raise NotImplementedError

    def instructions_refusal(self, voice: str | None) -> str | None:
        """Why ``voice`` cannot follow a speech request's ``instructions`` (OpenAI's "how to
        speak": tone, accent, pace), or None when it can; the server then answers a request
        that gives them with a 400 saying so, never ignores them. A family whose voices
        follow instructions returns None for them and reads them in :meth:`speech_prompt`."""
        return f"the voice {voice!r} speaks every text one way; it takes no instructions"

    def detokenizer(self, context: Sequence[int]) -> Detokenizer:
        """A detokenizer of generated ids after ``context`` (the prompt)."""
        raise NotImplementedError

    def fit_image(self, height: int, width: int) -> tuple[int, int]:
        """The size an image of ``height`` x ``width`` is given to the model at; raises
        ValueError when the model cannot take it."""
        raise ValueError("this model takes no image input")

    def encode_chat_media(self, turns: Sequence[MediaTurn], tooling: ToolPrompt | None = None) -> list[int]:
        """Prompt ids of turns with clips and images laid out as the model expects them
        (with ``tooling``: as :meth:`encode_chat_tools`). Raises ValueError when the text
        itself holds a media placeholder."""
        raise ValueError("this model takes no audio or image input in its prompt")

    @property
    def tool_format(self) -> ToolFormat | None:
        """How the model writes tool calls, when its chat template takes tools; else None."""
        return self.chat_tools.format if self.chat_tools is not None else None

    @property
    def tool_refusal(self) -> str:
        """Why the model takes no tools (a 400 says it); meaningful when :attr:`tool_format` is None."""
        if self.chat_tools is not None and self.chat_tools.refusal is not None:
            return self.chat_tools.refusal
        return "its prompt has no chat template that takes tools"

    def encode_chat_tools(self, turns: Sequence[tuple[str, str]], tooling: ToolPrompt) -> list[int]:
        """Prompt ids of ``turns`` with their calls and tool results, and the tools
        (``tooling``), in the model's own chat template: the open assistant turn, then the
        forced prefix. Raises ValueError when the model takes no tools or its template
        refuses the turns."""
        if self.chat_tools is None or self.chat_tools.format is None:
            raise ValueError(f"this model takes no tools: {self.tool_refusal}")
        text = self.chat_tools.render(tooling.messages(turns), tooling.tools, prefix=tooling.prefix)
        return self.encode_rendered(text)

    def encode_rendered(self, text: str) -> list[int]:
        """Prompt ids of a prompt the chat template rendered (its special tokens written as text)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class StageVoice:
    """The voice a speaking stage speaks with: its name (as clients give it) and its
    audio rate; ``voices``: every voice a request may name when it has several (its
    speakers; empty: only ``name``, which is then also the default)."""

    name: str
    sample_rate: int
    voices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """How a family's stages load their models from a checkpoint directory (a local one,
    or a Hugging Face repo id's snapshot in the hub's cache; ``omnirelay run
    --model/--load-format/--runner/--device`` apply to these stages).

    ``source_keys``: the ``executor_args`` keys that name where the weights come from
    (replaced by ``model_dir`` when a checkpoint is given). ``check(path, load_format)``
    opens the checkpoint (a local directory) and raises
    :class:`~omnirelay.errors.ModelError` when it is missing or not one of the family's.
    """

    label: str
    load_formats: tuple[str, ...]
    runners: tuple[str, ...]
    source_keys: tuple[str, ...]
    check: Callable[[str, str], None]


class ModelFamily:
    """One model family: its executors, and what the front asks of its stages."""

    #: The family's name in messages (``Qwen3-Omni``).
    name: str = "model"
    #: The executor names the family registers.
    executors: tuple[str, ...] = ()
    #: How its stages load from a checkpoint (None: they take no checkpoint, or only some
    #: of its executors do: see :meth:`checkpoint_options`).
    checkpoints: CheckpointOptions | None = None
    #: The modules its stage workers import to build and run their models: the fork server
    #: workers start from imports them once (:mod:`omnirelay.worker.processes`). Importing
    #: them must start no thread and touch no device.
    worker_imports: tuple[str, ...] = ()

    def owns(self, executor: str) -> bool:
        return executor in self.executors

    def checkpoint_options(self, stage: StageConfig) -> CheckpointOptions | None:
        """How ``stage`` loads its model from a checkpoint (None: it takes none). The
        family's :attr:`checkpoints` unless it says otherwise per executor."""
        return self.checkpoints

    def register_executors(self, executors: Registry[Any], *, replace: bool = False) -> None:
        """Add the family's executor factories (each called as ``factory(**executor_args)``)."""
        raise NotImplementedError

    def prompt_side(self, stage: StageConfig, announce: Announce = quiet) -> PromptSide | None:
        """The prompt side of ``stage`` when it runs a text model (its tokenizer loaded now,
        in this process; what it needs first is made and announced), else None."""
        return None

    def prepare(self, stage: StageConfig, announce: Announce = quiet) -> None:
        """Make ready, once, what ``stage``'s model needs on first use (cached; each step
        inside ``announce(label)``). Ready models are skipped silently."""

    def voice(self, stage: StageConfig) -> StageVoice | None:
        """The voice ``stage`` speaks with, when it names its own."""
        return None

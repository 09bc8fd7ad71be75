"""omnirelay.models: executors for model families (Qwen3-Omni on ``transformers``).

One file per role:

* ``tiny`` — the tiny Qwen3-Omni (seeded random weights, cached on first use):
  :func:`build_tiny`.
* ``loader`` — :class:`ModelArgs` (a stage's ``executor_args``), :class:`Checkpoint`
  (a local checkpoint directory; one part loaded per stage), :func:`open_checkpoint`.
* ``tokenizer`` — chat prompt ids and incremental detokenization.
* ``sampling`` / ``kv`` — token sampling; per-request KV caches stacked for batched decode.
* ``thinker`` / ``talker`` (+ ``talker_input``) / ``code2wav`` — the three executors.
* ``aligner`` — ``aligner.vad``, a weight-free forced aligner (voice activity + allocation).
* ``toy`` — small deterministic executors and the ``toy-3stage`` pipeline (tests, demos,
  benchmarks of the runtime without a model).

Executors are registered by name into a registry the caller owns::

    registry = ComponentRegistry()
    register_executors(registry.executors)
    executor = registry.executors.get("qwen3_omni.talker")(tiny=True, seed=0)

Heavy imports (``transformers``) happen when a factory is called, not on import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omnirelay.models.aligner import ALIGNER_EXECUTOR, create_aligner
from omnirelay.models.loader import Checkpoint, ModelArgs, open_checkpoint
from omnirelay.models.tiny import build_tiny
from omnirelay.models.tokenizer import (
    IncrementalDetokenizer,
    encode_chat_prompt,
    format_chat_prompt,
    load_tokenizer,
)
from omnirelay.pipeline.registry import Registry

if TYPE_CHECKING:
    from omnirelay.models.code2wav import Code2WavExecutor
    from omnirelay.models.talker import TalkerExecutor
    from omnirelay.models.thinker import ThinkerExecutor

__all__ = [
    "ALIGNER_EXECUTOR",
    "CODE2WAV_EXECUTOR",
    "EXECUTOR_NAMES",
    "TALKER_EXECUTOR",
    "THINKER_EXECUTOR",
    "Checkpoint",
    "IncrementalDetokenizer",
    "ModelArgs",
    "build_tiny",
    "create_aligner",
    "create_code2wav",
    "create_talker",
    "create_thinker",
    "encode_chat_prompt",
    "format_chat_prompt",
    "load_tokenizer",
    "open_checkpoint",
    "register_executors",
]

THINKER_EXECUTOR = "qwen3_omni.thinker"
TALKER_EXECUTOR = "qwen3_omni.talker"
CODE2WAV_EXECUTOR = "qwen3_omni.code2wav"
EXECUTOR_NAMES = (THINKER_EXECUTOR, TALKER_EXECUTOR, CODE2WAV_EXECUTOR)


def create_thinker(**executor_args: Any) -> ThinkerExecutor:
    """``qwen3_omni.thinker`` from ``executor_args`` (``tiny``/``seed``/``model_dir``/``device``/``dtype``)."""
    from omnirelay.models.thinker import create_thinker as create

    return create(**executor_args)


def create_talker(**executor_args: Any) -> TalkerExecutor:
    """``qwen3_omni.talker`` from ``executor_args``."""
    from omnirelay.models.talker import create_talker as create

    return create(**executor_args)


def create_code2wav(**executor_args: Any) -> Code2WavExecutor:
    """``qwen3_omni.code2wav`` from ``executor_args``."""
    from omnirelay.models.code2wav import create_code2wav as create

    return create(**executor_args)


def register_executors(executors: Registry[Any], *, replace: bool = False) -> None:
    """Register the Qwen3-Omni executor factories under :data:`EXECUTOR_NAMES`.

    ``executors`` is a registry of kind ``"executor"`` (``ComponentRegistry.executors``);
    each entry is called as ``factory(**stage.executor_args)``.
    """
    executors.add(THINKER_EXECUTOR, create_thinker, replace=replace)
    executors.add(TALKER_EXECUTOR, create_talker, replace=replace)
    executors.add(CODE2WAV_EXECUTOR, create_code2wav, replace=replace)
    executors.add(ALIGNER_EXECUTOR, create_aligner, replace=replace)

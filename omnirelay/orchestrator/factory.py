"""Where the process layer meets the engine and the processors: the ONE place to adjust.

* :func:`build_stage_engine` ``(pipeline, stage_id, *, tracer=None) -> StageEngineProtocol``
  — called in the stage worker process (after ``spawn``) to build its engine: executor,
  connector, next-stage processor, and the step tracer of a pipeline that traces steps.
  The pipeline's ``namespace`` is already filled in.
* :func:`build_input_builders` ``(pipeline) -> {stage_id: InputBuilder}`` — called in
  the front process: the orchestrator-side builders of forwarded (complete) inputs,
  resolved from each stage's ``stage_input_builder`` name (SPEC §1.6, §2.5). Names this
  table does not know use :func:`~omnirelay.orchestrator.router.default_input_builder`.

Tests pass their own engine factory to ``Pipeline.start(engine_factory="module:function")``.
"""

from __future__ import annotations

import msgspec
import torch

from omnirelay.engine.interfaces import StageEngineProtocol
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import ConfigError
from omnirelay.orchestrator.router import (
    ForwardedInput,
    InputBuilder,
    PipelineRequest,
    SourceOutput,
    default_input_builder,
)
from omnirelay.pipeline import ComponentRegistry, PipelineConfig, StageConfig

__all__ = [
    "build_input_builders",
    "build_stage_engine",
    "code2wav_to_aligner_builder",
    "default_registry",
    "with_stage_device",
]


def default_registry() -> ComponentRegistry:
    """Every executor and processor a shipped pipeline may name: the toys, and the model
    executors of :mod:`omnirelay.models` (their heavy imports wait for a factory call)."""
    from omnirelay.engine.toy import register_toys
    from omnirelay.processors.stages import register_processors

    registry = register_toys(ComponentRegistry())
    register_processors(registry.processors)
    try:
        from omnirelay.models import register_executors
    except ImportError:  # pragma: no cover - a build without the model package
        return registry
    register_executors(registry.executors)
    return registry


def build_stage_engine(
    pipeline: PipelineConfig, stage_id: int, *, tracer: StepTracer | None = None
) -> StageEngineProtocol:
    """The real stage engine of ``stage_id`` (runs in the worker process): executor and
    chunk processor from :func:`default_registry`, the stage's connector, the engine
    (with ``tracer``, its step tracer, if given)."""
    from omnirelay.engine.components import create_stage_engine

    if pipeline.namespace is None:
        raise ConfigError("build_stage_engine needs a pipeline with its namespace filled in")
    return create_stage_engine(
        with_stage_device(pipeline, stage_id), stage_id, default_registry(), tracer=tracer
    )


def with_stage_device(pipeline: PipelineConfig, stage_id: int) -> PipelineConfig:
    """The pipeline with stage ``stage_id``'s ``devices`` handed to its model executor.

    A Qwen3-Omni executor places its model by ``executor_args.device``; a stage that names
    ``devices`` (``cuda:1``) and no ``executor_args.device`` gets ``device: <devices>``.
    An explicit ``executor_args.device`` wins; other executors (toys) are left alone.
    """
    from omnirelay.models import EXECUTOR_NAMES

    stage = pipeline.stage(stage_id)
    if stage.devices is None or stage.executor not in EXECUTOR_NAMES or "device" in stage.executor_args:
        return pipeline
    placed = msgspec.structs.replace(stage, executor_args={**stage.executor_args, "device": stage.devices})
    stages = tuple(placed if s.id == stage.id else s for s in pipeline.stages)
    return msgspec.structs.replace(pipeline, stages=stages)


# ----------------------------------------------------------------- front side


def code2wav_to_aligner_builder(
    source: SourceOutput, request: PipelineRequest, stage: StageConfig
) -> ForwardedInput | None:
    """Code2Wav's finished waveform → the aligner's input (SPEC §5.4); None: no audio."""
    from omnirelay.processors import build_aligner_input

    if not source.audio:
        return None
    waveform = torch.cat([torch.as_tensor(a).reshape(-1) for a in source.audio])
    prompt = {"additional_information": dict(request.extras.get("additional_information") or {})}
    if "language" in request.extras:
        prompt["language"] = request.extras["language"]
    built = build_aligner_input(
        {"audio": waveform, "sr": source.sample_rate or 24000}, is_finished=source.finished, prompt=prompt
    )
    if built is None:
        return None
    inputs = {
        "prompt": built.prompt,
        "waveform": built.waveform,
        "sample_rate": built.sample_rate,
        "text": built.text,
        "words": list(built.words),
        "language": built.language,
        "audio_duration_ms": built.audio_duration_ms,
    }
    return ForwardedInput(prompt_token_ids=[0], inputs=inputs)


_BUILDERS: dict[str, InputBuilder] = {
    "code2wav_to_aligner": code2wav_to_aligner_builder,
}


def build_input_builders(pipeline: PipelineConfig) -> dict[int, InputBuilder]:
    """The builder of every stage that can receive a forwarded input."""
    out: dict[int, InputBuilder] = {}
    for stage in pipeline.stages:
        if not stage.input_sources:
            continue
        name = pipeline.stage_input_builder(stage)
        out[stage.id] = _BUILDERS.get(name or "", default_input_builder)
    return out

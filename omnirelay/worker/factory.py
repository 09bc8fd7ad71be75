"""The default engine factory: where a worker process meets the engine, the executors
and the processors.

* :func:`build_stage_engine` ``(pipeline, stage_id, *, tracer=None) -> StageEngineProtocol``
  — called in the stage worker process (after ``spawn``) to build its engine: executor,
  connector, next-stage processor, and the step tracer of a pipeline that traces steps.
  The pipeline's ``namespace`` is already filled in. It is
  :data:`~omnirelay.worker.spec.DEFAULT_ENGINE_FACTORY`.
* :func:`default_registry` — every executor and processor a shipped pipeline may name.

Tests pass their own engine factory to ``Pipeline.start(..., runtime=RuntimeHooks(engine_factory="module:function"))``.
The front side's counterpart (builders of forwarded inputs) is
:mod:`omnirelay.orchestrator.input_builders`.
"""

from __future__ import annotations

import msgspec

from omnirelay.engine.interfaces import StageEngineProtocol
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import ConfigError
from omnirelay.pipeline import ComponentRegistry, PipelineConfig

__all__ = ["build_stage_engine", "default_registry", "with_stage_device"]


def default_registry() -> ComponentRegistry:
    """Every executor and processor a shipped pipeline may name: the toys, and the model
    executors of :mod:`omnirelay.models` (their heavy imports wait for a factory call)."""
    from omnirelay.models.testing.toy import register_toys
    from omnirelay.processors.streams import register_processors

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

    An executor that loads from a checkpoint (Qwen3-Omni's, Qwen3-TTS's, the voice
    family's Thinker) places its model by
    ``executor_args.device``; a stage that names ``devices`` (``cuda:1``) and no
    ``executor_args.device`` gets ``device: <devices>``. An explicit
    ``executor_args.device`` wins; other executors (toys) are left alone.
    """
    from omnirelay.models import family_of

    stage = pipeline.stage(stage_id)
    family = family_of(stage.executor)
    takes_device = family is not None and family.checkpoint_options(stage) is not None
    if stage.devices is None or not takes_device or "device" in stage.executor_args:
        return pipeline
    placed = msgspec.structs.replace(stage, executor_args={**stage.executor_args, "device": stage.devices})
    stages = tuple(placed if s.id == stage.id else s for s in pipeline.stages)
    return msgspec.structs.replace(pipeline, stages=stages)

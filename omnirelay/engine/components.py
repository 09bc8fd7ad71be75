"""How registered names become an executor and a chunk processor for one stage.

The convention (used by :mod:`omnirelay.models.testing.toy`; model packages follow it):

* ``registry.executors[name]`` is a factory called as ``factory(**stage.executor_args)``
  that returns an :class:`~omnirelay.engine.interfaces.Executor` (the convention of
  ``omnirelay.models.register_executors`` too);
* ``registry.processors[name]`` is a factory ``(stage, pipeline)`` that returns a
  :class:`~omnirelay.transfer.ChunkProcessor` — ``build(BuildRequest)`` makes one chunk's
  payload (the request's ``context`` is a
  :class:`~omnirelay.engine.request.RequestSnapshot`), ``release(external_id, scope)``
  drops its per-request state — or a plain build function, for a processor with no
  state (:class:`~omnirelay.transfer.StatelessProcessor`).

:func:`build_stage_components` applies it to a stage and checks what comes back;
:func:`create_stage_engine` also opens the stage's connector and builds the engine (what a
worker process needs, in one call).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from omnirelay.engine.interfaces import Executor
from omnirelay.engine.stage_roles import resolve_stage_roles
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import ConfigError
from omnirelay.pipeline.config import PipelineConfig, StageConfig
from omnirelay.pipeline.registry import ComponentRegistry
from omnirelay.transfer import ChunkProcessor, StatelessProcessor, TransferConfig

if TYPE_CHECKING:
    from omnirelay.engine.engine import StageEngine

__all__ = [
    "ExecutorFactory",
    "ProcessorFactory",
    "StageComponents",
    "build_stage_components",
    "create_stage_engine",
]


class ExecutorFactory(Protocol):
    def __call__(self, **executor_args: Any) -> Executor: ...


class ProcessorFactory(Protocol):
    def __call__(self, stage: StageConfig, pipeline: PipelineConfig) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class StageComponents:
    executor: Executor
    #: The chunk producer of a sending stage (None: not a sender, or the identity).
    processor: ChunkProcessor | None


def build_stage_components(
    registry: ComponentRegistry, pipeline: PipelineConfig, stage: StageConfig | int
) -> StageComponents:
    """The executor and (for a chunk-sending stage) the chunk processor of ``stage``."""
    s = pipeline.stage(stage)
    executor = registry.executors.get(s.executor)(**dict(s.executor_args))
    if not isinstance(executor, Executor):
        raise ConfigError(
            f"{s.label}: executor factory {s.executor!r} returned {type(executor).__name__}, "
            "which lacks execution_type / supports_batching / step / release"
        )
    if pipeline.reproducible:
        # Each request's rows stepped on their own, so its results never depend on what
        # else is in the batch (float sums of a batched step do; docs/usage.md).
        executor.supports_batching = False
    processor: ChunkProcessor | None = None
    name = pipeline.next_stage_processor(s)
    if resolve_stage_roles(pipeline, s).is_sender and name is not None:
        built = registry.processors.get(name)(s, pipeline)
        if isinstance(built, ChunkProcessor):
            processor = built
        elif callable(built):
            processor = StatelessProcessor(built)
        else:
            raise ConfigError(
                f"{s.label}: processor factory {name!r} returned {built!r}, neither a ChunkProcessor "
                "(build and release) nor a build function"
            )
    return StageComponents(executor, processor)


def create_stage_engine(
    pipeline: PipelineConfig,
    stage: StageConfig | int,
    registry: ComponentRegistry,
    *,
    namespace: str | None = None,
    transfer_config: TransferConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
    tracer: StepTracer | None = None,
) -> StageEngine:
    """Executor, chunk processor, connector (only for a stage with a chunk edge: the
    backend of the connector its edges name) and the :class:`StageEngine` of ``stage``.

    ``namespace`` defaults to the pipeline's; it is required when the stage has a chunk edge.
    ``tracer``: the engine's step tracer (:mod:`omnirelay.engine.tracing`; default none).
    """
    from omnirelay.engine.edge_connectors import build_stage_connector
    from omnirelay.engine.engine import StageEngine

    s = pipeline.stage(stage)
    parts = build_stage_components(registry, pipeline, s)
    roles = resolve_stage_roles(pipeline, s)
    connector = None
    if roles.connector_name is not None:
        ns = namespace if namespace is not None else pipeline.namespace
        if ns is None:
            raise ConfigError(
                f"{s.label} sends or receives chunks: give the pipeline (or this call) a namespace"
            )
        connector = build_stage_connector(pipeline, s, roles, ns)
        keep_on_device = getattr(parts.executor, "keep_outputs_on_device", None)
        if _outputs_stay_on_device(pipeline, s, roles) and callable(keep_on_device):
            keep_on_device(True)  # its outputs cross device to device: no copy to the host first
    try:
        return StageEngine(
            s,
            pipeline,
            parts.executor,
            connector,
            processor=parts.processor,
            transfer_config=transfer_config,
            clock=clock,
            tracer=tracer,
            use_launch=_in_group(pipeline, s),
            schedule_by_need=_by_need(pipeline, s),
        )
    except BaseException:
        if connector is not None:
            connector.close()
        raise


def _outputs_stay_on_device(pipeline: PipelineConfig, stage: StageConfig, roles: Any) -> bool:
    """Does the stage's output edge take device tensors as they are: a GPU-direct shm edge
    (docs/protocol.md §3.9), or an edge inside a device group (by reference, §3.10)?"""
    from omnirelay.connectors.device.paths import cuda_index, gpu_direct_options, stage_device
    from omnirelay.engine.edge_connectors import stage_edge_backends

    if gpu_direct_options(pipeline, stage).get("gpu_direct_to"):
        return True
    from omnirelay.pipeline.groups import group_key

    if stage_edge_backends(pipeline, stage, roles)[1] != "inproc" or group_key(pipeline, stage) is None:
        return False
    return cuda_index(stage_device(stage)) is not None


#: ``0``: stages in a device group step synchronously even where their executor can
#: launch (to measure what the overlap is worth; docs/design.md §12)
GROUP_LAUNCH_ENV = "OMNIRELAY_GROUP_LAUNCH"


#: ``1``: the stages of a device group choose each step's requests by need
#: (:mod:`omnirelay.engine.need`); off by default (docs/performance.md: it pays only with
#: capacity to spare)
GROUP_BY_NEED_ENV = "OMNIRELAY_GROUP_BY_NEED"


def _by_need(pipeline: PipelineConfig, stage: StageConfig) -> bool:
    """Does the stage choose its steps' requests by need: it launches in a device group
    and :data:`GROUP_BY_NEED_ENV` is ``1``?"""
    import os

    return os.environ.get(GROUP_BY_NEED_ENV, "0") == "1" and _in_group(pipeline, stage)


def _in_group(pipeline: PipelineConfig, stage: StageConfig) -> bool:
    """Does the stage launch its steps: it runs in a device group (docs/design.md §12)
    and :data:`GROUP_LAUNCH_ENV` is not ``0``? Only in a group does an executor's
    ``launch`` pay: a process of its own has nothing to overlap it with."""
    import os

    from omnirelay.pipeline.groups import group_key

    return group_key(pipeline, stage) is not None and os.environ.get(GROUP_LAUNCH_ENV, "1") != "0"

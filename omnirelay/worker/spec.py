"""What a stage worker process is started with: :class:`WorkerSpec` and its engine factory.

The factory is named as ``"module:function"`` (so that it can be pickled to a spawned
process and be a test's own engine) and called as ``factory(pipeline, stage_id)`` in the
worker; :data:`DEFAULT_ENGINE_FACTORY` builds the real stage engine
(:func:`omnirelay.worker.factory.build_stage_engine`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from omnirelay.engine.interfaces import StageEngineProtocol
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import ConfigError
from omnirelay.pipeline import PipelineConfig
from omnirelay.worker.worker_control import ControlPaths

__all__ = ["DEFAULT_ENGINE_FACTORY", "EngineFactory", "WorkerSpec", "load_engine_factory"]

DEFAULT_ENGINE_FACTORY = "omnirelay.worker.factory:build_stage_engine"

#: ``factory(pipeline, stage_id)``, or ``factory(pipeline, stage_id, tracer=...)``.
EngineFactory = Callable[..., StageEngineProtocol]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs; pickled to the spawned process."""

    stage_id: int
    #: the pipeline as this worker sees it (namespace filled in; a replicated stage's
    #: config is its replica's, :meth:`PipelineConfig.for_replica`)
    pipeline: PipelineConfig
    paths: ControlPaths
    parent_pid: int
    engine_factory: str = DEFAULT_ENGINE_FACTORY
    #: builds the engine's step tracer (a class pickled by reference); None: no timing
    tracer_factory: Callable[[], StepTracer] | None = None
    #: an idle engine's wait; it steps once after each (stall timeouts are collected then)
    idle_wait_s: float = 1.0
    #: engines without ``wake()``: longest a control message waits while requests are parked
    wait_slice_s: float = 0.01
    #: how often the receive thread checks that the parent is alive
    parent_check_s: float = 0.5
    #: the worker's index among the pipeline's workers (its control sockets); None: the
    #: stage id (a pipeline without replicas)
    worker: int | None = None
    #: an intermediate stage's progress outputs wait at most this long to go out with a
    #: later message (0: one message per step, as for a final-output stage) …
    progress_flush_s: float = 0.25
    #: … and at most this many of them
    progress_flush_count: int = 256
    #: the front's environment when it started the worker (a worker forked from the fork
    #: server takes it first, :mod:`omnirelay.worker.processes`); None: keep its own
    environ: dict[str, str] | None = None

    @property
    def worker_index(self) -> int:
        return self.stage_id if self.worker is None else self.worker

    @property
    def replica(self) -> int:
        return self.pipeline.stages[self.stage_id].replica


def load_engine_factory(path: str) -> EngineFactory:
    """``"package.module:function"`` → the function; :class:`ConfigError` when it is not there."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"engine factory must look like 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"engine factory {path!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"engine factory {path!r}: {module_name!r} has no function {attr!r}")
    return factory

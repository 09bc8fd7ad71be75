"""omnirelay.engine: one stage in one process — request lifecycle, schedulers, the engine.

Files (one role each; read the architecture off the names):

* ``interfaces.py`` — the contracts: :class:`Executor`, :class:`BatchItem`,
  :class:`ItemResult`, :class:`StageRequest`, :class:`StageOutput`, :class:`SamplingParams`,
  :class:`StageEngineProtocol`.
* ``request.py`` — :class:`RequestStatus` and its transition table, :class:`Request`,
  :class:`RequestSnapshot` (what a chunk processor sees).
* ``scheduler_base.py`` — per-tick plain data (:class:`SchedulerOutput`,
  :class:`StepUpdate`, :class:`RequestUpdate`) and the shared queue/slot machine.
* ``scheduler.py`` — :class:`ARScheduler`; ``generation_scheduler.py`` — :class:`GenerationScheduler`.
* ``stage_roles.py`` — a stage's sender/receiver roles from the pipeline's contracts.
* ``admission.py`` — checks and sampling defaults of an arriving :class:`StageRequest`.
* ``stage_output.py`` — request updates → :class:`StageOutput` messages.
* ``tracing.py`` — :class:`StepTracer`, the optional per-step timing interface.
* ``engine.py`` — :class:`StageEngine`: scheduler + executor + transfer adapter.
* ``components.py`` — registry names → executor and chunk processor of a stage.

The loop that drives an engine in a worker process is :mod:`omnirelay.worker`; the toy
executors of the ``toy-3stage`` pipeline are :mod:`omnirelay.models.testing.toy`.
"""

from omnirelay.engine.components import (
    ExecutorFactory,
    ProcessorFactory,
    StageComponents,
    build_stage_components,
    create_stage_engine,
)
from omnirelay.engine.engine import StageEngine
from omnirelay.engine.generation_scheduler import GenerationScheduler
from omnirelay.engine.interfaces import (
    BatchItem,
    Executor,
    ItemResult,
    SamplingParams,
    StageEngineProtocol,
    StageOutput,
    StageRequest,
)
from omnirelay.engine.request import (
    ALLOWED_TRANSITIONS,
    FINISHED_STATUSES,
    IllegalTransitionError,
    Request,
    RequestSnapshot,
    RequestStatus,
)
from omnirelay.engine.scheduler import ARScheduler
from omnirelay.engine.scheduler_base import BaseScheduler, RequestUpdate, SchedulerOutput, StepUpdate
from omnirelay.engine.stage_roles import StageRoles, resolve_stage_roles
from omnirelay.engine.tracing import StepTracer

__all__ = [
    "ALLOWED_TRANSITIONS",
    "FINISHED_STATUSES",
    "ARScheduler",
    "BaseScheduler",
    "BatchItem",
    "Executor",
    "ExecutorFactory",
    "GenerationScheduler",
    "IllegalTransitionError",
    "ItemResult",
    "ProcessorFactory",
    "Request",
    "RequestSnapshot",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "SchedulerOutput",
    "StageComponents",
    "StageEngine",
    "StageEngineProtocol",
    "StageOutput",
    "StageRequest",
    "StageRoles",
    "StepTracer",
    "StepUpdate",
    "build_stage_components",
    "create_stage_engine",
    "resolve_stage_roles",
]

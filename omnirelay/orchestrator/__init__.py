"""omnirelay.orchestrator: one request's path across the stages, and the processes that run them.

Files, one role each (DESIGN.md §1, §2):

* ``router.py`` — :class:`Router`: admission, prewarm, routing, the hold rule, forwarding
  through input builders, completion, abort, failure, release (SPEC §2), pure.
* ``messages.py`` — every control-plane message, typed ``msgspec`` structs.
* ``control.py`` — the ZeroMQ control plane (``ipc://`` in a private directory).
* ``worker.py`` — the stage worker process: :func:`worker_main`, :class:`WorkerLoop`.
* ``orchestrator.py`` — :class:`Orchestrator`, the front side (asyncio): workers, routing,
  dead-stage handling, health, shutdown.
* ``handle.py`` — :class:`RequestHandle` (sync and async iteration), :class:`RequestResult`.
* ``factory.py`` — the one place that builds the real stage engine in a worker and the
  orchestrator-side input builders.
* ``testing.py`` — small engines for tests and measurements.

The Python API on top is :class:`omnirelay.api.Pipeline`.
"""

from omnirelay.orchestrator.handle import RequestHandle, RequestResult
from omnirelay.orchestrator.orchestrator import (
    Orchestrator,
    PipelineHealth,
    ShutdownReport,
    StageHealth,
)
from omnirelay.orchestrator.router import (
    ForwardedInput,
    InputBuilder,
    PipelineRequest,
    RequestOutput,
    RequestPlan,
    Router,
    SourceOutput,
    default_input_builder,
)
from omnirelay.orchestrator.worker import DEFAULT_ENGINE_FACTORY, WorkerSpec, leak_paths, worker_main

__all__ = [
    "DEFAULT_ENGINE_FACTORY",
    "ForwardedInput",
    "InputBuilder",
    "Orchestrator",
    "PipelineHealth",
    "PipelineRequest",
    "RequestHandle",
    "RequestOutput",
    "RequestPlan",
    "RequestResult",
    "Router",
    "ShutdownReport",
    "SourceOutput",
    "StageHealth",
    "WorkerSpec",
    "default_input_builder",
    "leak_paths",
    "worker_main",
]

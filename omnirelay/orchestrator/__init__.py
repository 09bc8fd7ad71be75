"""omnirelay.orchestrator: one request's path across the stages, and the processes that run them.

Files, one role each (docs/design.md §1, §2):

* ``router.py`` — :class:`Router`: admission, prewarm, routing, the hold rule, forwarding
  through input builders, completion, abort, failure, release (docs/protocol.md §2), pure.
* ``front_control.py`` — the front's ends of the ZeroMQ control plane (``ipc://`` in a private
  directory).
* ``orchestrator.py`` — :class:`Orchestrator`, the front side (asyncio), a shell over the
  parts beside it: carrying out the router's actions, routing what workers say, what a dead
  worker means for requests, health, shutdown.
* ``supervisor.py`` — :class:`StageSupervisor`: spawning, watching and restarting the
  worker processes by the pipeline's restart policy (docs/design.md §10).
* ``stage_processes.py`` — the worker processes as the front tracks them (:class:`StageState`),
  the worker table (which worker serves which replica of which stage); health and shutdown
  reports.
* ``fence.py`` — the id-reuse fence and the requests parked behind it, pure.
* ``capacity.py`` — admission by real-time capacity: the audio-stream gate and its queue.
* ``requests.py`` — the client's request and outputs; the forwarded-input contract.
* ``handle.py`` — :class:`RequestHandle` (sync and async iteration), :class:`RequestResult`.
* ``input_builders.py`` — the builders of forwarded (complete) inputs.

The stage worker processes it starts, and the control-plane messages, are
:mod:`omnirelay.worker`. The Python API on top is :class:`omnirelay.api.Pipeline`.
"""

from omnirelay.orchestrator.handle import RequestHandle, RequestResult
from omnirelay.orchestrator.orchestrator import Orchestrator
from omnirelay.orchestrator.requests import (
    ForwardedInput,
    InputBuilder,
    PipelineRequest,
    RequestOutput,
    RequestPlan,
    SourceOutput,
    default_input_builder,
)
from omnirelay.orchestrator.router import Router
from omnirelay.orchestrator.stage_processes import PipelineHealth, ShutdownReport, StageHealth, StageState

__all__ = [
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
    "StageState",
    "default_input_builder",
]

"""The Python API: start a pipeline, submit requests, stream their outputs, shut down.

* ``pipeline`` — :class:`Pipeline`, :func:`chat_tokenizer`, :func:`prompt_side`,
  :func:`validate_request_id` (see its module docstring);
* ``options`` — :class:`PipelineOptions` (the user's settings of ``Pipeline.start``) and
  :class:`RuntimeHooks` (the runtime internals tests and benchmarks replace).

It is also the one import surface of the layers above it (``serving``, ``timeline``,
``cli``): the types a pipeline's caller meets are re-exported here from their homes —
what a request gets back (:class:`RequestHandle`, :class:`RequestOutput`,
:class:`RequestResult`, :data:`TRANSCRIPT`), what it asks for (:class:`SamplingParams`,
:func:`stage_sampling_defaults`), what the pipeline reports (:class:`PipelineHealth`,
:class:`StageHealth`, :class:`StageState`, :class:`ShutdownReport`) and what a stage
hands to ``on_stage_output`` (:class:`StageOutput`); and :func:`local_cluster`, simulated
hosts on this machine for a pipeline placed on Ray (``--local-cluster``).
"""

from omnirelay.api.options import PipelineOptions, RuntimeHooks
from omnirelay.api.pipeline import (
    MAX_REQUEST_ID_LEN,
    NO_RESTARTS,
    Pipeline,
    RestartPolicy,
    chat_tokenizer,
    prompt_side,
    validate_request_id,
)
from omnirelay.engine.interfaces import SamplingParams, StageOutput
from omnirelay.orchestrator.handle import RequestHandle, RequestResult
from omnirelay.orchestrator.local_cluster import local_cluster
from omnirelay.orchestrator.requests import RequestOutput, stage_sampling_defaults
from omnirelay.orchestrator.router import TRANSCRIPT
from omnirelay.orchestrator.stage_processes import PipelineHealth, ShutdownReport, StageHealth, StageState

__all__ = [
    "MAX_REQUEST_ID_LEN",
    "NO_RESTARTS",
    "TRANSCRIPT",
    "Pipeline",
    "PipelineHealth",
    "PipelineOptions",
    "RequestHandle",
    "RequestOutput",
    "RequestResult",
    "RestartPolicy",
    "RuntimeHooks",
    "SamplingParams",
    "ShutdownReport",
    "StageHealth",
    "StageOutput",
    "StageState",
    "chat_tokenizer",
    "local_cluster",
    "prompt_side",
    "stage_sampling_defaults",
    "validate_request_id",
]

"""The Python API: start a pipeline, submit requests, stream their outputs, shut down.

* ``pipeline`` — :class:`Pipeline`, :func:`chat_tokenizer`, :func:`prompt_side`,
  :func:`validate_request_id` (see its module docstring);
* ``options`` — :class:`PipelineOptions` (the user's settings of ``Pipeline.start``) and
  :class:`RuntimeHooks` (the runtime internals tests and benchmarks replace).
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

__all__ = [
    "MAX_REQUEST_ID_LEN",
    "NO_RESTARTS",
    "Pipeline",
    "PipelineOptions",
    "RestartPolicy",
    "RuntimeHooks",
    "chat_tokenizer",
    "prompt_side",
    "validate_request_id",
]

"""omnirelay: a runtime for serving multi-stage model pipelines.

The public API is the names below, all importable from here::

    from omnirelay import Pipeline, SamplingParams, chat_tokenizer

    with Pipeline.start("voice-cpu", tokenizer=chat_tokenizer("voice-cpu")) as pipe:
        for out in pipe.submit(text="Hi", modalities=["text"]):  # RequestOutput s
            print(out.text or "", end="")

* starting and running a pipeline: :class:`Pipeline`, :class:`PipelineOptions`,
  :class:`RuntimeHooks`, :class:`RestartPolicy`, :data:`NO_RESTARTS`,
  :func:`load_pipeline`, :class:`PipelineConfig`;
* prompts: :func:`chat_tokenizer`, :func:`prompt_side`, :class:`PromptSide`;
* one request: :class:`SamplingParams`, :class:`RequestHandle`, :class:`RequestOutput`,
  :class:`RequestResult`, :func:`validate_request_id`;
* reports: :class:`PipelineHealth`, :class:`StageHealth`, :class:`ShutdownReport`;
* errors: :class:`OmniRelayError` and its hierarchy (:mod:`omnirelay.errors`).

docs/api.md describes them. Layers (docs/design.md §1): serving → api → orchestrator →
engine → transfer → connectors → payload, with pipeline (topology and contracts),
processors and models plugging in through the pipeline registry.

The names are imported on first use (``import omnirelay`` itself loads no torch): a
command's ``--help`` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from omnirelay.api import (
        NO_RESTARTS,
        Pipeline,
        PipelineHealth,
        PipelineOptions,
        RequestHandle,
        RequestOutput,
        RequestResult,
        RestartPolicy,
        RuntimeHooks,
        SamplingParams,
        ShutdownReport,
        StageHealth,
        chat_tokenizer,
        prompt_side,
        validate_request_id,
    )
    from omnirelay.errors import (
        ConfigError,
        ConnectorError,
        InvalidKeyError,
        InvalidRequestError,
        ModelError,
        OmniRelayError,
        PayloadDecodeError,
        PayloadEncodeError,
        PayloadError,
        PayloadMagicError,
        PayloadSchemaError,
        PayloadTruncatedError,
        PayloadVersionError,
        PipelineConfigError,
        PipelineError,
        RequestFailedError,
        StageDiedError,
        StageUnavailableError,
        TransferError,
    )
    from omnirelay.models.family import PromptSide
    from omnirelay.pipeline import PipelineConfig, load_pipeline

#: Where each public name lives.
_HOMES = {
    "omnirelay.api": (
        "NO_RESTARTS",
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
        "chat_tokenizer",
        "prompt_side",
        "validate_request_id",
    ),
    "omnirelay.errors": (
        "ConfigError",
        "ConnectorError",
        "InvalidKeyError",
        "InvalidRequestError",
        "ModelError",
        "OmniRelayError",
        "PayloadDecodeError",
        "PayloadEncodeError",
        "PayloadError",
        "PayloadMagicError",
        "PayloadSchemaError",
        "PayloadTruncatedError",
        "PayloadVersionError",
        "PipelineConfigError",
        "PipelineError",
        "RequestFailedError",
        "StageDiedError",
        "StageUnavailableError",
        "TransferError",
    ),
    "omnirelay.models.family": ("PromptSide",),
    "omnirelay.pipeline": ("PipelineConfig", "load_pipeline"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "NO_RESTARTS",
    "ConfigError",
    "ConnectorError",
    "InvalidKeyError",
    "InvalidRequestError",
    "ModelError",
    "OmniRelayError",
    "PayloadDecodeError",
    "PayloadEncodeError",
    "PayloadError",
    "PayloadMagicError",
    "PayloadSchemaError",
    "PayloadTruncatedError",
    "PayloadVersionError",
    "Pipeline",
    "PipelineConfig",
    "PipelineConfigError",
    "PipelineError",
    "PipelineHealth",
    "PipelineOptions",
    "PromptSide",
    "RequestFailedError",
    "RequestHandle",
    "RequestOutput",
    "RequestResult",
    "RestartPolicy",
    "RuntimeHooks",
    "SamplingParams",
    "ShutdownReport",
    "StageDiedError",
    "StageHealth",
    "StageUnavailableError",
    "TransferError",
    "__version__",
    "chat_tokenizer",
    "load_pipeline",
    "prompt_side",
    "validate_request_id",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'omnirelay' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""omnirelay.pipeline: topology YAML → validated config, stage contracts, registries.

Files (one role each):

* ``config.py`` — the typed config (:class:`PipelineConfig`, :class:`StageConfig`,
  :class:`ConnectorSpec`, :class:`SamplingConfig`, :class:`Edge`) and its queries:
  ``resolved_async_chunk``, ``any_stage_chunks``, ``stage_receives_chunks``,
  ``next_stage_processor``, ``stage_input_builder``, ``edge_contract``, ``edges``,
  ``final_output_stage_ids``, ``final_stage_id``.
* ``resolve.py`` — the one ``async_chunk`` resolver (docs/protocol.md §1.2).
* ``restart.py`` — :class:`RestartPolicy`: when a dead stage process is started again.
* ``validate.py`` — construction-time checks (docs/protocol.md §1.1–§1.5).
* ``parse.py`` — :func:`load_pipeline` / :func:`parse_pipeline`: shape and types of input.
* ``yamlfile.py`` — shipped names, strict YAML (``true``/``false`` only, no duplicate keys).
* ``registry.py`` — :class:`Registry`, :class:`ComponentRegistry` (executors, processors).
* ``placeholder.py`` — :func:`placeholder_prompt_len` of a prewarmed Talker (docs/protocol.md §2.3).
* ``diagnostics.py`` — :class:`OmniRelayWarning`, :class:`PipelineConfigWarning`.
"""

from omnirelay.pipeline.config import (
    CONNECTOR_BACKENDS,
    DEFAULT_CONNECTOR_NAME,
    DEFAULT_INPUT_WAIT_TIMEOUT_S,
    DEFAULT_MAX_NUM_SEQS,
    ConnectorRole,
    ConnectorSpec,
    Edge,
    EdgeContract,
    EntryInput,
    ExecutionType,
    FinalOutputType,
    FlagOrigin,
    PipelineConfig,
    SamplingConfig,
    StageConfig,
)
from omnirelay.pipeline.diagnostics import OmniRelayWarning, PipelineConfigWarning
from omnirelay.pipeline.parse import load_pipeline, parse_pipeline
from omnirelay.pipeline.placeholder import (
    ASSISTANT_ROLE_TOKEN_ID,
    ASSISTANT_TURN_EXTRA,
    IM_START_TOKEN_ID,
    SYSTEM_ROLE_TOKEN_ID,
    USER_ROLE_TOKEN_ID,
    placeholder_prompt_len,
)
from omnirelay.pipeline.registry import ComponentRegistry, Registry
from omnirelay.pipeline.resolve import resolve_stage_async_chunk
from omnirelay.pipeline.restart import NO_RESTARTS, RestartPolicy
from omnirelay.pipeline.yamlfile import shipped_pipeline_names

__all__ = [
    "ASSISTANT_ROLE_TOKEN_ID",
    "ASSISTANT_TURN_EXTRA",
    "CONNECTOR_BACKENDS",
    "DEFAULT_CONNECTOR_NAME",
    "DEFAULT_INPUT_WAIT_TIMEOUT_S",
    "DEFAULT_MAX_NUM_SEQS",
    "IM_START_TOKEN_ID",
    "NO_RESTARTS",
    "SYSTEM_ROLE_TOKEN_ID",
    "USER_ROLE_TOKEN_ID",
    "ComponentRegistry",
    "ConnectorRole",
    "ConnectorSpec",
    "Edge",
    "EdgeContract",
    "EntryInput",
    "ExecutionType",
    "FinalOutputType",
    "FlagOrigin",
    "OmniRelayWarning",
    "PipelineConfig",
    "PipelineConfigWarning",
    "Registry",
    "RestartPolicy",
    "SamplingConfig",
    "StageConfig",
    "load_pipeline",
    "parse_pipeline",
    "placeholder_prompt_len",
    "resolve_stage_async_chunk",
    "shipped_pipeline_names",
]

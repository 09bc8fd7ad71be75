"""Construction-time validation of a :class:`PipelineConfig` (docs/protocol.md §1.1–§1.5).

:func:`validate_pipeline` runs from ``PipelineConfig.__post_init__``, so every config
in existence — loaded from YAML, built in memory, or decoded in a stage worker — has
passed it. The parser (:mod:`omnirelay.pipeline.parse`) has already checked the
*shape* of user input (unknown keys, types); this module checks *values* and how the
stages fit together:

1. values: at least one stage; ids 0, 1, 2… unique and in order; ranges
   (``max_num_seqs`` ≥ 1, timeout finite and ≥ 0, …); ``final_output`` and
   ``final_output_type`` together; connector names and backends;
2. topology: sources exist and are not the stage itself, an entry stage exists, the
   pipeline is linear (stage *k* reads *k − 1*), at least one final-output stage;
3. contracts: pipeline flag on with edges but no chunk producer → error (§1.2); on each
   edge whose source declares a chunk producer both ends resolve alike (§1.3, the
   error names ``src -> dst``); and, beyond the reference, a stage that would wait for
   chunks reads only sources that send them, and a chunk edge's consumer receives them
   — either mismatch would hang every request.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from omnirelay.pipeline.diagnostics import config_error
from omnirelay.pipeline.placement import check_placement

if TYPE_CHECKING:
    from omnirelay.pipeline.config import PipelineConfig, StageConfig

__all__ = [
    "CONNECTOR_BACKENDS",
    "DEFAULT_CONNECTOR_NAME",
    "ENV_NAME_PATTERN",
    "MPS_PRIORITY_VARIABLE",
    "MPS_SHARE_VARIABLE",
    "NAMESPACE_PATTERN",
    "validate_pipeline",
]

# The constants the config module re-exports live here, so that validation needs nothing
# from the config module at run time (it is imported for annotations only): config
# imports validate, never the other way round.

#: Connector backends a pipeline file may name (network backends later).
CONNECTOR_BACKENDS = ("shm", "nixl", "inproc")
#: Name of the connector a stage uses when it names none; an ``shm`` connector without
#: extras unless the file defines a connector of this name.
DEFAULT_CONNECTOR_NAME = "default"

#: A deployment namespace becomes part of every /dev/shm name (docs/design.md §3). The same
#: rule as ``omnirelay.connectors.base.validate_namespace`` (a test keeps them equal);
#: repeated here so a bad file fails at load time without importing the transport layer.
NAMESPACE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,47}$")
#: An environment variable's name (what a POSIX shell accepts).
ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: The variables the CUDA driver reads at context creation when an MPS daemon runs:
#: the share of SMs a process may occupy, and its priority (0 normal, 1 below normal).
MPS_SHARE_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PRIORITY_VARIABLE = "CUDA_MPS_CLIENT_PRIORITY"


def validate_pipeline(cfg: PipelineConfig) -> None:
    """Raise :class:`PipelineConfigError` for the first problem found; return otherwise."""
    _check_pipeline_values(cfg)
    _check_stage_ids(cfg)
    for stage in cfg.stages:
        _check_stage_values(cfg, stage)
    _check_sources(cfg)
    _check_final_outputs(cfg)
    _check_default_modalities(cfg)
    _check_connectors(cfg)
    _check_chunk_contracts(cfg)
    check_placement(cfg)


def _check_pipeline_values(cfg: PipelineConfig) -> None:
    src = cfg.source
    if not cfg.name:
        raise config_error(src, None, "name", "the pipeline name is empty", "give the pipeline a name")
    t = cfg.input_wait_timeout_s
    if not math.isfinite(t) or t < 0:
        raise config_error(
            src,
            None,
            "input_wait_timeout_s",
            f"must be a finite number of seconds ≥ 0, got {t!r}",
            "use a positive number of seconds (default 600), or 0 to disable the input deadline",
        )
    share = cfg.gpu_memory_utilization
    if not math.isfinite(share) or not 0.0 < share <= 1.0:
        raise config_error(
            src,
            None,
            "gpu_memory_utilization",
            f"must be a share of the device's memory in (0, 1], got {share!r}",
            "use e.g. 0.9 (the default)",
        )
    if cfg.namespace is not None and not NAMESPACE_PATTERN.match(cfg.namespace):
        raise config_error(
            src,
            None,
            "namespace",
            f"{cfg.namespace!r} is not a valid namespace",
            "use 1-48 characters of letters, digits, '_' or '.', starting with a letter or digit, "
            "or remove the key",
        )
    _check_openai_voices(cfg)
    if not cfg.stages:
        raise config_error(
            src,
            None,
            "stages",
            "the pipeline has no stages",
            "list at least one stage under 'stages:' (id, name, execution_type, executor)",
        )


#: A voice name a client may send: what the server matches, case-insensitively.
VOICE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _check_openai_voices(cfg: PipelineConfig) -> None:
    """Names and targets are voice names, each name once (case-insensitively); whether a
    target is one of the pipeline's voices is checked by the server, which knows them."""
    seen: dict[str, str] = {}
    for name, voice in cfg.openai_voices.items():
        for value in (name, voice):
            if not VOICE_NAME_PATTERN.match(value):
                raise config_error(
                    cfg.source,
                    None,
                    f"openai_voices.{name}",
                    f"{value!r} is not a voice name",
                    "use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
                )
        if name.lower() in seen:
            raise config_error(
                cfg.source,
                None,
                f"openai_voices.{name}",
                f"{name!r} is mapped twice (also as {seen[name.lower()]!r}); names are case-insensitive",
                "keep one entry per name",
            )
        seen[name.lower()] = name


def _check_stage_ids(cfg: PipelineConfig) -> None:
    seen: dict[int, int] = {}
    for index, stage in enumerate(cfg.stages):
        if stage.id in seen:
            first = cfg.stages[seen[stage.id]]
            raise config_error(
                cfg.source,
                f"stages[{index}] = {stage.label}",
                "id",
                f"id {stage.id} is already used by stages[{seen[stage.id]}] = {first.label}",
                "give every stage a unique id: 0, 1, 2… in list order",
            )
        seen[stage.id] = index
    for index, stage in enumerate(cfg.stages):
        if stage.id != index:
            raise config_error(
                cfg.source,
                f"stages[{index}] = {stage.label}",
                "id",
                f"stage ids must be 0, 1, 2… in list order, but the stage at position {index} has id {stage.id}",
                f"renumber the stages (this one: id: {index}) and their input_sources",
            )


def _check_stage_values(cfg: PipelineConfig, stage: StageConfig) -> None:
    def fail(key: str, problem: str, fix: str) -> None:
        raise config_error(cfg.source, stage.label, key, problem, fix)

    if not stage.name:
        fail("name", "the stage name is empty", "give the stage a name such as 'talker'")
    if not stage.executor:
        fail("executor", "the executor name is empty", "name a registered executor")
    if stage.max_num_seqs < 1:
        fail("max_num_seqs", f"must be ≥ 1, got {stage.max_num_seqs}", "use a positive int (default 64)")
    if stage.max_num_batched_tokens is not None and stage.max_num_batched_tokens < 1:
        fail(
            "max_num_batched_tokens",
            f"must be ≥ 1, got {stage.max_num_batched_tokens}",
            "use a positive int, or remove the key",
        )
    if stage.max_prefill_piece_tokens is not None:
        if stage.max_prefill_piece_tokens < 1:
            fail(
                "max_prefill_piece_tokens",
                f"must be ≥ 1, got {stage.max_prefill_piece_tokens}",
                "use a positive int, or remove the key",
            )
        if str(stage.execution_type) != "ar":
            fail(
                "max_prefill_piece_tokens",
                "only an AR stage prefills a prompt across steps",
                "remove the key from this stage",
            )
    if stage.async_chunk_prewarm_prompt_len is not None and stage.async_chunk_prewarm_prompt_len <= 1:
        fail(
            "async_chunk_prewarm_prompt_len",
            f"must be an int > 1, got {stage.async_chunk_prewarm_prompt_len}",
            "use an int > 1, or remove the key to size the placeholder from the prompt",
        )
    if stage.final_output and stage.final_output_type is None:
        fail(
            "final_output_type",
            "final_output is true but final_output_type is missing",
            "add final_output_type: text, audio or timestamps",
        )
    if not stage.final_output and stage.final_output_type is not None:
        fail(
            "final_output_type",
            f"final_output_type is {stage.final_output_type.value!r} but final_output is not true",
            "add final_output: true, or remove final_output_type",
        )
    _check_sampling(cfg, stage)
    _check_process_settings(cfg, stage)
    _check_entry_input(cfg, stage)
    _check_replicas(cfg, stage)


#: The most worker processes one stage may run.
MAX_REPLICAS = 64


def _check_replicas(cfg: PipelineConfig, stage: StageConfig) -> None:
    """``replicas`` in 1..:data:`MAX_REPLICAS`; per-replica lists one entry per replica;
    a replica's view names an existing replica; no in-process connector on the edges of a
    replicated stage (its workers are processes)."""

    def fail(key: str, problem: str, fix: str) -> None:
        raise config_error(cfg.source, stage.label, key, problem, fix)

    n = stage.replicas
    if type(n) is not int or not 1 <= n <= MAX_REPLICAS:
        fail("replicas", f"must be an int in 1..{MAX_REPLICAS}, got {n!r}", "use e.g. 2, or remove the key")
    for key in ("replica_devices", "replica_resources"):
        given = getattr(stage, key)
        if given and len(given) != n:
            name = key.removeprefix("replica_")
            fail(name, f"lists {len(given)} entries for {n} replicas", "give one entry per replica")
    if not 0 <= stage.replica < n:
        fail(
            "replica", f"replica {stage.replica} of a stage with {n}", "a worker's view names its own replica"
        )
    if n > 1:
        edges = [stage.id, *(d.id for d in cfg.stages if stage.id in d.input_sources)]
        for dst in edges:
            if (
                cfg.stages[dst].input_sources
                and cfg.connector_spec(cfg.input_connector(dst)).backend == "inproc"
            ):
                fail(
                    "replicas",
                    "a replicated stage's workers are processes, which an inproc connector cannot link",
                    "use the shm connector on its edges (the default), or one replica",
                )


def _check_entry_input(cfg: PipelineConfig, stage: StageConfig) -> None:
    """An ``entry_input`` stage is the first stage, feeds a prompt stage through a complete
    edge (requests without its input enter there), and is no final output."""
    if stage.entry_input is None:
        return

    def fail(problem: str, fix: str) -> None:
        raise config_error(cfg.source, stage.label, "entry_input", problem, fix)

    if stage.id != 0:
        fail("only stage 0 may take the request's input ahead of the prompt stage", "remove the key")
    if stage.final_output:
        fail(
            "an entry stage's output feeds the next stage, not the client",
            "remove final_output (and final_output_type)",
        )
    if len(cfg.stages) < 2:
        fail(
            "it needs a next stage (the prompt stage) to hand its output to", "add the prompt stage after it"
        )
    if stage.chunk_processor is not None:
        fail(
            "its output is handed over complete (the transcript of the whole utterance)",
            "remove chunk_processor",
        )


def _check_process_settings(cfg: PipelineConfig, stage: StageConfig) -> None:
    def fail(key: str, problem: str, fix: str) -> None:
        raise config_error(cfg.source, stage.label, key, problem, fix)

    if stage.gpu_share is not None and not 1 <= stage.gpu_share <= 100:
        fail(
            "gpu_share",
            f"must be a percentage in 1..100, got {stage.gpu_share}",
            "use e.g. 50 (half the GPU's SMs), or remove the key to let the stage use them all",
        )
    for key, variable in (("gpu_share", MPS_SHARE_VARIABLE), ("gpu_priority", MPS_PRIORITY_VARIABLE)):
        if getattr(stage, key) is not None and variable in stage.env:
            fail("env", f"sets {variable}, which {key} sets too", f"keep one of env.{variable} and {key}")
    for name in stage.env:
        if not ENV_NAME_PATTERN.fullmatch(name):
            fail("env", f"{name!r} is not an environment variable name", "use letters, digits and '_'")


def _check_sampling(cfg: PipelineConfig, stage: StageConfig) -> None:
    sp = stage.sampling

    def fail(key: str, problem: str, fix: str) -> None:
        raise config_error(cfg.source, stage.label, f"sampling.{key}", problem, fix)

    if sp.temperature is not None and not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        fail(
            "temperature", f"must be a finite number ≥ 0, got {sp.temperature!r}", "use e.g. 0.9 (0 = greedy)"
        )
    if sp.top_k is not None and sp.top_k < 1:
        fail(
            "top_k", f"must be ≥ 1, got {sp.top_k}", "use a positive int, or remove the key to disable top-k"
        )
    if sp.top_p is not None and not (0 < sp.top_p <= 1):
        fail("top_p", f"must be in (0, 1], got {sp.top_p!r}", "use e.g. 0.95, or remove the key")
    if sp.seed is not None and sp.seed < 0:
        fail("seed", f"must be ≥ 0, got {sp.seed}", "use a non-negative int")
    if sp.max_tokens is not None and sp.max_tokens < 1:
        fail("max_tokens", f"must be ≥ 1, got {sp.max_tokens}", "use a positive int, or remove the key")
    bad = [t for t in sp.stop_token_ids if t < 0]
    if bad:
        fail("stop_token_ids", f"token ids must be ≥ 0, got {bad}", "list non-negative token ids")


def _check_sources(cfg: PipelineConfig) -> None:
    ids = {s.id for s in cfg.stages}
    for stage in cfg.stages:
        seen: set[int] = set()
        for src in stage.input_sources:
            if src == stage.id:
                raise config_error(
                    cfg.source,
                    stage.label,
                    "input_sources",
                    "the stage lists itself as an input source",
                    f"list the stage it reads (stage {stage.id - 1})" if stage.id > 0 else "remove the key",
                )
            if src not in ids:
                raise config_error(
                    cfg.source,
                    stage.label,
                    "input_sources",
                    f"source {src} is not a stage of this pipeline (ids: {sorted(ids)})",
                    "list existing stage ids only",
                )
            if src in seen:
                raise config_error(
                    cfg.source, stage.label, "input_sources", f"source {src} is listed twice", "list it once"
                )
            seen.add(src)
    if all(stage.input_sources for stage in cfg.stages):
        raise config_error(
            cfg.source,
            None,
            "input_sources",
            "every stage has input sources, so no stage takes the client's request",
            "give the first stage no input_sources",
        )
    # Every pipeline in scope is linear (docs/protocol.md §1.1): the orchestrator forwards s -> s+1
    # and prewarms 1..final_stage_id, and transfer keys carry one source stage.
    for stage in cfg.stages:
        expected = () if stage.id == 0 else (stage.id - 1,)
        if tuple(stage.input_sources) != expected:
            raise config_error(
                cfg.source,
                stage.label,
                "input_sources",
                f"pipelines are linear (stage k reads stage k - 1), but this stage reads {list(stage.input_sources)}",
                f"use input_sources: {list(expected)}",
            )


def _check_final_outputs(cfg: PipelineConfig) -> None:
    if not any(stage.final_output for stage in cfg.stages):
        raise config_error(
            cfg.source,
            None,
            "final_output",
            "no stage has final_output: true, so no request could ever finish",
            "mark the stage(s) whose output the client receives with final_output: true and "
            "final_output_type: text, audio or timestamps",
        )


#: The outputs a chat request can ask for (``timestamps`` belong to the speech endpoints).
CHAT_MODALITIES = ("text", "audio")


def _check_default_modalities(cfg: PipelineConfig) -> None:
    wanted = cfg.default_modalities
    if not wanted:
        return
    produced = {str(s.final_output_type) for s in cfg.stages if s.final_output and s.final_output_type}
    offered = [m for m in CHAT_MODALITIES if m in produced]
    bad = [m for m in wanted if m not in offered]
    if bad or len(set(wanted)) != len(wanted):
        problem = f"{bad[0]!r} is not an output of this pipeline" if bad else "a modality is listed twice"
        raise config_error(
            cfg.source,
            None,
            "default_modalities",
            problem,
            f"list each once, from {offered} (the final outputs' types), or remove the key for text only",
        )


def _check_connectors(cfg: PipelineConfig) -> None:
    for name, spec in cfg.connectors.items():
        if spec.backend not in CONNECTOR_BACKENDS:
            raise config_error(
                cfg.source,
                f"connector {name!r}",
                "backend",
                f"unknown backend {spec.backend!r}",
                f"use one of {', '.join(CONNECTOR_BACKENDS)} (shm between processes is the default)",
            )
    known = set(cfg.connectors) | {DEFAULT_CONNECTOR_NAME}
    if cfg.default_connector not in known:
        raise config_error(
            cfg.source,
            None,
            "default_connector",
            f"no connector named {cfg.default_connector!r} is defined (defined: {sorted(cfg.connectors)})",
            "define it under 'connectors:' or name a defined one",
        )
    for stage in cfg.stages:
        if stage.connector is None:
            continue
        if not stage.input_sources:
            raise config_error(
                cfg.source,
                stage.label,
                "connector",
                "'connector' names the connector of the stage's input edges, and this entry stage has none",
                "remove the key (the stage sends through its consumers' connector)",
            )
        if stage.connector not in known:
            raise config_error(
                cfg.source,
                stage.label,
                "connector",
                f"no connector named {stage.connector!r} is defined (defined: {sorted(cfg.connectors)})",
                "define it under 'connectors:' or name a defined one",
            )


def _check_chunk_contracts(cfg: PipelineConfig) -> None:
    has_edges = any(stage.input_sources for stage in cfg.stages)
    if cfg.async_chunk and has_edges and not any(s.chunk_processor for s in cfg.stages):
        raise config_error(
            cfg.source,
            None,
            "async_chunk",
            "the pipeline async_chunk flag is on and the pipeline has edges, but no stage declares a "
            "chunk_processor, so no edge could carry chunks (a full_processor does not count)",
            "set async_chunk: false at the top level (every edge then hands over complete inputs), "
            "or declare chunk_processor on the stages that produce chunks",
        )
    for dst in cfg.stages:
        for src_id in dst.input_sources:
            src = cfg.stages[src_id]
            edge = f"edge {src.id} -> {dst.id} ({src.name} -> {dst.name})"
            src_on, dst_on = cfg.resolved_async_chunk(src), cfg.resolved_async_chunk(dst)
            if src.chunk_processor is not None and src_on != dst_on:
                raise config_error(
                    cfg.source,
                    edge,
                    "async_chunk",
                    f"{src.label} declares chunk_processor {src.chunk_processor!r}, so both ends of this "
                    f"edge must resolve to the same mode, but {src.label} is {_mode(cfg, src)} while "
                    f"{dst.label} is {_mode(cfg, dst)}",
                    "give both stages the same async_chunk (or remove it from both to inherit the pipeline flag)",
                )
            if cfg.stage_receives_chunks(dst) and not (src.chunk_processor is not None and src_on):
                raise config_error(
                    cfg.source,
                    edge,
                    "async_chunk",
                    f"{dst.label} would wait for chunks ({_mode(cfg, dst)}), but {src.label} declares no "
                    "chunk_processor, so no chunk would ever arrive and every request would hang",
                    f"set async_chunk: false on {dst.label} (it then receives the finished output of "
                    f"{src.label} through its input_builder), or give {src.label} a chunk_processor",
                )
            if src.chunk_processor is not None and src_on and not cfg.stage_receives_chunks(dst):
                raise config_error(
                    cfg.source,
                    edge,
                    "connector_role",
                    f"{src.label} sends chunks on this edge, but {dst.label} has connector_role: sender "
                    "and never receives them",
                    f"remove connector_role: sender from {dst.label}, or set async_chunk: false on both stages",
                )


def _mode(cfg: PipelineConfig, stage: StageConfig) -> str:
    return f"async_chunk {cfg.async_chunk_reason(stage)}"  # "async_chunk on (inherits …)"

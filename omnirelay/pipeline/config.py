"""The typed pipeline config (docs/protocol.md §1) and the queries every layer asks of it.

Data (frozen ``msgspec`` structs, so a validated config can cross to stage workers on
the control plane):

* :class:`PipelineConfig` — name, pipeline ``async_chunk`` flag, namespace, input wait
  timeout, named :class:`ConnectorSpec` s, the :class:`StageConfig` list, and the
  :class:`~omnirelay.pipeline.restart.RestartPolicy` of its stage processes.
* :class:`StageConfig` — one stage: execution type, executor, sources, final output,
  the ``async_chunk`` tri-state, processor hooks, connector, scheduler settings and
  :class:`SamplingConfig`.
* :class:`Edge` — one resolved ``src -> dst`` edge (contract, connector, processors).

Queries (methods of :class:`PipelineConfig`; side-effect free):

* :meth:`~PipelineConfig.resolved_async_chunk` — the one resolver (docs/protocol.md §1.2).
* :meth:`~PipelineConfig.any_stage_chunks` — ``any(resolved)`` (§1.4).
* :meth:`~PipelineConfig.stage_receives_chunks` — prewarm / forward / receiver predicate (§1.5).
* :meth:`~PipelineConfig.next_stage_processor`, :meth:`~PipelineConfig.stage_input_builder` (§1.6).
* :meth:`~PipelineConfig.edge_contract`, :meth:`~PipelineConfig.edges` (§1.3).
* :meth:`~PipelineConfig.final_output_stage_ids`, :meth:`~PipelineConfig.final_stage_id` (§2.2).

Construction validates values and topology (:func:`omnirelay.pipeline.validate.validate_pipeline`);
the shape of user input (unknown keys, types) is checked earlier, by
:mod:`omnirelay.pipeline.parse`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from omnirelay.errors import ConfigError
from omnirelay.pipeline.placement import PlacementConfig, edge_backend
from omnirelay.pipeline.resolve import explain_stage_async_chunk, resolve_stage_async_chunk
from omnirelay.pipeline.restart import RestartPolicy
from omnirelay.pipeline.validate import (
    CONNECTOR_BACKENDS,
    DEFAULT_CONNECTOR_NAME,
    MPS_PRIORITY_VARIABLE,
    MPS_SHARE_VARIABLE,
    validate_pipeline,
)

__all__ = [
    "CONNECTOR_BACKENDS",
    "DEFAULT_CONNECTOR_NAME",
    "DEFAULT_INPUT_WAIT_TIMEOUT_S",
    "DEFAULT_MAX_NUM_SEQS",
    "ConnectorRole",
    "ConnectorSpec",
    "DeviceGroups",
    "Edge",
    "EdgeContract",
    "EntryInput",
    "ExecutionType",
    "FinalOutputType",
    "FlagOrigin",
    "GpuPriority",
    "PipelineConfig",
    "SamplingConfig",
    "StageConfig",
    "WorkerRef",
]

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_INPUT_WAIT_TIMEOUT_S = 600.0
#: The share of a CUDA device's memory a process's stages may use (vLLM's convention).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class ExecutionType(enum.StrEnum):
    """How a stage runs (docs/protocol.md §1.1)."""

    AR = "ar"  # autoregressive: one token (or frame) per step
    GENERATION = "generation"  # one-shot: prefill the whole input, emit an output


class FinalOutputType(enum.StrEnum):
    """The modality a final-output stage gives the client."""

    TEXT = "text"
    AUDIO = "audio"
    TIMESTAMPS = "timestamps"


class EntryInput(enum.StrEnum):
    """What a stage declared with ``entry_input`` takes from the client's request."""

    AUDIO = "audio"  # the request's audio (a complete utterance); requests without audio skip it


class ConnectorRole(enum.StrEnum):
    """An explicit role of a stage on its connector; ``SENDER`` never receives chunks (§1.5)."""

    SENDER = "sender"
    RECEIVER = "receiver"


class EdgeContract(enum.StrEnum):
    """What an edge carries (docs/protocol.md §1.3)."""

    CHUNKS = "chunks"  # incremental handoff over the connector while the source runs
    COMPLETE_INPUT = "complete input"  # the orchestrator forwards the finished output


class GpuPriority(enum.StrEnum):
    """A stage's scheduling priority among the processes sharing a GPU under MPS."""

    NORMAL = "normal"
    LOW = "low"  # its kernels yield SMs to normal-priority processes' kernels


_MPS_PRIORITY_VALUES = {GpuPriority.NORMAL: "0", GpuPriority.LOW: "1"}


class DeviceGroups(enum.StrEnum):
    """Which stages share one worker process (``device_groups:``, docs/design.md §12)."""

    AUTO = "auto"  # the default: the stages placed on one CUDA device share a process
    ON = "on"  # also the stages on no CUDA device share one (CPU pipelines, tests)
    OFF = "off"  # every stage in a process of its own


class FlagOrigin(enum.StrEnum):
    """Where the pipeline ``async_chunk`` flag came from (shown by ``omnirelay check``)."""

    DEFAULT = "default"
    FILE = "file"
    OVERRIDE = "override"


class SamplingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-stage sampling defaults; ``None`` leaves the executor's default."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()


class ConnectorSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A named connector: the backend and the extras passed through to the edge's users.

    ``extra`` is read by the connector and by the processors of the edges that use it
    (for example ``initial_codec_chunk_frames``, ``codec_chunk_frames`` and
    ``codec_left_context_frames`` of the Talker → Code2Wav processor, docs/protocol.md §5.2).
    """

    backend: str = "shm"
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class StageConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of a pipeline.

    Processor hooks (names in the processor registry, docs/protocol.md §1.1/§1.6):
    ``chunk_processor`` builds the next stage's per-step chunk payload; ``full_processor``
    the full payload; ``input_builder`` (orchestrator side) turns finished source outputs
    into this stage's input; ``sync_input_builder`` replaces ``input_builder`` when this
    stage's resolved ``async_chunk`` is off.

    ``connector`` names the connector of this stage's *input* edges (``None``: the
    pipeline's ``default_connector``); both ends of an edge use it.

    Process settings (applied in the stage's worker before its engine is built, see
    :meth:`process_env`): ``env`` sets environment variables; ``gpu_share`` (1–100) caps
    the share of the GPU's SMs the stage's kernels may occupy and ``gpu_priority`` ranks
    its kernels against other stages' when several stages share a GPU under MPS (the
    driver reads both only when an MPS daemon runs; without one they change nothing).

    ``entry_input: audio`` (stage 0 only): requests that carry audio enter here (a speech
    recognizer: the complete utterance in, its transcript out, forwarded to stage 1);
    requests without audio skip the stage and enter at stage 1, the prompt stage.
    """

    id: int
    name: str
    execution_type: ExecutionType
    executor: str
    executor_args: dict[str, Any] = msgspec.field(default_factory=dict)
    input_sources: tuple[int, ...] = ()
    final_output: bool = False
    final_output_type: FinalOutputType | None = None
    async_chunk: bool | None = None
    chunk_processor: str | None = None
    full_processor: str | None = None
    input_builder: str | None = None
    sync_input_builder: str | None = None
    connector: str | None = None
    connector_role: ConnectorRole | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    #: An AR stage prefills a longer prompt in pieces of at most this many tokens, one
    #: per step (docs/design.md §12); None: in one step. Needs an executor that takes pieces.
    max_prefill_piece_tokens: int | None = None
    async_scheduling: bool = True
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    devices: str | None = None
    async_chunk_prewarm_prompt_len: int | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    gpu_share: int | None = None
    gpu_priority: GpuPriority | None = None
    entry_input: EntryInput | None = None
    #: Ray resources the stage's worker needs (a placement of ``backend: ray`` only);
    #: custom ones (``hostB: 1``) pin it to the nodes that offer them
    resources: dict[str, float] = msgspec.field(default_factory=dict)
    #: Worker processes of the stage (``replicas:``), each with its own engine; a request
    #: is bound to one of them when it enters the stage (docs/design.md §11).
    replicas: int = 1
    #: Per-replica ``devices`` when the file lists one per replica (``devices: [cuda:0,
    #: cuda:1]``); empty: every replica uses :attr:`devices`, which is replica 0's.
    replica_devices: tuple[str | None, ...] = ()
    #: Per-replica ``resources`` when the file lists one mapping per replica; empty:
    #: every replica uses :attr:`resources`, which is replica 0's.
    replica_resources: tuple[dict[str, float], ...] = ()
    #: Which replica this config describes: 0 in the pipeline file; a replica's worker
    #: sees its own (:meth:`PipelineConfig.for_replica`). Never written in a file.
    replica: int = 0
    #: Keep this stage in a worker process of its own even where its device is shared
    #: with other stages (``own_process: true``; isolation, or to compare).
    own_process: bool = False

    @property
    def label(self) -> str:
        """``stage 1 (talker)``: how messages name this stage."""
        return f"stage {self.id} ({self.name})"

    def replica_label(self, replica: int) -> str:
        """``stage 1 (talker) replica 1`` for a replicated stage, else :attr:`label`."""
        return self.label if self.replicas == 1 else f"{self.label} replica {replica}"

    def replica_devices_of(self, replica: int) -> str | None:
        """The ``devices`` of one replica."""
        return self.replica_devices[replica] if self.replica_devices else self.devices

    def replica_resources_of(self, replica: int) -> dict[str, float]:
        """The Ray ``resources`` of one replica."""
        return dict(self.replica_resources[replica]) if self.replica_resources else dict(self.resources)

    def for_replica(self, replica: int) -> StageConfig:
        """This stage as replica ``replica``'s worker sees it: that replica's devices and
        resources in :attr:`devices` and :attr:`resources`, :attr:`replica` set."""
        if type(replica) is not int or not 0 <= replica < self.replicas:
            raise ConfigError(f"{self.label} has no replica {replica!r}; it has {self.replicas}")
        return msgspec.structs.replace(
            self,
            devices=self.replica_devices_of(replica),
            resources=self.replica_resources_of(replica),
            replica=replica,
        )

    def process_env(self) -> dict[str, str]:
        """The environment variables the stage's worker sets before it touches a device:
        ``env`` plus what ``gpu_share`` and ``gpu_priority`` stand for."""
        out = dict(self.env)
        if self.gpu_share is not None:
            out[MPS_SHARE_VARIABLE] = str(self.gpu_share)
        if self.gpu_priority is not None:
            out[MPS_PRIORITY_VARIABLE] = _MPS_PRIORITY_VALUES[self.gpu_priority]
        return out


class Edge(msgspec.Struct, frozen=True, kw_only=True):
    """One resolved edge ``src -> dst`` (built by :meth:`PipelineConfig.edges`)."""

    src: int
    dst: int
    contract: EdgeContract
    connector: str
    backend: str
    extra: dict[str, Any]
    #: The source's next-stage processor (§1.6): the chunk producer on a chunk edge, else
    #: the full producer (may be ``None``: the orchestrator forwards the output).
    processor: str | None
    #: The destination's input builder the orchestrator calls to forward the finished
    #: output (§1.6, §2.5); ``None`` on a chunk edge, which is never forwarded.
    input_builder: str | None

    @property
    def label(self) -> str:
        return f"{self.src} -> {self.dst}"


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """One worker process of a pipeline: replica ``replica`` of stage ``stage_id``;
    ``index`` numbers every worker, stage by stage (the control plane's address)."""

    index: int
    stage_id: int
    replica: int


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A validated pipeline. Build it with :func:`omnirelay.pipeline.load_pipeline`.

    Invariant (checked at construction): stage ids are 0, 1, 2… in list order and
    stage *k* reads stage *k − 1* (every pipeline in scope is linear, docs/protocol.md §1.1), so a
    stage id is also its index in :attr:`stages`.
    """

    name: str
    stages: tuple[StageConfig, ...]
    async_chunk: bool = True
    async_chunk_origin: FlagOrigin = FlagOrigin.DEFAULT
    namespace: str | None = None
    #: Stall deadline of a request waiting for input (docs/protocol.md §4.10); 0 disables it.
    input_wait_timeout_s: float = DEFAULT_INPUT_WAIT_TIMEOUT_S
    connectors: dict[str, ConnectorSpec] = msgspec.field(default_factory=dict)
    default_connector: str = DEFAULT_CONNECTOR_NAME
    description: str = ""
    #: What a chat request that names no ``modalities`` gets (a subset of ``text``,
    #: ``audio`` among the final outputs); empty: text only, as OpenAI's API.
    default_modalities: tuple[str, ...] = ()
    #: OpenAI voice names (``alloy``, ``echo`` …) mapped to voices the pipeline speaks with,
    #: so OpenAI clients can keep theirs; the server checks each target against its voices.
    openai_voices: dict[str, str] = msgspec.field(default_factory=dict)
    #: When and how often a dead stage worker is started again (``restart:``).
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    #: Where the stage workers run (``placement:``; local processes by default).
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    #: Audio streams served at once (``max_audio_streams:``, the machine's real-time
    #: capacity; None: no fixed limit). More wait, or get 429 from the server
    #: (:class:`omnirelay.orchestrator.capacity.StreamGate`).
    max_audio_streams: int | None = None
    #: Also hold new audio streams while an admitted one is running dry
    #: (``hold_audio_while_dry:``): for pipelines whose streams never pause by design.
    hold_audio_while_dry: bool = False
    #: Reproducible mode (``reproducible:``): each request's answer is the same whatever else
    #: runs beside it and however fast its chunks come — every stage steps each request's rows
    #: on their own, and a codec edge cuts its chunks on a fixed frame schedule (docs/usage.md).
    reproducible: bool = False
    #: Which stages share a worker process (``device_groups:``; :mod:`omnirelay.pipeline.groups`).
    device_groups: DeviceGroups = DeviceGroups.AUTO
    #: The share of each CUDA device's memory the stages of one process may use
    #: (``gpu_memory_utilization:``): KV slots not given by ``executor_args.max_num_seqs``
    #: are sized from what it leaves after the weights (docs/design.md §12).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    #: The file this config came from (``<dict>`` when built in memory); errors name it.
    source: str = "<dict>"

    def __post_init__(self) -> None:
        validate_pipeline(self)

    # -- lookup -------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def workers(self) -> tuple[WorkerRef, ...]:
        """Every worker process of the pipeline: each stage's replicas, stage by stage."""
        out: list[WorkerRef] = []
        for s in self.stages:
            for r in range(s.replicas):
                out.append(WorkerRef(len(out), s.id, r))
        return tuple(out)

    @property
    def num_workers(self) -> int:
        return sum(s.replicas for s in self.stages)

    @property
    def has_replicas(self) -> bool:
        """Does any stage run more than one worker?"""
        return any(s.replicas > 1 for s in self.stages)

    def for_replica(self, stage_id: int, replica: int) -> PipelineConfig:
        """The pipeline as replica ``replica`` of stage ``stage_id`` sees it (its worker):
        that stage's config is the replica's (:meth:`StageConfig.for_replica`)."""
        view = self.stage(stage_id).for_replica(replica)
        if replica == 0 and view == self.stages[stage_id]:
            return self
        stages = tuple(view if s.id == stage_id else s for s in self.stages)
        return msgspec.structs.replace(self, stages=stages)

    def stage(self, stage: StageConfig | int) -> StageConfig:
        """The stage with this id (or the stage itself)."""
        if isinstance(stage, StageConfig):
            return stage
        if type(stage) is not int or not 0 <= stage < len(self.stages):
            raise ConfigError(
                f"pipeline {self.name!r} has no stage {stage!r}; its stage ids are 0..{len(self.stages) - 1}"
            )
        return self.stages[stage]

    @property
    def prompt_stage_id(self) -> int:
        """The stage a request's prompt (token ids, sampling) is for: stage 0, or stage 1
        behind an ``entry_input`` stage. Requests without audio enter here."""
        return 1 if self.stages[0].entry_input is not None else 0

    @property
    def audio_entry_stage_id(self) -> int | None:
        """The stage that takes a request's audio input before the prompt stage (its
        ``entry_input: audio``); None when the pipeline has none."""
        return 0 if self.stages[0].entry_input is EntryInput.AUDIO else None

    def connector_spec(self, name: str) -> ConnectorSpec:
        """The named connector; :data:`DEFAULT_CONNECTOR_NAME` is ``shm`` unless defined."""
        spec = self.connectors.get(name)
        if spec is not None:
            return spec
        if name == DEFAULT_CONNECTOR_NAME:
            return ConnectorSpec()
        raise ConfigError(
            f"pipeline {self.name!r} has no connector {name!r}; defined: {sorted(self.connectors)}"
        )

    def input_connector(self, stage: StageConfig | int) -> str:
        """Name of the connector of ``stage``'s input edges."""
        s = self.stage(stage)
        return s.connector if s.connector is not None else self.default_connector

    def consumer_ids(self, stage: StageConfig | int) -> tuple[int, ...]:
        """Ids of the stages that read ``stage``'s output."""
        sid = self.stage(stage).id
        return tuple(s.id for s in self.stages if sid in s.input_sources)

    # -- async_chunk (docs/protocol.md §1.2–§1.6) -----------------------------------------------

    def resolved_async_chunk(self, stage: StageConfig | int) -> bool:
        """THE resolver of a stage's mode; every consumer of the flag calls this."""
        s = self.stage(stage)
        return resolve_stage_async_chunk(self.async_chunk, s.async_chunk, num_stages=len(self.stages))

    def async_chunk_reason(self, stage: StageConfig | int) -> str:
        """Why :meth:`resolved_async_chunk` says what it says (for ``omnirelay check``, logs)."""
        s = self.stage(stage)
        return explain_stage_async_chunk(
            self.async_chunk,
            s.async_chunk,
            num_stages=len(self.stages),
            pipeline_origin=str(self.async_chunk_origin),
        )

    def any_stage_chunks(self) -> bool:
        """``any(resolved)`` over all stages — never read off stage 0 (docs/protocol.md §1.4)."""
        return any(self.resolved_async_chunk(s) for s in self.stages)

    def stage_receives_chunks(self, stage: StageConfig | int) -> bool:
        """Resolved on, has an input, and not an explicit ``sender`` (docs/protocol.md §1.5).

        Decides prewarm, whether finished upstream outputs are forwarded instead, and
        whether the stage's adapter registers receivers.
        """
        s = self.stage(stage)
        return (
            bool(s.input_sources)
            and self.resolved_async_chunk(s)
            and s.connector_role is not ConnectorRole.SENDER
        )

    def next_stage_processor(self, stage: StageConfig | int) -> str | None:
        """The chunk producer when resolved on and declared, else the full producer (§1.6)."""
        s = self.stage(stage)
        if self.resolved_async_chunk(s) and s.chunk_processor is not None:
            return s.chunk_processor
        return s.full_processor

    def stage_input_builder(self, stage: StageConfig | int) -> str | None:
        """``sync_input_builder`` when resolved off and declared, else ``input_builder`` (§1.6)."""
        s = self.stage(stage)
        if not self.resolved_async_chunk(s) and s.sync_input_builder is not None:
            return s.sync_input_builder
        return s.input_builder

    def edge_contract(self, src: StageConfig | int, dst: StageConfig | int) -> EdgeContract:
        """``chunks`` when the source produces chunks in its resolved mode, else ``complete input``.

        Validation guarantees that a chunk edge's consumer receives chunks and that a
        chunk-receiving stage only reads chunk edges.
        """
        s, d = self.stage(src), self.stage(dst)
        if s.id not in d.input_sources:
            raise ConfigError(f"pipeline {self.name!r} has no edge {s.id} -> {d.id}")
        if s.chunk_processor is not None and self.resolved_async_chunk(s):
            return EdgeContract.CHUNKS
        return EdgeContract.COMPLETE_INPUT

    def edges(self) -> tuple[Edge, ...]:
        """Every edge in stage order, resolved."""
        out = []
        for d in self.stages:
            name = self.input_connector(d)
            spec = self.connector_spec(name)
            for src in d.input_sources:
                contract = self.edge_contract(src, d)
                out.append(
                    Edge(
                        src=src,
                        dst=d.id,
                        contract=contract,
                        connector=name,
                        backend=edge_backend(self, src, d.id, spec.backend),
                        extra=dict(spec.extra),
                        processor=self.next_stage_processor(src),
                        input_builder=(
                            self.stage_input_builder(d) if contract is EdgeContract.COMPLETE_INPUT else None
                        ),
                    )
                )
        return tuple(out)

    # -- final outputs (docs/protocol.md §2.2) ----------------------------------------------------

    def final_output_stage_ids(self, modalities: Iterable[str] | None = None) -> tuple[int, ...]:
        """Final-output stages whose type was requested; unknown modalities are ignored,
        and when none is left (or ``None``), every final-output stage."""
        finals = [s for s in self.stages if s.final_output]
        if isinstance(modalities, str):  # one modality, not an iterable of letters
            modalities = (modalities,)
        wanted = set(modalities or ())
        chosen = [s.id for s in finals if s.final_output_type is not None and s.final_output_type in wanted]
        return tuple(chosen) if chosen else tuple(s.id for s in finals)

    def final_stage_id(self, modalities: Iterable[str] | None = None) -> int:
        """The highest of :meth:`final_output_stage_ids` (fallback: the last stage)."""
        ids = self.final_output_stage_ids(modalities)
        return max(ids) if ids else self.stages[-1].id

    # -- derived configs ------------------------------------------------------------------

    def with_async_chunk(self, value: bool) -> PipelineConfig:
        """A validated copy with the pipeline flag overridden (like ``--async-chunk``)."""
        if type(value) is not bool:
            raise ConfigError(f"async_chunk override must be True or False, got {value!r}")
        return msgspec.structs.replace(self, async_chunk=value, async_chunk_origin=FlagOrigin.OVERRIDE)

    def with_placement(self, placement: PlacementConfig) -> PipelineConfig:
        """A validated copy placed otherwise (a started cluster's address, resolved endpoints)."""
        return msgspec.structs.replace(self, placement=placement)

    def with_device_groups(self, value: DeviceGroups | str) -> PipelineConfig:
        """A copy whose stages share processes otherwise (``--device-groups``)."""
        try:
            groups = DeviceGroups(value)
        except ValueError:
            choices = ", ".join(g.value for g in DeviceGroups)
            raise ConfigError(f"device_groups must be one of {choices}, got {value!r}") from None
        return msgspec.structs.replace(self, device_groups=groups)

    def with_restart(self, policy: RestartPolicy) -> PipelineConfig:
        """A copy with another restart policy (``serve --max-restarts``, ``run``'s fail-fast)."""
        if not isinstance(policy, RestartPolicy):
            raise ConfigError(f"restart policy must be a RestartPolicy, got {policy!r}")
        return msgspec.structs.replace(self, restart=policy)

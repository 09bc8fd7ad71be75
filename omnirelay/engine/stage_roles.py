"""A stage's transfer roles, read off the pipeline's resolved contracts (docs/protocol.md §1.3–§1.5).

* **sender** to stage *c* iff the edge ``stage -> c`` carries chunks
  (:meth:`PipelineConfig.edge_contract` is ``chunks``: the stage declares a chunk producer
  and its resolved ``async_chunk`` is on) and *c* receives chunks;
* **receiver** from its input source iff :meth:`PipelineConfig.stage_receives_chunks`.

The scheduler choice, the adapter's roles and the orchestrator's prewarm all come from
these same two pipeline queries, so they cannot disagree (the hang of docs/protocol.md §1.2).
"""

from __future__ import annotations

import dataclasses

from omnirelay.errors import ConfigError
from omnirelay.pipeline.config import EdgeContract, PipelineConfig, StageConfig
from omnirelay.transfer.transfer_config import TransferConfig

__all__ = ["StageRoles", "resolve_stage_roles"]


@dataclasses.dataclass(frozen=True, slots=True)
class StageRoles:
    stage_id: int
    send_to_stage: int | None
    receive_from_stage: int | None
    #: Name of the pipeline connector the stage's adapter uses (None: no chunk edge).
    connector_name: str | None

    @property
    def is_sender(self) -> bool:
        return self.send_to_stage is not None

    @property
    def is_receiver(self) -> bool:
        return self.receive_from_stage is not None

    @property
    def has_transfer(self) -> bool:
        return self.is_sender or self.is_receiver

    def transfer_config(
        self,
        stage: StageConfig,
        pipeline: PipelineConfig,
        given: TransferConfig | None,
    ) -> TransferConfig:
        """The adapter config: ``given`` (tuning) with the roles filled in from the pipeline.

        A role set in ``given`` that disagrees with the pipeline is an error; the stall
        timeout defaults to the pipeline's ``input_wait_timeout_s``.
        """
        if given is None:
            return TransferConfig(
                stage_id=stage.id,
                send_to_stage=self.send_to_stage,
                receive_from_stage=self.receive_from_stage,
                stall_timeout_s=pipeline.input_wait_timeout_s,
            )
        if given.stage_id != stage.id:
            raise ConfigError(
                f"{stage.label}: transfer_config.stage_id is {given.stage_id}, expected {stage.id}"
            )
        for name, expected in (
            ("send_to_stage", self.send_to_stage),
            ("receive_from_stage", self.receive_from_stage),
        ):
            value = getattr(given, name)
            if value is not None and value != expected:
                raise ConfigError(
                    f"{stage.label}: transfer_config.{name} is {value} but the pipeline's resolved "
                    f"contracts say {expected} (leave it unset: the engine derives the roles)"
                )
        return dataclasses.replace(
            given,
            send_to_stage=self.send_to_stage,
            receive_from_stage=self.receive_from_stage,
        )


def resolve_stage_roles(pipeline: PipelineConfig, stage: StageConfig | int) -> StageRoles:
    s = pipeline.stage(stage)
    chunk_consumers = [
        c
        for c in pipeline.consumer_ids(s)
        if pipeline.edge_contract(s, c) is EdgeContract.CHUNKS and pipeline.stage_receives_chunks(c)
    ]
    if len(chunk_consumers) > 1:
        raise ConfigError(
            f"{s.label} sends chunks to stages {chunk_consumers}; one chunk consumer per stage is supported"
        )
    send_to = chunk_consumers[0] if chunk_consumers else None
    receive_from = None
    if pipeline.stage_receives_chunks(s):
        if len(s.input_sources) != 1:
            raise ConfigError(
                f"{s.label} receives chunks from {list(s.input_sources)}; exactly one source is supported"
            )
        receive_from = s.input_sources[0]
    names = set()
    if send_to is not None:
        names.add(pipeline.input_connector(send_to))
    if receive_from is not None:
        names.add(pipeline.input_connector(s))
    if len(names) > 1:
        raise ConfigError(
            f"{s.label} receives and sends chunks over different connectors ({', '.join(sorted(names))}); "
            "one stage process uses one connector: give both edges the same one"
        )
    return StageRoles(s.id, send_to, receive_from, names.pop() if names else None)

"""The connector a stage's engine uses, built from the backends of its edges.

A stage has at most one chunk edge in (``receive_from_stage``) and one out
(``send_to_stage``). Each edge's backend is resolved from placement
(:func:`omnirelay.pipeline.placement.edge_backend`: ``shm`` on one host, ``nixl`` between
hosts, ``inproc`` between two stages of one device group, whose objects then go by
reference). One backend: one connector, as before placement existed. Two: a
:class:`~omnirelay.connectors.split.SplitConnector` over one of each.

A ``nixl`` connector is told the pipeline's notice endpoints (filled by the placement at
start) and binds its claim server on the stage's node address; its timing options come
from the edges' connector ``extra`` as ``nixl_lease_s``, ``nixl_claim_timeout_s`` and
``nixl_read_timeout_s`` (the same connector may resolve to ``shm`` on one host, so the
names say which backend they are for).
"""

from __future__ import annotations

from typing import Any

from omnirelay.connectors import Connector, create_connector, inbox_name
from omnirelay.engine.stage_roles import StageRoles
from omnirelay.pipeline.config import PipelineConfig, StageConfig
from omnirelay.pipeline.groups import group_key
from omnirelay.pipeline.placement import edge_backend

__all__ = ["NIXL_EXTRA_OPTIONS", "build_stage_connector", "stage_edge_backends"]

#: ``extra`` keys of a connector spec passed to a ``nixl`` connector (without the prefix).
NIXL_EXTRA_OPTIONS = ("nixl_lease_s", "nixl_claim_timeout_s", "nixl_read_timeout_s")


def stage_edge_backends(
    pipeline: PipelineConfig, stage: StageConfig, roles: StageRoles
) -> tuple[str | None, str | None]:
    """(backend of the chunk edge in, backend of the chunk edge out); None where none."""

    def backend(src: int, dst: int) -> str:
        spec = pipeline.connector_spec(pipeline.input_connector(dst))
        return edge_backend(pipeline, src, dst, spec.backend)

    into = None if roles.receive_from_stage is None else backend(roles.receive_from_stage, stage.id)
    out = None if roles.send_to_stage is None else backend(stage.id, roles.send_to_stage)
    return into, out


def _options(pipeline: PipelineConfig, stage: StageConfig, backend: str, *, listens: bool) -> dict[str, Any]:
    if backend == "inproc":
        # An edge inside a device group: objects by reference (docs/protocol.md §3.10).
        return {"by_reference": True} if group_key(pipeline, stage) is not None else {}
    if backend == "shm":
        from omnirelay.connectors.device.paths import gpu_direct_options

        # Where both stages of an shm edge are on CUDA devices, its tensors go device to device.
        return gpu_direct_options(pipeline, stage)
    if backend != "nixl":
        return {}
    placement = pipeline.placement
    options: dict[str, Any] = {"endpoints": dict(placement.endpoints), "listen": listens}
    host = placement.node_ips.get(inbox_name(stage.id, stage.replica))
    if host:
        options["claim_host"] = host
    for extra in _edge_extras(pipeline, stage):
        options.update({k[len("nixl_") :]: v for k, v in extra.items() if k in NIXL_EXTRA_OPTIONS})
    return options


def _edge_extras(pipeline: PipelineConfig, stage: StageConfig) -> list[dict[str, Any]]:
    """The connector ``extra`` of the stage's chunk edges: its input edge's, then those of
    the edges it sends on (the producer's settings, such as its lease, win)."""
    readers = ([stage.id] if stage.input_sources else []) + list(pipeline.consumer_ids(stage))
    return [dict(pipeline.connector_spec(pipeline.input_connector(sid)).extra) for sid in readers]


def build_stage_connector(
    pipeline: PipelineConfig, stage: StageConfig, roles: StageRoles, namespace: str
) -> Connector:
    into, out = stage_edge_backends(pipeline, stage, roles)
    if into is None or out is None or into == out:
        backend = into or out
        assert backend is not None
        return create_connector(
            backend,
            namespace=namespace,
            stage_id=stage.id,
            replica=stage.replica,
            **_options(pipeline, stage, backend, listens=into is not None),
        )
    input_side = create_connector(
        into,
        namespace=namespace,
        stage_id=stage.id,
        replica=stage.replica,
        **_options(pipeline, stage, into, listens=True),
    )
    try:
        output_side = create_connector(
            out,
            namespace=namespace,
            stage_id=stage.id,
            replica=stage.replica,
            **_options(pipeline, stage, out, listens=False),
        )
    except BaseException:
        input_side.close()
        raise
    from omnirelay.connectors.split import SplitConnector

    return SplitConnector(input_side, output_side)

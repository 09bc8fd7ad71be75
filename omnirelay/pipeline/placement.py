"""Where stage workers run: ``placement:`` of a pipeline file and per-stage ``resources:``.

::

    placement:
      backend: ray            # local (default): worker processes of this machine
      address: auto           # the Ray cluster (auto, host:port, ray://host:10001); default auto
      edges: {"1 -> 2": nixl} # optional per-edge connector backend override
    stages:
      - id: 2
        resources: {hostB: 1} # Ray resources the stage's worker needs (custom ones name hosts)

An edge's backend is resolved from placement (:func:`edge_backend`): between two stages of
one worker process (a device group, :mod:`omnirelay.pipeline.groups`) it is ``inproc``;
placed on Ray, between two stages
pinned to the same host by the same custom resource it is the connector's own backend
(``shm``); otherwise ``nixl`` — a stage without a custom resource may land on any node, so
its edges assume another host. ``placement.edges`` overrides one edge (``shm`` across hosts
is refused: shared memory does not reach another machine).

``endpoints`` is never written in a file: the orchestrator fills it when it placed the
workers (each reading stage's nixl notice endpoint, ``tcp://<node ip>:<port>``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from omnirelay.pipeline.diagnostics import config_error

if TYPE_CHECKING:
    from omnirelay.pipeline.config import PipelineConfig, StageConfig

__all__ = [
    "PLACEMENT_BACKENDS",
    "PLACEMENT_KEYS",
    "PlacementConfig",
    "check_placement",
    "edge_backend",
    "parse_placement",
    "parse_resources",
    "stage_host",
]

PLACEMENT_BACKENDS = ("local", "ray")
PLACEMENT_KEYS = ("backend", "address", "edges")
#: Ray's built-in resources: they say how much of a node, never which node
_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
_EDGE_RE = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*$")
_EDGE_BACKENDS = ("shm", "nixl")


class PlacementConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    backend: str = "local"
    address: str | None = None
    #: edge label ``"src -> dst"`` -> backend
    edges: dict[str, str] = msgspec.field(default_factory=dict)
    #: filled at start (never in a file): a reading worker's inbox (``"2"``, or
    #: ``"2.1"`` for a stage's replica 1) -> its nixl notice endpoint
    endpoints: dict[str, str] = msgspec.field(default_factory=dict)
    #: filled at start: a worker's inbox name -> the address of the node it runs on
    node_ips: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def is_ray(self) -> bool:
        return self.backend == "ray"


def stage_host(stage: StageConfig) -> tuple[str, ...] | None:
    """The custom resources pinning every replica of ``stage`` to one host (sorted); None
    when one names none, or its replicas are pinned to different hosts."""
    hosts = {_host(stage.replica_resources_of(r)) for r in range(stage.replicas)}
    return hosts.pop() if len(hosts) == 1 else None


def _host(resources: Mapping[str, float]) -> tuple[str, ...] | None:
    keys = tuple(sorted(k for k in resources if k not in _BUILTIN_RESOURCES))
    return keys or None


def edge_backend(cfg: PipelineConfig, src: int, dst: int, spec_backend: str) -> str:
    """The backend of edge ``src -> dst`` (see the module docstring)."""
    placement = cfg.placement
    if not placement.is_ray:
        from omnirelay.pipeline.groups import shares_process

        return "inproc" if shares_process(cfg, src, dst) else spec_backend
    override = placement.edges.get(f"{src} -> {dst}")
    if override is not None:
        return override
    a, b = stage_host(cfg.stages[src]), stage_host(cfg.stages[dst])
    return spec_backend if a is not None and a == b else "nixl"


def _edge_label(raw: object) -> tuple[int, int] | None:
    m = _EDGE_RE.match(raw) if isinstance(raw, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_placement(source: str, raw: object) -> PlacementConfig:
    """``placement:`` as written (shapes and types; :func:`check_placement` the rest)."""
    fix = "write e.g. 'placement: {backend: ray, address: auto}'"
    if not isinstance(raw, Mapping):
        raise config_error(source, None, "placement", f"expected a mapping, got {type(raw).__name__}", fix)
    unknown = [k for k in raw if k not in PLACEMENT_KEYS]
    if unknown:
        raise config_error(
            source, "placement", str(unknown[0]), "unknown key", f"use only {', '.join(PLACEMENT_KEYS)}"
        )
    backend = raw.get("backend", "local")
    if backend not in PLACEMENT_BACKENDS:
        raise config_error(
            source, "placement", "backend", f"unknown placement backend {backend!r}",
            f"use one of {', '.join(PLACEMENT_BACKENDS)} (ray places stages on the nodes of a Ray cluster)",
        )  # fmt: skip
    address = raw.get("address")
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise config_error(
            source, "placement", "address", f"expected the Ray cluster's address, got {address!r}",
            "write 'auto' (the cluster this machine belongs to), 'host:6379' or 'ray://host:10001'",
        )  # fmt: skip
    edges_raw = raw.get("edges", {})
    if not isinstance(edges_raw, Mapping):
        raise config_error(
            source, "placement", "edges", "expected a mapping", "write e.g. 'edges: {\"1 -> 2\": nixl}'"
        )
    edges: dict[str, str] = {}
    for label, value in edges_raw.items():
        pair = _edge_label(label)
        if pair is None:
            raise config_error(
                source,
                "placement.edges",
                str(label),
                "an edge is written 'src -> dst'",
                'e.g. "1 -> 2": nixl',
            )
        if value not in _EDGE_BACKENDS:
            raise config_error(
                source, "placement.edges", str(label), f"unknown backend {value!r}",
                f"use one of {', '.join(_EDGE_BACKENDS)}",
            )  # fmt: skip
        edges[f"{pair[0]} -> {pair[1]}"] = value
    return PlacementConfig(backend=backend, address=address, edges=edges)


def parse_resources(source: str, where: str, raw: object) -> dict[str, float]:
    """A stage's ``resources:``: resource name -> a positive amount."""
    fix = "write e.g. 'resources: {hostB: 1}' (custom resources of the Ray node) or '{GPU: 1}'"
    if not isinstance(raw, Mapping):
        raise config_error(source, where, "resources", f"expected a mapping, got {type(raw).__name__}", fix)
    out: dict[str, float] = {}
    for name, amount in raw.items():
        if not isinstance(name, str) or not name:
            raise config_error(source, where, "resources", f"resource names are strings, got {name!r}", fix)
        ok = isinstance(amount, int | float) and not isinstance(amount, bool) and math.isfinite(amount)
        if not ok or amount <= 0:
            raise config_error(
                source, where, f"resources.{name}", f"expected an amount > 0, got {amount!r}", fix
            )
        out[name] = float(amount)
    return out


def check_placement(cfg: PipelineConfig) -> None:
    """Placement against the stages and edges (raises the first problem)."""
    placement, src = cfg.placement, cfg.source
    if not placement.is_ray:
        pinned = [s for s in cfg.stages if s.resources or any(s.replica_resources)]
        if pinned:
            raise config_error(
                src, pinned[0].label, "resources", "resources place a stage on a Ray node",
                "add 'placement: {backend: ray}' at the top level, or remove the key",
            )  # fmt: skip
        if placement.address is not None or placement.edges:
            raise config_error(
                src, "placement", "address" if placement.address is not None else "edges",
                "only a Ray placement has an address and edge overrides", "add 'backend: ray'",
            )  # fmt: skip
        return
    edges = {(d.id, s) for d in cfg.stages for s in d.input_sources}
    for label, backend in placement.edges.items():
        pair = _edge_label(label)
        assert pair is not None
        if (pair[1], pair[0]) not in edges:
            raise config_error(
                src, "placement.edges", label, "the pipeline has no such edge",
                "name an edge 'src -> dst' where dst reads src (omnirelay check lists them)",
            )  # fmt: skip
        a, b = stage_host(cfg.stages[pair[0]]), stage_host(cfg.stages[pair[1]])
        if backend == "shm" and (a is None or a != b):
            raise config_error(
                src, "placement.edges", label, "shm cannot cross hosts, and these stages are not pinned to one",
                "use nixl, or give both stages the same custom resource (e.g. resources: {hostA: 1})",
            )  # fmt: skip
    for d in cfg.stages:
        spec = cfg.connector_spec(cfg.input_connector(d))
        if d.input_sources and spec.backend == "inproc":
            raise config_error(
                src, d.label, "connector", "an inproc connector cannot link worker processes on Ray nodes",
                "use shm (resolved to nixl between hosts)",
            )  # fmt: skip


def describe(placement: PlacementConfig) -> dict[str, Any]:
    return {"backend": placement.backend, "address": placement.address, "edges": dict(placement.edges)}

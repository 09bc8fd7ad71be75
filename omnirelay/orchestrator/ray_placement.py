"""Stage workers on the nodes of a Ray cluster (``placement: {backend: ray}``).

Ray decides *where*; it is never on a request's path. For each stage the front

1. **places** it: a :class:`StageHost` actor with the stage's ``resources`` tells which
   node Ray chose, that node's address and a free TCP port there (the stage's nixl notice
   endpoint, when its input edge crosses hosts): :meth:`RayPlacement.place` returns the
   pipeline with ``placement.endpoints`` and ``placement.node_ips`` filled in;
2. **starts** its worker through that actor (a restarted worker through a new one pinned
   to the same node, ``NodeAffinitySchedulingStrategy``): the actor spawns :func:`worker_main` as its own
   child process, so the worker is the same process as on one machine (its signals, its
   exit code, its parent watch: it exits when the actor, or the node, goes) and the actor
   only reports. :class:`RayWorkerProcess` is what the supervisor holds instead of a
   ``multiprocessing`` process: ``pid``, ``sentinel`` (readable once the worker exited, or
   its actor or node was lost), ``exitcode``, ``terminate``/``kill``, ``join``, ``close``.

The control plane stays ZeroMQ, over TCP to the front's node address
(:class:`~omnirelay.worker.worker_control.ControlPaths` with ``tcp_host``). Like Ray's own ports,
those sockets trust the cluster's network: run across hosts on a private network.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
from typing import Any

import msgspec

from omnirelay.connectors.base import inbox_name
from omnirelay.errors import PipelineError
from omnirelay.pipeline import PipelineConfig
from omnirelay.pipeline.placement import edge_backend
from omnirelay.worker.spec import WorkerSpec

__all__ = ["RayPlacement", "RayWorkerProcess", "StageHost", "load_ray"]

#: how long placing a stage (starting its probe and host actors) may take, unless the
#: pipeline's start gives its own bound (``startup_timeout_s``)
_PLACE_TIMEOUT_S = 120.0


def load_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise PipelineError(
            "placement backend 'ray' needs Ray: pip install 'omnirelay[multihost]' (or 'ray>=2.40,<3')"
        ) from exc
    return ray


#: a host's concurrent calls: wait() blocks for the worker's life; signal() must still get through
_HOST_CONCURRENCY = 4


class StageHost:
    """The Ray actor a stage's worker runs under (one per worker incarnation)."""

    def __init__(self) -> None:
        self._proc: Any = None

    def where(self) -> dict[str, Any]:
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "free_port": port,
        }

    def start(self, spec: WorkerSpec) -> int:
        import multiprocessing

        from omnirelay.worker import worker_main

        spec = dataclasses.replace(spec, parent_pid=os.getpid())
        self._proc = multiprocessing.get_context("spawn").Process(
            target=worker_main, args=(spec,), name=f"omnirelay-s{spec.stage_id}", daemon=True
        )
        self._proc.start()
        return int(self._proc.pid)

    def wait(self) -> int | None:
        self._proc.join()
        return self._proc.exitcode

    def sweep(self, namespace: str) -> int:
        """Reclaim the objects of ``namespace`` whose owners died, on this node (a dead
        worker's shm slots and keys live where it ran); how many were removed."""
        from omnirelay.connectors import reclaim_namespace

        return len(reclaim_namespace(namespace).reclaimed)

    def signal(self, signum: int) -> None:
        if self._proc is not None and self._proc.pid is not None and self._proc.exitcode is None:
            try:
                os.kill(self._proc.pid, signum)
            except ProcessLookupError:
                pass


class RayWorkerProcess:
    """A stage worker under a :class:`StageHost` actor, as the supervisor sees a process."""

    def __init__(
        self,
        ray: Any,
        host_cls: Any,
        spec: WorkerSpec,
        node: dict[str, Any],
        resources: dict[str, float],
        actor: Any = None,
        timeout_s: float = _PLACE_TIMEOUT_S,
    ):
        """``actor``: a host already running on ``node`` (the placement's probe, for a
        worker's first incarnation); None: a new one pinned to the node. ``timeout_s``:
        how long the host may take to start the worker."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        self._timeout_s = timeout_s
        self.node = node
        if actor is None:
            actor = host_cls.options(
                num_cpus=0,
                resources=resources,
                max_concurrency=_HOST_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["node_id"], soft=False),
            ).remote()
        self._actor = actor
        self._spec = spec
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.lost: str | None = None  # why the actor (or node) went, when it did
        self._rfd, self._wfd = os.pipe()
        self.sentinel = self._rfd
        self._done = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        """Ask the actor to spawn the worker and return at once (the front's event loop
        must not wait for an actor to start); ``pid`` is known once the worker said hello."""
        start = self._actor.start.remote(self._spec)
        self._watch = threading.Thread(
            target=self._wait, args=(start,), name=f"ray-watch-w{self._spec.worker_index}", daemon=True
        )
        self._watch.start()

    def _wait(self, start: Any) -> None:
        try:
            self.pid = self._ray.get(start, timeout=self._timeout_s)
            self.exitcode = self._ray.get(self._actor.wait.remote())
        except Exception as exc:  # RayActorError: the actor's process or its node is gone
            self.lost = f"its Ray actor or node was lost ({type(exc).__name__})"
            self.exitcode = -signal.SIGKILL
        self._done.set()
        os.write(self._wfd, b"x")

    def is_alive(self) -> bool:
        return self._watch is not None and not self._done.is_set()

    def sweep_node(self, namespace: str) -> bool:
        """Sweep the worker's node (after its death, before its fences go): its host actor
        outlives it. False when the host cannot (its actor or node was lost)."""
        if self.lost is not None:
            return False
        try:
            self._ray.get(self._actor.sweep.remote(namespace), timeout=self._timeout_s)
        except Exception:  # RayActorError, GetTimeoutError: the node is not reachable
            return False
        return True

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def _signal(self, signum: int) -> None:
        if self._done.is_set():
            return
        if self.pid is None and signum == signal.SIGKILL:  # not spawned yet: take the actor
            self._ray.kill(self._actor, no_restart=True)
            return
        try:
            self._actor.signal.remote(signum)
        except Exception:
            self._ray.kill(self._actor, no_restart=True)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:
            pass
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._rfd = self._wfd = -1


class RayPlacement:
    """Connects to the cluster, places the stages and starts their workers."""

    def __init__(self, config: PipelineConfig, timeout_s: float = _PLACE_TIMEOUT_S) -> None:
        """``timeout_s``: how long placing the stages and starting a worker's host may
        take (the pipeline's startup bound: a loaded machine boots Ray workers slowly)."""
        self.config = config
        self.timeout_s = timeout_s
        self._ray = load_ray()
        self._host_cls: Any = None
        self._started_ray = False
        self.nodes: dict[int, dict[str, Any]] = {}
        self.front_ip: str | None = None
        #: each worker's probe, kept as the host of its first incarnation
        self._spare: dict[int, Any] = {}

    def connect(self) -> None:
        ray = self._ray
        if not ray.is_initialized():
            ray.init(
                address=self.config.placement.address or "auto",
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
            )
            self._started_ray = True
        self._host_cls = ray.remote(StageHost)
        self.front_ip = ray.util.get_node_ip_address()

    def place(self) -> PipelineConfig:
        """Probe where each worker runs (each replica of a replicated stage with its own
        resources); the pipeline with endpoints and node addresses filled in, both keyed
        by the worker's inbox (:func:`~omnirelay.connectors.inbox_name`)."""
        ray, cfg = self._ray, self.config
        workers = cfg.workers()
        # Each probe stays on as its worker's first host: a Ray worker process boots once
        # per worker, not once to probe and again to host.
        probes = [
            self._host_cls.options(
                num_cpus=0,
                resources=cfg.stages[w.stage_id].replica_resources_of(w.replica),
                max_concurrency=_HOST_CONCURRENCY,
            ).remote()
            for w in workers
        ]
        try:
            found = ray.get([p.where.remote() for p in probes], timeout=self.timeout_s)
        except Exception as exc:
            for p in probes:
                ray.kill(p, no_restart=True)
            wanted = {
                cfg.stages[w.stage_id].replica_label(w.replica): cfg.stages[w.stage_id].replica_resources_of(
                    w.replica
                )
                for w in workers
            }
            raise PipelineError(
                f"Ray could not place the stages within {self.timeout_s:g} s (does a node offer each "
                f"worker's resources at once? {wanted}): {exc!r}"
            ) from exc
        self._spare = {w.index: p for w, p in zip(workers, probes)}
        self.nodes = {
            w.index: {**node, "stage": w.stage_id, "replica": w.replica} for w, node in zip(workers, found)
        }
        endpoints: dict[str, str] = {}
        node_ips: dict[str, str] = {}
        for w in workers:
            d, node = cfg.stages[w.stage_id], self.nodes[w.index]
            inbox = inbox_name(w.stage_id, w.replica)
            node_ips[inbox] = node["node_ip"]
            spec = cfg.connector_spec(cfg.input_connector(d))
            if any(edge_backend(cfg, src, d.id, spec.backend) == "nixl" for src in d.input_sources):
                endpoints[inbox] = f"tcp://{node['node_ip']}:{node['free_port']}"
        placement = msgspec.structs.replace(cfg.placement, endpoints=endpoints, node_ips=node_ips)
        self.config = cfg.with_placement(placement)
        return self.config

    def process(self, worker: int, spec: WorkerSpec) -> RayWorkerProcess:
        node = self.nodes[worker]
        stage = self.config.stages[node["stage"]]
        return RayWorkerProcess(
            self._ray,
            self._host_cls,
            spec,
            node,
            stage.replica_resources_of(node["replica"]),
            actor=self._spare.pop(worker, None),
            timeout_s=self.timeout_s,
        )

    def describe(self) -> dict[int, dict[str, Any]]:
        """Where each worker runs, by worker index: node id, address, host name, and its
        stage and replica (for reports)."""
        keys = ("node_id", "node_ip", "hostname", "stage", "replica")
        return {i: {k: n[k] for k in keys} for i, n in self.nodes.items()}

    def close(self) -> None:
        for actor in self._spare.values():  # probes no worker took (a start that failed)
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self._spare.clear()
        if self._started_ray and self._ray.is_initialized():
            self._ray.shutdown()

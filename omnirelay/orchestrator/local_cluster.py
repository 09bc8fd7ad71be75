"""A Ray cluster of simulated hosts on this machine: ``omnirelay run --local-cluster``.

:func:`local_cluster` starts a head node and further nodes with Ray's
``ray.cluster_utils.Cluster``, one per custom resource (default ``hostA`` and ``hostB``),
on this machine's address, with no dashboard and one CPU each (stage workers ask for no
CPUs: Ray places them, it does not ration them). UCX is forced onto TCP (``UCX_TLS=tcp``,
inherited by every node's processes) so that an edge between the simulated hosts takes
the path real hosts take: NIXL's READ over the network stack, not shared memory. The
cluster is shut down on exit, every raylet and GCS process with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omnirelay.orchestrator.ray_placement import load_ray

__all__ = ["LocalCluster", "local_cluster"]

#: units of each host's resource: a stage asks for one (``resources: {hostA: 1}``) and
#: several stages share a host
_UNITS = 16


class LocalCluster(str):
    """The cluster's address (for ``placement.address``; a ``str``), and its simulated hosts."""

    hosts: dict[str, Any]

    def remove_host(self, host: str) -> None:
        """Take a simulated host down as a crash would (its raylet and every process on it)."""
        self._cluster.remove_node(self.hosts.pop(host))

    _cluster: Any


@contextmanager
def local_cluster(
    hosts: tuple[str, ...] = ("hostA", "hostB"), *, num_cpus: int = 1
) -> Iterator[LocalCluster]:
    """Start the cluster; yields its address (a :class:`LocalCluster`)."""
    ray = load_ray()
    from ray.cluster_utils import Cluster

    saved = {name: os.environ.get(name) for name in ("UCX_TLS", "RAY_USAGE_STATS_ENABLED")}
    os.environ["UCX_TLS"] = "tcp"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        with _cluster(ray, Cluster, hosts, num_cpus) as address:
            yield address
    finally:  # the caller's environment as it was
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _cluster(ray: Any, cluster_cls: Any, hosts: tuple[str, ...], num_cpus: int) -> Iterator[LocalCluster]:
    cluster = cluster_cls(
        initialize_head=True,
        head_node_args={"num_cpus": num_cpus, "resources": {hosts[0]: _UNITS}, "include_dashboard": False},
    )
    try:
        nodes = {hosts[0]: cluster.head_node}
        for host in hosts[1:]:
            nodes[host] = cluster.add_node(num_cpus=num_cpus, resources={host: _UNITS})
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        cluster.wait_for_nodes()
        handle = LocalCluster(cluster.address)
        handle.hosts, handle._cluster = nodes, cluster
        yield handle
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()

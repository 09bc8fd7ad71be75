"""A dead worker's fences are lifted only once its objects are swept where it ran: on the
front's host, and on its Ray node through its host actor (a node no host could sweep: at
the restarted worker's hello, its connector having swept the node as it started)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omnirelay.orchestrator import supervisor as supervisor_module
from omnirelay.orchestrator.ray_placement import RayWorkerProcess
from omnirelay.orchestrator.stage_processes import StageProcess
from omnirelay.orchestrator.supervisor import StageSupervisor, SupervisorHooks
from omnirelay.pipeline.restart import RestartPolicy


class NodeProcess:
    """A Ray-placed worker's process as the supervisor holds it; its host's sweep logs."""

    def __init__(self, log: list[tuple[str, Any]], *, reachable: bool) -> None:
        self.log, self.reachable = log, reachable

    def sweep_node(self, namespace: str) -> bool:
        self.log.append(("node", namespace))
        return self.reachable


def make_supervisor(
    monkeypatch: pytest.MonkeyPatch, log: list[tuple[str, Any]], process: Any
) -> tuple[StageSupervisor, StageProcess]:
    monkeypatch.setattr(supervisor_module, "reclaim_namespace", lambda ns: log.append(("front", ns)))
    monkeypatch.setattr(supervisor_module, "worker_context", lambda preload: None)
    hooks = SupervisorHooks(
        stage_down=lambda *a: None,
        stage_unavailable=lambda *a: None,
        stage_up=lambda w: None,
        route=lambda w, m: None,
        swept=lambda w: log.append(("swept", w)),
    )
    dead = StageProcess(stage_id=1, label="stage 1", name="s1", process=process)
    supervisor = StageSupervisor(
        namespace="ns",
        stages=[StageProcess(stage_id=0, label="stage 0", name="s0"), dead],
        make_spec=lambda i, paths: None,  # type: ignore[arg-type,return-value]
        policy=RestartPolicy(),
        startup_timeout_s=1.0,
        hooks=hooks,
    )
    return supervisor, dead


def test_the_dead_workers_node_is_swept_by_its_host_before_its_fences_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[tuple[str, Any]] = []
    supervisor, dead = make_supervisor(monkeypatch, log, NodeProcess(log, reachable=True))
    asyncio.run(supervisor._sweep([dead], restarting=True))
    assert log == [("front", "ns"), ("node", "ns"), ("swept", 1)]


def test_a_local_worker_is_swept_on_the_front_host_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[tuple[str, Any]] = []
    supervisor, dead = make_supervisor(monkeypatch, log, object())
    asyncio.run(supervisor._sweep([dead], restarting=True))
    assert log == [("front", "ns"), ("swept", 1)]


def test_a_node_no_host_could_sweep_keeps_the_fences_until_the_restarted_workers_hello(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[tuple[str, Any]] = []
    supervisor, dead = make_supervisor(monkeypatch, log, NodeProcess(log, reachable=False))
    asyncio.run(supervisor._sweep([dead], restarting=True))
    assert log == [("front", "ns"), ("node", "ns")]  # fenced: the node still holds its objects
    supervisor.on_hello(supervisor.stages[0])  # another worker's hello lifts nothing
    assert log[-1] == ("node", "ns")
    supervisor.on_hello(dead)  # its connector swept the node before the hello
    supervisor.on_hello(dead)  # once
    assert log == [("front", "ns"), ("node", "ns"), ("swept", 1)]


def test_a_worker_given_up_on_has_its_fences_lifted_even_when_its_node_was_not_swept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[tuple[str, Any]] = []
    supervisor, dead = make_supervisor(monkeypatch, log, NodeProcess(log, reachable=False))
    asyncio.run(supervisor._recover([dead], None))  # no restart: nothing else would lift them
    assert log == [("front", "ns"), ("node", "ns"), ("swept", 1)]


class FakeRay:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.timeouts: list[float] = []

    def get(self, ref: Any, timeout: float) -> Any:
        self.timeouts.append(timeout)
        if self.fail:
            raise RuntimeError("RayActorError")
        return ref


class FakeActor:
    class _Method:
        def __init__(self, calls: list[str]) -> None:
            self.calls = calls

        def remote(self, namespace: str) -> int:
            self.calls.append(namespace)
            return 3

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sweep = self._Method(self.calls)


@pytest.mark.parametrize(
    ("fail", "lost", "swept", "asked"),
    [(False, None, True, ["ns"]), (True, None, False, ["ns"]), (False, "lost", False, [])],
)
def test_a_ray_workers_host_sweeps_its_node_unless_it_is_gone(
    fail: bool, lost: str | None, swept: bool, asked: list[str]
) -> None:
    pytest.importorskip("ray")
    actor, ray = FakeActor(), FakeRay(fail)
    node = {"node_id": "n" * 16, "node_ip": "10.0.0.2"}
    process = RayWorkerProcess(ray, None, None, node, {}, actor=actor, timeout_s=7.0)  # type: ignore[arg-type]
    process.lost = lost
    try:
        assert process.sweep_node("ns") is swept
        assert actor.calls == asked and ray.timeouts == [7.0] * len(asked)
    finally:
        process.close()

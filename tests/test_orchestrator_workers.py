"""The front's worker table and its board of stages down, pure: no process, no loop."""

from __future__ import annotations

import pytest

from omnirelay.errors import StageDiedError
from omnirelay.models.testing.toy import toy_pipeline_config
from omnirelay.orchestrator.stage_processes import StagesDown, StageState, WorkerLaunch, WorkerTable
from omnirelay.worker.worker_control import ControlPaths


def table() -> WorkerTable:
    """The toy pipeline with two replicas of its relay (stage 1): workers 0, 1, 2, 3."""
    return WorkerTable(toy_pipeline_config(backend="shm", replicas={1: 2}))


def test_the_table_maps_each_replica_of_each_stage_to_its_worker() -> None:
    t = table()
    assert len(t) == 4 and [w.index for w in t] == [0, 1, 2, 3]
    assert [(w.stage_id, w.replica) for w in t] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert t.serving(1, 1) is t[2] and t.serving(2, 0).index == 3
    assert [w.index for w in t.replicas(1)] == [1, 2]
    assert [w.process_name for w in t] == ["s0", "s1", "s1r1", "s2"]
    assert t.pids() == {0: None, 1: None, 2: None}
    assert set(t.replica_pids()) == {(0, 0), (1, 0), (1, 1), (2, 0)}
    assert t.exitcodes() == {0: None, 1: None, 2: None, 3: None}
    placement = t.local_placement()
    assert placement[2]["stage"] == 1 and placement[2]["replica"] == 1


def test_a_stage_is_ready_once_its_last_replica_said_hello() -> None:
    t = table()
    assert [t.ready_at_start(w) for w in (0, 1, 3, 2)] == [True, False, True, True]
    assert not t.is_ready()  # starting, all of them
    t.mark_started()
    assert t.is_ready() and all(w.state == StageState.HEALTHY for w in t)


def test_others_up_and_readiness_with_a_replica_down() -> None:
    t = table()
    t.mark_started()
    t[1].is_dead, t[1].state = True, StageState.RESTARTING
    assert t.others_up(t[1]) and not t.others_up(t[0])
    assert not t.is_ready()  # a replica is coming back
    t[1].state, t[1].death_reason = StageState.FAILED, "given up"
    assert t.is_ready()  # failed beside a healthy replica: the stage is served
    t[2].is_dead, t[2].state = True, StageState.FAILED
    with pytest.raises(StageDiedError, match="given up"):
        t.is_ready()  # every replica given up on


def test_a_stage_turned_off_is_dead_and_left_out_of_readiness() -> None:
    t = table()
    t.turn_off(2, "not started")
    assert (t[3].is_off, t[3].is_dead, t[3].state, t[3].death_reason) == (
        True,
        True,
        StageState.OFF,
        "not started",
    )
    t.mark_started()
    assert t[3].state == StageState.OFF and t.is_ready()


def test_a_workers_spec_is_its_replicas_view_of_the_pipeline() -> None:
    config = toy_pipeline_config(backend="shm", replicas={1: 2})
    t = WorkerTable(config)
    paths = ControlPaths.create(len(t))
    try:
        spec = WorkerLaunch(idle_wait_s=0.5).spec(config, t[2], paths)
    finally:
        paths.remove()
    assert (spec.stage_id, spec.worker, spec.idle_wait_s) == (1, 2, 0.5)
    assert spec.pipeline.stages[1].replica == 1


def test_stages_down_say_which_and_when_each_is_back() -> None:
    now = [100.0]
    down = StagesDown(clock=lambda: now[0])
    assert down.first(range(3)) is None
    down.mark_down(1, "restarting", 4.0)
    down.mark_down(2, "off", None)
    now[0] = 101.0
    assert down.first(range(3)) == (1, "restarting", 3.0)
    assert down.first([2]) == (2, "off", None)
    now[0] = 200.0
    assert down.first([1]) == (1, "restarting", 0.0)  # late: never a negative wait
    down.mark_up(1)
    down.mark_up(1)  # idempotent
    assert down.first([0, 1]) is None

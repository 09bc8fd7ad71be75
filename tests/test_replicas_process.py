"""Stage replicas with real worker processes (docs/design.md §11).

A pipeline whose Talker and Code2Wav run two worker processes each: requests spread over
the replicas, each request's chunks go exactly between the replicas it is bound to, and
the leak audit holds per replica. When a replica is SIGKILLed, a request that the client
had nothing of runs again on the other replica (same id, delivered once, exact), one that
was already playing fails fast with ``stage_unavailable``, new requests avoid the dead
replica, and it serves again once restarted.

The scripted engine of :mod:`tests.orchestrator_fakes` holds stage 0 while a file exists
(``stall_while``), so a request is bound and waiting for sure when its replica is killed;
every wait is for an output, an error or a state, never a nap.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.api import Pipeline, RestartPolicy, RuntimeHooks
from omnirelay.errors import InvalidRequestError, StageUnavailableError
from omnirelay.pipeline import parse_pipeline
from tests.orchestrator_audit import audit_running, audit_stopped
from tests.orchestrator_fakes import expected_audio, expected_text_tokens
from tests.test_orchestrator_process import FACTORY, fake_config_data, sampling

FAST = RestartPolicy(max_restarts=10, window_s=300, backoff_s=0.05, max_backoff_s=0.2)


def replicated(talkers: int = 2, vocoders: int = 2) -> Any:
    data = fake_config_data()
    data["stages"][1]["replicas"] = talkers
    data["stages"][2]["replicas"] = vocoders
    return parse_pipeline(data)


@pytest.fixture
def pipe() -> Iterator[Pipeline]:
    p = Pipeline.start(replicated(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=FAST)
    yield p
    audit_stopped(p)


def replica_loads(pipe: Pipeline, stage_id: int) -> list[int]:
    """Requests each replica of the stage holds, by the front's books."""
    stages = sorted((s for s in pipe.health().stages if s.stage_id == stage_id), key=lambda s: s.replica)
    return [s.num_requests for s in stages]


def wait_for(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_requests_spread_over_the_replicas_and_come_back_exact(pipe: Pipeline) -> None:
    health = pipe.health()
    assert [(s.stage_id, s.replica, s.replicas) for s in health.stages] == [
        (0, 0, 1),
        (1, 0, 2),
        (1, 1, 2),
        (2, 0, 2),
        (2, 1, 2),
    ]
    assert len({s.pid for s in health.stages}) == 5 and health.status == "healthy"
    handles = {
        i: pipe.submit([i], modalities=["text", "audio"], sampling=sampling(5), request_id=f"spread-{i}")
        for i in range(1, 9)
    }
    for i, h in handles.items():
        res = h.result(timeout=60)
        assert res.token_ids("text") == expected_text_tokens([i], 5)
        assert res.audio is not None and torch.equal(res.audio, expected_audio([i], 5))
    given = {(s.stage_id, s.replica): (s.engine or {}).get("num_added", 0) for s in pipe.health().stages}
    for stage_id in (1, 2):
        assert given[(stage_id, 0)] > 0 and given[(stage_id, 1)] > 0, given
        assert given[(stage_id, 0)] + given[(stage_id, 1)] == 8
    audit_running(pipe)


def test_a_killed_replica_reruns_what_the_client_had_nothing_of_and_fails_what_played(
    pipe: Pipeline, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    # One session: both requests go to one Talker replica (affinity), the quiet one held
    # in stage 0 before it produced anything, the other already playing.
    quiet = pipe.submit(
        [3],
        modalities=["audio"],
        sampling=sampling(4),
        request_id="quiet",
        extras={"stall_while": str(hold)},
        session="conv",
    )
    playing = pipe.submit(
        [5],
        modalities=["text", "audio"],
        sampling=sampling(50),
        request_id="playing",
        extras={"stall_after": 2},
        session="conv",
    )
    next(o for o in playing if o.modality == "audio")
    loads = replica_loads(pipe, 1)
    assert sorted(loads) == [0, 2], loads
    victim = loads.index(2)
    pid = pipe.replica_pids()[(1, victim)]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(StageUnavailableError) as info:
        playing.result(timeout=5.0)
    assert f"stage 1 (talker) replica {victim}" in info.value.reason and "SIGKILL" in info.value.reason
    # The quiet request runs again on the other replica, under its id, still held.
    wait_for(lambda: replica_loads(pipe, 1)[1 - victim] == 1, "the quiet request moved")
    health = pipe.health()
    assert health.status in ("degraded", "healthy") and health.is_serving
    # New requests avoid the dead replica while it restarts.
    res = pipe.submit([9], modalities=["audio"], sampling=sampling(3), request_id="new").result(timeout=30)
    assert res.audio is not None and torch.equal(res.audio, expected_audio([9], 3))
    hold.unlink()
    res = quiet.result(timeout=30)
    assert res.audio is not None and torch.equal(res.audio, expected_audio([3], 4))  # once, exact
    assert [o.finished for o in res.outputs].count(True) == 1
    pipe.wait_ready(60)
    st = next(s for s in pipe.health().stages if s.stage_id == 1 and s.replica == victim)
    assert st.state == "healthy" and st.num_restarts == 1 and st.pid != pid
    # The restarted replica takes requests again.
    for i in range(4):
        pipe.submit([i], modalities=["audio"], sampling=sampling(2), request_id=f"after-{i}").result(30)
    given = {s.replica: (s.engine or {}).get("num_added", 0) for s in pipe.health().stages if s.stage_id == 1}
    assert given[victim] > 0, given
    audit_running(pipe)


def test_a_buffered_request_that_lost_its_replica_mid_answer_runs_again_and_comes_back_whole(
    pipe: Pipeline, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    # Two whole-answer requests of one session (one Code2Wav replica), each held after two
    # tokens: their consumers got text and audio of the first attempt when it is killed.
    # One is submitted buffered and iterated, the other is the API's whole-answer call.
    knobs = {"stall_while": str(hold), "stall_while_after": 2}
    args: dict[str, Any] = {"modalities": ["text", "audio"], "sampling": sampling(6), "extras": knobs}
    with pytest.raises(InvalidRequestError, match="generate\\(\\) takes no buffered"):
        pipe.generate([11], buffered=False, **args)
    iterated = pipe.submit([7], request_id="iterated", session="conv", buffered=True, **args)
    calls = concurrent.futures.ThreadPoolExecutor(1)
    whole = calls.submit(pipe.generate, [11], request_id="whole", session="conv", timeout_s=60, **args)
    first = []
    for o in iterated:
        first.append(o)
        if o.modality == "audio":
            break
    assert first and not any(o.restarted for o in first)
    wait_for(lambda: sorted(replica_loads(pipe, 2)) == [0, 2], "both requests on one Code2Wav replica")
    victim = replica_loads(pipe, 2).index(2)
    pid = pipe.replica_pids()[(2, victim)]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: replica_loads(pipe, 2)[1 - victim] == 2, "both requests moved")
    hold.unlink()
    rest = list(iterated)
    # What the failed attempt left unread was dropped; the restart comes first, then the
    # whole answer of the rerun, once.
    assert rest[0].restarted and not any(o.restarted for o in rest[1:])
    again = rest[1:]
    assert [t for o in again if o.modality == "text" for t in o.token_ids] == expected_text_tokens([7], 6)
    audio = torch.cat([o.audio for o in again if o.modality == "audio" and o.audio is not None])
    assert torch.equal(audio, expected_audio([7], 6))
    assert [o.finished for o in again].count(True) == 1
    res = whole.result(timeout=60)  # the API's whole-answer call keeps only the rerun's
    calls.shutdown()
    assert res.token_ids("text") == expected_text_tokens([11], 6)
    assert res.audio is not None and torch.equal(res.audio, expected_audio([11], 6))
    assert pipe.health().num_reruns == 2
    pipe.wait_ready(60)
    audit_running(pipe)


def test_with_every_replica_of_a_stage_down_requests_that_need_it_are_refused() -> None:
    p = Pipeline.start(
        replicated(talkers=2, vocoders=1),
        runtime=RuntimeHooks(engine_factory=FACTORY),
        restart=RestartPolicy(max_restarts=0),
    )
    try:
        for replica in (0, 1):
            pid = p.replica_pids()[(1, replica)]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: p.health().status == "failed", "the Talker given up on")
        with pytest.raises(StageUnavailableError):
            p.submit([1], modalities=["audio"], sampling=sampling(2))
        text = p.submit([4], modalities=["text"], sampling=sampling(3)).result(timeout=30)
        assert text.token_ids() == expected_text_tokens([4], 3)
        assert not p.health().is_serving
    finally:
        audit_stopped(p, expect_reclaimed=True)

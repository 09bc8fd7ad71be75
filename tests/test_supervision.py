"""Stage supervision with real worker processes (docs/design.md §10): a SIGKILLed stage
fails its in-flight requests at once with ``stage_unavailable``, its objects are
reclaimed everywhere, it is restarted with backoff, and serving resumes; the policy gives
up after its budget and says why.

The scripted engine of :mod:`tests.orchestrator_fakes` stalls stage 0 after a few tokens,
so a request is mid-stream for sure when its stage is killed; a held engine build
(:mod:`tests.supervision_fakes`) keeps a restarted stage ``starting`` for as long as a
test needs. No sleeps: every wait is for an output, an error or a state. Each test ends
with the leak audit: no request state in any stage, no transfer object, and after
shutdown nothing under /dev/shm and no process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omnirelay.api import NO_RESTARTS, Pipeline, RestartPolicy, RuntimeHooks
from omnirelay.errors import (
    ConfigError,
    PipelineConfigError,
    RequestFailedError,
    StageDiedError,
    StageUnavailableError,
)
from omnirelay.orchestrator import RequestHandle
from omnirelay.orchestrator.supervisor import RestartBook
from omnirelay.pipeline import parse_pipeline
from tests.orchestrator_audit import audit_running, audit_stopped
from tests.orchestrator_fakes import expected_audio, expected_text_tokens
from tests.supervision_fakes import HOLD_ENV, kill_stage
from tests.test_orchestrator_process import FACTORY, fake_config, fake_config_data, sampling

FAST = RestartPolicy(max_restarts=10, window_s=300, backoff_s=0.05, max_backoff_s=0.2)
HELD_FACTORY = "tests.supervision_fakes:build_held_engine"


@pytest.fixture
def pipe() -> Iterator[Pipeline]:
    p = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=FAST)
    yield p
    audit_stopped(p)


def streaming(pipe: Pipeline, n: int, prefix: str) -> list[RequestHandle]:
    """``n`` text+audio requests, each mid-stream (its first audio came back) and held
    there by a stalled stage 0."""
    handles = [
        pipe.submit(
            [i],
            modalities=["text", "audio"],
            sampling=sampling(50),
            extras={"stall_after": 2},
            request_id=f"{prefix}-{i}",
        )
        for i in range(1, n + 1)
    ]
    for h in handles:
        next(o for o in h if o.modality == "audio")
    return handles


def kill_mid_stream(pipe: Pipeline, stage_id: int, prefix: str, n: int = 3) -> float:
    """SIGKILL the stage under ``n`` streaming requests; each must end with
    ``stage_unavailable`` naming the stage and the signal. Returns the seconds from the
    kill to the last failure."""
    handles = streaming(pipe, n, prefix)
    t0 = time.monotonic()
    kill_stage(pipe, stage_id)
    for h in handles:
        with pytest.raises(StageUnavailableError) as info:
            h.result(timeout=2.0)
        assert f"stage {stage_id} (" in info.value.reason and "killed by SIGKILL" in info.value.reason
    return time.monotonic() - t0


def wait_state(pipe: Pipeline, stage_id: int, state: str, timeout_s: float = 30.0) -> None:
    """Until the stage is in ``state`` (a condition polled, not a nap)."""
    deadline = time.monotonic() + timeout_s
    while pipe.health().stages[stage_id].state != state:
        assert time.monotonic() < deadline, f"stage {stage_id} never became {state}"
        time.sleep(0.01)


def check_serves(pipe: Pipeline, request_id: str, prompt: list[int]) -> None:
    res = pipe.submit(
        prompt, modalities=["text", "audio"], sampling=sampling(4), request_id=request_id
    ).result(30)
    assert res.token_ids() == expected_text_tokens(prompt, 4)
    assert res.audio is not None and torch.equal(res.audio, expected_audio(prompt, 4))


def test_sigkill_of_each_stage_mid_stream_fails_fast_restarts_and_serves_again(pipe: Pipeline) -> None:
    for stage_id in (0, 1, 2):
        old_pid = pipe.pids()[stage_id]
        took = kill_mid_stream(pipe, stage_id, prefix=f"k{stage_id}")
        assert took < 2.0
        pipe.wait_ready(60)
        health = pipe.health()
        st = health.stages[stage_id]
        assert health.is_healthy and health.status == "healthy"
        assert st.state == "healthy" and st.num_restarts == 1 and st.last_exit == "killed by SIGKILL"
        assert st.pid != old_pid and st.is_alive
        # a failed request's id is reused at once by a new request: it gets its own outputs
        check_serves(pipe, f"k{stage_id}-1", [7])
        audit_running(pipe)
    assert [s.num_restarts for s in pipe.health().stages] == [1, 1, 1]


def test_requests_that_do_not_need_the_dead_stage_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, str(hold))
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=HELD_FACTORY), restart=FAST)
    try:
        hold.touch()  # the restarted Talker will stay in its engine build
        kill_mid_stream(pipe, 1, prefix="held")
        # At once, before anything else reaches the front: a client that resubmits as soon
        # as its request failed already hears that the stage is restarting.
        for i in range(5):  # new requests that need it: refused at once, with a time to retry
            with pytest.raises(StageUnavailableError) as info:
                pipe.submit([i], modalities=["text", "audio"], sampling=sampling(3))
            assert info.value.retry_after_s is not None and info.value.retry_after_s >= 0
            assert "stage 1 (talker) is restarting" in info.value.reason
        health = pipe.health()
        assert health.status == "restarting" and health.stages[1].state in ("restarting", "starting")
        assert not health.is_healthy and "restarting" in (health.stages[1].error or "")
        # a text-only request needs only the Thinker: served while the Talker restarts
        res = pipe.submit([4], modalities=["text"], sampling=sampling(3), request_id="held-1").result(10)
        assert res.token_ids() == expected_text_tokens([4], 3)
        hold.unlink()
        pipe.wait_ready(60)
        check_serves(pipe, "held-2", [9])
        audit_running(pipe)
    finally:
        hold.unlink(missing_ok=True)
        audit_stopped(pipe)


def test_gives_up_after_max_restarts_in_the_window_and_health_says_why() -> None:
    policy = RestartPolicy(max_restarts=1, window_s=600, backoff_s=0.0, max_backoff_s=0.0)
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=policy)
    try:
        kill_mid_stream(pipe, 0, prefix="a", n=1)
        pipe.wait_ready(60)
        # The budget is the pipeline's: after the Thinker's restart, the Talker's death is one too many.
        kill_mid_stream(pipe, 1, prefix="b", n=1)
        with pytest.raises(StageDiedError, match=r"killed by SIGKILL.*restarted 1 times within 600 s"):
            pipe.wait_ready(60)
        health = pipe.health()
        st = health.stages[1]
        assert health.status == "failed" and not health.is_healthy
        assert st.state == "failed" and st.num_restarts == 0 and st.last_exit == "killed by SIGKILL"
        assert health.stages[0].state == "healthy" and health.stages[0].num_restarts == 1
        assert "stage 1 (talker)" in (st.error or "") and "not restarted" in (st.error or "")
        with pytest.raises(StageUnavailableError) as info:
            pipe.submit([4], modalities=["text", "audio"], sampling=sampling(3))
        assert info.value.retry_after_s is None  # it is not coming back
        res = pipe.submit([4], modalities=["text"], sampling=sampling(3)).result(10)
        assert res.token_ids() == expected_text_tokens([4], 3)
        audit_running(pipe)
    finally:
        audit_stopped(pipe)


def test_restarts_off_fail_fast_and_the_stage_stays_failed() -> None:
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=NO_RESTARTS)
    try:
        kill_mid_stream(pipe, 2, prefix="off", n=2)
        with pytest.raises(StageDiedError, match=r"restarts are off"):
            pipe.wait_ready(10)
        st = pipe.health().stages[2]
        assert st.state == "failed" and st.num_restarts == 0 and st.exitcode == -9
    finally:
        report = pipe.shutdown()
    assert report.exitcodes[2] == -9 and report.num_objects_left == 0


def test_a_stage_that_dies_while_restarting_is_restarted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, str(hold))
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=HELD_FACTORY), restart=FAST)
    try:
        hold.touch()
        kill_mid_stream(pipe, 0, prefix="twice", n=1)
        # the new Thinker is held in its build: kill it there too
        wait_state(pipe, 0, "starting")
        kill_stage(pipe, 0)
        hold.unlink()
        pipe.wait_ready(60)
        assert pipe.health().stages[0].num_restarts == 2
        check_serves(pipe, "twice-1", [3])
        audit_running(pipe)
    finally:
        hold.unlink(missing_ok=True)
        audit_stopped(pipe)


def test_a_failed_request_is_a_request_failed_error_with_the_code() -> None:
    err = StageUnavailableError("r", "stage 1 (talker) is restarting", retry_after_s=1.5)
    assert isinstance(err, RequestFailedError) and err.code == "stage_unavailable"
    assert err.retry_after_s == 1.5 and "restarting" in str(err)


# ------------------------------------------------------------------ the policy (pure)


def test_the_restart_book_backs_off_exponentially_and_gives_up_within_the_window() -> None:
    book = RestartBook(RestartPolicy(max_restarts=3, window_s=10, backoff_s=0.5, max_backoff_s=1.5))
    assert [book.next_delay(1, t) for t in (0.0, 1.0)] == [0.5, 1.0]
    assert book.next_delay(2, 2.0) == 0.5  # its own backoff: its first restart …
    assert book.next_delay(1, 3.0) is None  # … but the pipeline's 4th within 10 s: give up
    assert book.next_delay(2, 3.0) is None  # whichever stage dies
    assert book.num_recent() == 3 and book.num_recent(1) == 2
    assert book.next_delay(1, 10.5) == 1.0  # the restart at 0.0 left the window (the one at 1.0 did not)
    assert RestartBook(NO_RESTARTS).next_delay(0, 0.0) is None


@pytest.mark.parametrize(
    ("restart", "key", "words"),
    [
        ({"max_restarts": -1}, "restart.max_restarts", "must be an int >= 0"),
        ({"max_restarts": 2.5}, "restart.max_restarts", "expected an int"),
        ({"window_s": 0}, "restart.window_s", "must be > 0"),
        ({"backoff_s": -1}, "restart.backoff_s", "must be >= 0"),
        ({"backoff_s": 5, "max_backoff_s": 1}, "restart.max_backoff_s", "must be >= backoff_s"),
        ({"backoff_s": "1s"}, "restart.backoff_s", "expected a number"),
        ({"max_restart": 3}, "restart.max_restart", "did you mean 'max_restarts'"),
        ([5], "restart", "expected a mapping"),
    ],
)
def test_a_bad_restart_policy_is_refused_naming_the_key(restart: object, key: str, words: str) -> None:
    data = {**fake_config_data(), "restart": restart}
    with pytest.raises(PipelineConfigError) as info:
        parse_pipeline(data)
    assert f"key '{key}'" in str(info.value) and words in str(info.value)


def test_the_restart_policy_loads_from_the_file() -> None:
    cfg = parse_pipeline({**fake_config_data(), "restart": {"max_restarts": 2, "backoff_s": 1}})
    assert cfg.restart == RestartPolicy(max_restarts=2, window_s=300, backoff_s=1.0, max_backoff_s=10)
    assert parse_pipeline(fake_config_data()).restart == RestartPolicy()
    with pytest.raises(ConfigError, match="window_s must be > 0"):
        RestartPolicy(window_s=-1)


def test_serve_max_restarts_overrides_the_file_and_is_checked() -> None:
    from omnirelay.cli.main import main
    from omnirelay.cli.serve import with_max_restarts

    cfg = parse_pipeline({**fake_config_data(), "restart": {"max_restarts": 2, "window_s": 60}})
    assert with_max_restarts(cfg, 0).restart == RestartPolicy(max_restarts=0, window_s=60)
    with pytest.raises(ConfigError, match=r"--max-restarts -1: .*max_restarts must be an int >= 0"):
        with_max_restarts(cfg, -1)
    assert main(["serve", "--pipeline", "toy-3stage", "--max-restarts", "-1"]) == 1  # before any model work


def test_a_restart_that_cannot_start_a_process_leaves_the_stage_failed_with_the_reason() -> None:
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=FAST)
    try:
        control = pipe._orch._supervisor.control
        assert control is not None

        def no_sockets(stage_id: int) -> Any:
            raise OSError(24, "Too many open files")

        control.rebind = no_sockets  # type: ignore[method-assign]
        kill_mid_stream(pipe, 1, prefix="nofd", n=1)
        with pytest.raises(
            StageDiedError, match=r"stage 1 \(talker\) could not be restarted.*Too many open files"
        ):
            pipe.wait_ready(30)
        st = pipe.health().stages[1]
        assert st.state == "failed" and st.num_restarts == 0
        with pytest.raises(StageUnavailableError):
            pipe.submit([1], modalities=["text", "audio"], sampling=sampling(2))
    finally:
        report = pipe.shutdown()
    assert report.num_objects_left == 0


def test_run_starts_its_pipeline_without_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A one-shot run cannot resume its request on a restarted stage: it fails fast.
    import io

    from omnirelay.cli import session

    seen: dict[str, Any] = {}

    def fake_start(config: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return "pipe"

    monkeypatch.setattr(Pipeline, "start", fake_start)
    pipe, _ = session.start_pipeline(fake_config(), stream=io.StringIO())
    assert pipe == "pipe" and seen["restart"] == NO_RESTARTS


def test_pipeline_health_status_says_failed_before_restarting_before_unhealthy() -> None:
    from omnirelay.orchestrator import PipelineHealth, StageHealth

    def health(*states: str, error: str | None = None) -> PipelineHealth:
        stages = [
            StageHealth(stage_id=i, name=f"s{i}", is_alive=s == "healthy", pid=1, state=s, error=error)
            for i, s in enumerate(states)
        ]
        return PipelineHealth(
            is_healthy=all(s == "healthy" for s in states) and error is None,
            namespace="n",
            num_requests=0,
            stages=stages,
        )

    assert health("healthy", "healthy").status == "healthy"
    assert health("healthy", "starting").status == "restarting"
    assert health("restarting", "failed").status == "failed"
    assert health("healthy", "healthy", error="no answer within 2 s").status == "unhealthy"

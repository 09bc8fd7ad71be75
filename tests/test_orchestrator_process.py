"""The orchestrator with real worker processes and a scripted engine over a real shm connector.

A module pipeline serves the happy-path tests (each ends with a leak audit through the
control plane); the failure tests start their own. Interleavings are forced with
knobs of the scripted engine (a stage 0 that stalls after k tokens, injected errors),
never with sleeps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.api import NO_RESTARTS, Pipeline, RuntimeHooks, validate_request_id
from omnirelay.connectors.shm import sweep
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import InvalidRequestError, PipelineError, RequestFailedError, StageDiedError
from omnirelay.pipeline import PipelineConfig, parse_pipeline
from tests.orchestrator_audit import (
    audit_running,
    audit_stopped,
    child_pids,
    fork_servers,
    pids_alive,
    processes,
    transfer_objects,
)
from tests.orchestrator_fakes import SAMPLE_RATE, expected_audio, expected_text_tokens
from tests.orchestrator_load import run_concurrent

FACTORY = "tests.orchestrator_fakes:build_scripted_engine"


def fake_config() -> PipelineConfig:
    return parse_pipeline(fake_config_data())


def fake_config_data() -> dict[str, Any]:
    def stage(sid: int, name: str, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"id": sid, "name": name, "execution_type": "ar", "executor": f"fake.{name}"}
        if sid:
            out["input_sources"] = [sid - 1]
        out.update(kw)
        return out

    return {
        "name": "scripted-3stage",
        "stages": [
            stage(0, "thinker", chunk_processor="c0", final_output=True, final_output_type="text"),
            stage(1, "talker", chunk_processor="c1"),
            stage(2, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"),
        ],
    }


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    p = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY))
    yield p
    audit_stopped(p)


@pytest.fixture
def audited(pipe: Pipeline) -> Iterator[Pipeline]:
    yield pipe
    audit_running(pipe)


def sampling(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


# ------------------------------------------------------------------------- happy paths


def test_text_and_audio_request_completes(audited: Pipeline) -> None:
    prompt = [3, 1, 4]
    handle = audited.submit(prompt, modalities=["text", "audio"], sampling=sampling(6), request_id="ta-1")
    res = handle.result(timeout=30)
    assert res.token_ids("text") == expected_text_tokens(prompt, 6)
    assert res.audio is not None and torch.equal(res.audio, expected_audio(prompt, 6))
    assert res.sample_rate == SAMPLE_RATE
    assert [o.finished for o in res.outputs].count(True) == 1 and res.outputs[-1].finished


def test_text_only_request_leaves_no_objects(audited: Pipeline) -> None:
    # The scripted stage 0 puts a chunk per token even for text-only requests (as the
    # reference does); only the orchestrator's release by id removes them.
    res = audited.submit([7], modalities=["text"], sampling=sampling(5)).result(timeout=30)
    assert res.token_ids() == expected_text_tokens([7], 5)
    assert res.audio is None
    audited.leak_state()  # round trip: the releases have been applied
    assert transfer_objects(audited.namespace) == []


def test_abort_mid_stream_leaves_nothing(audited: Pipeline) -> None:
    handle = audited.submit(
        [10], modalities=["text", "audio"], sampling=sampling(50), extras={"stall_after": 3}
    )
    seen_audio = 0
    for out in handle:
        if out.modality == "audio":
            seen_audio += 1
        if seen_audio == 3:  # stage 0 is stalled: the request is mid-stream for sure
            handle.abort()
            break
    rest = list(handle)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"


def test_async_iteration(audited: Pipeline) -> None:
    async def main() -> list[Any]:
        handle = audited.submit([5, 5], modalities=["text", "audio"], sampling=sampling(3))
        return [o async for o in handle]

    outs = asyncio.run(main())
    assert outs[-1].finished
    assert [t for o in outs if o.modality == "text" for t in o.token_ids] == expected_text_tokens([5, 5], 3)


def test_async_start_and_shutdown() -> None:
    async def main() -> None:
        pipe = await Pipeline.start_async(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY))
        try:
            handle = pipe.submit([8], modalities=["text"], sampling=sampling(2))
            assert (await handle.result_async()).token_ids() == expected_text_tokens([8], 2)
            assert (await pipe.health_async()).is_healthy
        finally:
            report = await pipe.shutdown_async()
        assert report.exitcodes == {0: 0, 1: 0, 2: 0} and report.num_reclaimed == 0
        assert pids_alive(list(pipe.pids().values())) == []

    asyncio.run(main())


def test_stage_error_fails_the_request_naming_the_stage(audited: Pipeline) -> None:
    handle = audited.submit(
        [1], modalities=["text", "audio"], sampling=sampling(20), extras={"fail_stage": 1, "fail_after": 2}
    )
    with pytest.raises(RequestFailedError, match=r"stage 1 \(talker\): injected failure"):
        handle.result(timeout=30)


def test_add_request_failure_fails_the_request(audited: Pipeline) -> None:
    handle = audited.submit(
        [1], modalities=["text", "audio"], sampling=sampling(4), extras={"reject_stage": 2}
    )
    with pytest.raises(RequestFailedError, match=r"stage 2 \(code2wav\): add_request failed"):
        handle.result(timeout=30)


def test_untrusted_request_ids(audited: Pipeline) -> None:
    for bad in ["", "x" * 257, "a\nb", "nul\x00", "del\x7f", 12, None.__class__, b"bytes"]:
        with pytest.raises(InvalidRequestError):
            audited.submit([1], request_id=bad, sampling=sampling(1))  # type: ignore[arg-type]
    assert validate_request_id("ok/../é 👍" + "x" * 200) == "ok/../é 👍" + "x" * 200
    # an odd but valid id works end to end (it only ever reaches /dev/shm hashed)
    rid = "../../etc/passwd_1_0 ☃"
    assert audited.submit([2], request_id=rid, sampling=sampling(2), modalities=["text", "audio"]).result(30)
    # a duplicate of an id in flight is refused
    h = audited.submit([2], request_id="dup", sampling=sampling(50), extras={"stall_after": 1})
    with pytest.raises(InvalidRequestError, match="already in flight"):
        audited.submit([2], request_id="dup")
    h.abort()
    assert h.result(30).is_aborted
    # ...and reusable once it ended
    assert (
        audited.submit([2], request_id="dup", sampling=sampling(2), modalities="text")
        .result(30)
        .finish_reason
        == "length"
    )


def test_id_reuse_right_after_abort_gets_no_stale_output(audited: Pipeline) -> None:
    """The release fence: whatever a stage said about the aborted request before it
    applied the release is dropped, and the new request reaches a stage only after it."""
    for i in range(5):
        h = audited.submit(
            [9],
            request_id="again",
            modalities=["text", "audio"],
            sampling=sampling(50),
            extras={"stall_after": 3},
        )
        for _ in range(i):  # abort at a different point each round (6 outputs come, then a stall)
            next(h)
        h.abort()
        assert h.result(10).is_aborted
        res = audited.submit(
            [30 + i], request_id="again", modalities=["text", "audio"], sampling=sampling(4)
        ).result(10)
        assert res.token_ids() == expected_text_tokens([30 + i], 4)
        assert res.audio is not None and torch.equal(res.audio, expected_audio([30 + i], 4))
    assert audited._orch.num_stale_messages >= 0


def test_bad_prompts_and_options(audited: Pipeline) -> None:
    with pytest.raises(InvalidRequestError, match="prewarm"):
        audited.submit(None, inputs={"embeds": torch.zeros(1, 2)}, modalities=["text", "audio"])
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        audited.submit("hello")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        audited.submit(text="hello")
    with pytest.raises(InvalidRequestError, match="sampling"):
        audited.submit([1], sampling={7: sampling(1)})
    with pytest.raises(InvalidRequestError, match="modalities"):
        audited.submit([1], modalities=[1])  # type: ignore[list-item]


def test_health_reports_every_stage(audited: Pipeline) -> None:
    h = audited.health()
    assert h.is_healthy and h.namespace == audited.namespace
    assert [s.stage_id for s in h.stages] == [0, 1, 2]
    for s in h.stages:
        assert s.is_alive and s.pid and s.error is None
        assert s.queue_depth == 0 and s.engine is not None and s.engine["status"] == "healthy"


def test_many_concurrent_requests_with_aborts(audited: Pipeline) -> None:
    def expect(prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        return expected_text_tokens(prompt, n), expected_audio(prompt, n)

    report = run_concurrent(audited, expect, num_requests=60, abort_fraction=0.2, seed=7)
    assert report.num_abort_planned > 0 and report.num_aborted == report.num_abort_planned
    assert report.num_completed == 60 - report.num_aborted


# ------------------------------------------------------------------ failures and lifecycle


def test_killed_worker_fails_its_requests_within_5s() -> None:
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=NO_RESTARTS)
    try:
        stalled = [
            pipe.submit([i], modalities=["text", "audio"], sampling=sampling(50), extras={"stall_after": 2})
            for i in range(1, 4)
        ]
        for h in stalled:  # each is mid-stream: its first audio came back
            next(o for o in h if o.modality == "audio")
        talker_pid = pipe.health().stages[1].pid
        assert talker_pid is not None
        t0 = time.monotonic()
        os.kill(talker_pid, signal.SIGKILL)
        for h in stalled:
            with pytest.raises(RequestFailedError) as info:
                h.result(timeout=5.0)
            assert "stage 1 (talker)" in info.value.reason and "SIGKILL" in info.value.reason
        assert time.monotonic() - t0 < 5.0
        health = pipe.health()
        assert not health.is_healthy
        dead = health.stages[1]
        assert not dead.is_alive and dead.exitcode == -signal.SIGKILL and "SIGKILL" in (dead.error or "")
        assert health.stages[0].is_alive and health.stages[2].is_alive
        # the front stays up: text-only requests still work, audio ones fail at once
        assert (
            pipe.submit([4], modalities=["text"], sampling=sampling(3)).result(10).finish_reason == "length"
        )
        with pytest.raises(RequestFailedError, match=r"stage 1 \(talker\)"):
            pipe.submit([4], modalities=["text", "audio"], sampling=sampling(3)).result(5)
    finally:
        report = pipe.shutdown()
    assert report.exitcodes[1] == -signal.SIGKILL and report.exitcodes[0] == 0
    assert sweep(pipe.namespace).objects == []
    assert pids_alive(list(pipe.pids().values())) == []


def test_engine_step_failure_takes_the_stage_down_cleanly() -> None:
    pipe = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), restart=NO_RESTARTS)
    try:
        bystander = pipe.submit(
            [1], modalities=["text", "audio"], sampling=sampling(50), extras={"stall_after": 1}
        )
        next(o for o in bystander if o.modality == "audio")
        doomed = pipe.submit(
            [2], modalities=["text", "audio"], sampling=sampling(5), extras={"crash_stage": 2}
        )
        with pytest.raises(
            RequestFailedError, match=r"stage 2 \(code2wav\) failed: engine step failed.*on purpose"
        ):
            doomed.result(10)
        with pytest.raises(RequestFailedError, match=r"stage 2 \(code2wav\)"):
            bystander.result(10)  # it needed the broken stage too
        deadline = time.monotonic() + 10
        while pipe.health().stages[2].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker reports, then exits: wait for the exit itself
        dead = pipe.health().stages[2]
        assert not dead.is_alive and dead.exitcode == 1 and "engine step failed" in (dead.error or "")
        assert (
            pipe.submit([3], modalities=["text"], sampling=sampling(2)).result(10).finish_reason == "length"
        )
    finally:
        report = pipe.shutdown()
    assert report.exitcodes == {0: 0, 1: 0, 2: 1}
    assert sweep(pipe.namespace).objects == []
    assert pids_alive(list(pipe.pids().values())) == []


def test_startup_failure_names_the_stage_and_leaves_nothing() -> None:
    num_children = len(child_pids())
    with pytest.raises(StageDiedError, match=r"stage 1 \(talker\) failed to start.*on purpose"):
        Pipeline.start(
            fake_config(), runtime=RuntimeHooks(engine_factory="tests.orchestrator_fakes:build_broken_engine")
        )
    assert len(child_pids()) == num_children


def test_shutdown_fails_in_flight_requests_and_is_idempotent() -> None:
    with Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY)) as pipe:
        h = pipe.submit([1], modalities=["text", "audio"], sampling=sampling(50), extras={"stall_after": 1})
        next(iter(h))
        first = pipe.shutdown()
        with pytest.raises(RequestFailedError, match="shutting down"):
            h.result(5)
        assert pipe.shutdown() is first
        with pytest.raises(PipelineError, match="shut down"):
            pipe.submit([1])
        with pytest.raises(PipelineError, match="shut down"):
            pipe.health()
        pipe.abort("anything")  # no-op
    assert first.exitcodes == {0: 0, 1: 0, 2: 0} and first.num_killed == 0
    assert first.num_reclaimed == 0
    assert sweep(pipe.namespace).objects == []
    assert pids_alive(list(pipe.pids().values())) == []


FRONT_SCRIPT = """
import json, sys, time
from omnirelay.api import Pipeline, RuntimeHooks
from omnirelay.engine.interfaces import SamplingParams
from tests.test_orchestrator_process import FACTORY, fake_config
p = Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY))
h = p.submit([1], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=50), extras={"stall_after": 2})
next(o for o in h if o.modality == "audio")
print(json.dumps({"namespace": p.namespace, "pids": list(p.pids().values()),
                  "ctl": p._orch._control.paths.directory}), flush=True)
time.sleep(600)
"""


def test_workers_exit_when_the_front_dies() -> None:
    import json
    import subprocess
    import sys

    front = subprocess.Popen(
        [sys.executable, "-c", FRONT_SCRIPT], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert front.stdout is not None
        info = json.loads(front.stdout.readline())
        assert pids_alive(info["pids"]) == info["pids"]
        assert not os.path.exists(info["ctl"])  # socket files go once every worker connected
        # the workers were forked by the front's fork server, not by the front
        procs = processes()
        fork_server = fork_servers(front.pid, procs)
        assert len(fork_server) == 1
        assert set(info["pids"]) <= {p for p, (ppid, _) in procs.items() if ppid == fork_server[0]}
        os.kill(front.pid, signal.SIGKILL)
        front.wait(10)
        deadline = time.monotonic() + 10
        while pids_alive(info["pids"] + fork_server) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for other processes to exit: nothing to synchronize on
        assert pids_alive(info["pids"]) == []
        assert pids_alive(fork_server) == []  # it goes once the front and its workers are gone
        # the orphaned workers shut their engines down: their objects are gone too
        assert sweep(info["namespace"]).objects == []
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
        assert front.stdout is not None
        front.stdout.close()


def test_tracing_steps_needs_an_engine_factory_that_takes_a_tracer() -> None:
    num_children = len(child_pids())
    with pytest.raises(StageDiedError, match=r"takes no tracer= argument.*trace_steps"):
        Pipeline.start(fake_config(), runtime=RuntimeHooks(engine_factory=FACTORY), trace_steps=True)
    assert len(child_pids()) == num_children

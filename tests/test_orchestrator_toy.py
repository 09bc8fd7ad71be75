"""The real multi-process pipeline: stage engines with the toy executors (``toy-3stage``).

counter (AR, text) → relay (AR) → synth (generation, audio), chunked edges over shm,
one spawned worker per stage, the default engine factory. Each test ends with a leak
audit through the control plane: no request state in any stage, no transfer object in
the namespace; the module ends with a shutdown audit (no process, no object left).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from omnirelay.api import NO_RESTARTS, Pipeline, RuntimeHooks
from omnirelay.connectors.shm import sweep
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import RequestFailedError
from omnirelay.models.testing.toy import (
    TOY_SAMPLE_RATE,
    expected_counting_tokens,
    expected_relay_tokens,
    expected_waveform,
)
from omnirelay.pipeline import load_pipeline
from omnirelay.timeline import StageTrace, drive_request, steps_by_stage
from tests.orchestrator_audit import audit_running, audit_stopped, pids_alive, transfer_objects
from tests.orchestrator_load import run_concurrent

#: Long enough that an abort after the first audio chunk is mid-stream for sure.
LONG = 100_000


def expect(prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    text = expected_counting_tokens(prompt, n)
    return text, expected_waveform(expected_relay_tokens(text))


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    p = Pipeline.start("toy-3stage")
    yield p
    audit_stopped(p)


@pytest.fixture
def audited(pipe: Pipeline) -> Iterator[Pipeline]:
    yield pipe
    audit_running(pipe)


def test_text_and_audio_request_completes_with_correct_outputs(audited: Pipeline) -> None:
    res = audited.submit([41], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=12)).result(
        30
    )
    text, wave = expect([41], 12)
    assert res.token_ids() == text
    assert res.audio is not None and torch.equal(res.audio, wave)
    assert res.sample_rate == TOY_SAMPLE_RATE
    assert res.outputs[-1].finished and sum(o.finished for o in res.outputs) == 1


def test_text_only_request_leaves_zero_objects(audited: Pipeline) -> None:
    res = audited.submit([7], modalities=["text"], sampling=SamplingParams(max_tokens=9)).result(30)
    assert res.token_ids() == expected_counting_tokens([7], 9) and res.audio is None
    audited.leak_state()  # every stage applied the release
    assert transfer_objects(audited.namespace) == []


def test_abort_mid_stream_leaves_zero_objects_and_zero_state(audited: Pipeline) -> None:
    handle = audited.submit([1], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=LONG))
    num_audio = 0
    for out in handle:
        num_audio += out.modality == "audio"
        if num_audio == 2:
            handle.abort()
            break
    rest = list(handle)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    # the audit (fixture) checks every stage and the namespace


def test_audio_only_request(audited: Pipeline) -> None:
    res = audited.submit([3, 9], modalities=["audio"], sampling=SamplingParams(max_tokens=5)).result(30)
    _, wave = expect([3, 9], 5)
    assert res.token_ids() == [] and res.audio is not None and torch.equal(res.audio, wave)


def test_request_id_reuse_after_abort_and_after_completion(audited: Pipeline) -> None:
    for _ in range(2):
        h = audited.submit(
            [2], request_id="same", modalities=["text", "audio"], sampling=SamplingParams(max_tokens=LONG)
        )
        next(o for o in h if o.modality == "audio")
        h.abort()
        assert h.result(10).is_aborted
        # The engine refuses an id whose aborted sender generation still drains (its
        # transfer layer's rule); once the stages settled (what leak_state waits for),
        # the id is free again. Immediate reuse is covered with the scripted engine.
        audited.leak_state()
        for n in (6, 3):  # and right after a completion
            res = audited.submit(
                [2], request_id="same", modalities=["text", "audio"], sampling=SamplingParams(max_tokens=n)
            ).result(30)
            text, wave = expect([2], n)
            assert res.token_ids() == text and res.audio is not None and torch.equal(res.audio, wave)


def test_request_id_reused_right_after_an_abort_waits_for_every_stage_release(audited: Pipeline) -> None:
    """No settling in between: the front parks the reuse until every stage reported the
    ended request released (stage 0 only once its aborted sender drained)."""
    for n in (4, 2, 5):
        h = audited.submit(
            [2], request_id="again", modalities=["text", "audio"], sampling=SamplingParams(max_tokens=LONG)
        )
        next(o for o in h if o.modality == "audio")
        h.abort()
        assert h.result(10).is_aborted
        res = audited.submit(
            [2], request_id="again", modalities=["text", "audio"], sampling=SamplingParams(max_tokens=n)
        ).result(30)
        text, wave = expect([2], n)
        assert res.token_ids() == text and res.audio is not None and torch.equal(res.audio, wave)


def test_requests_parked_behind_a_silent_first_stage_are_released_on_abort() -> None:
    """Stage 0 parks every request (a test module's engine factory, loaded by the spawned
    worker): the downstream stages hold the prewarmed requests, waiting for chunks that
    never come; each stage's queue depth is its own engine's count."""
    with Pipeline.start(
        "toy-3stage",
        runtime=RuntimeHooks(engine_factory="benchmarks.parking_engine:build_parked_stage0_engine"),
    ) as p:
        handles = [p.submit([i], modalities=["text", "audio"]) for i in range(3)]
        health = p.health()
        assert [st.queue_depth for st in health.stages] == [3, 3, 3]
        assert health.stages[0].engine is not None and health.stages[0].engine["num_parked"] == 3
        for h in handles:
            h.abort()
            assert h.result(10).is_aborted
        audit_running(p)
        assert [st.queue_depth for st in p.health().stages] == [0, 0, 0]
    audit_stopped(p)


def test_concurrent_requests_with_random_aborts(audited: Pipeline) -> None:
    """200 concurrent requests, 20% aborted at seeded random points (short requests: the
    full-length run is ``python -m benchmarks.soak_pipeline``); the fixture audits for leaks.
    The ones to abort cannot end on their own first, so each abort lands and the rest complete."""
    report = run_concurrent(audited, expect, num_requests=200, abort_fraction=0.2, seed=1234)
    assert report.num_abort_planned == 30
    assert report.num_aborted == 30 and report.num_completed == 170


def test_health_has_engine_details(audited: Pipeline) -> None:
    h = audited.health()
    assert h.is_healthy
    for st in h.stages:
        assert st.engine is not None and st.engine["status"] == "healthy" and st.queue_depth == 0
    assert h.stages[1].engine is not None and h.stages[1].engine["receive_from_stage"] == 0


def test_non_chunk_stage_gets_the_forwarded_output() -> None:
    """Mixed contracts: synth opts out of chunks, so it runs once on relay's whole output,
    forwarded by the orchestrator after relay finished (docs/protocol.md §2.5)."""
    cfg = load_pipeline("toy-3stage")
    relay, synth = cfg.stages[1], cfg.stages[2]
    stages = (
        cfg.stages[0],
        msgspec.structs.replace(relay, chunk_processor=None),
        msgspec.structs.replace(synth, async_chunk=False),
    )
    mixed = msgspec.structs.replace(cfg, stages=stages)
    with Pipeline.start(mixed) as p:
        res = p.submit([20], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=7)).result(30)
        text, wave = expect([20], 7)
        assert res.token_ids() == text and res.audio is not None and torch.equal(res.audio, wave)
        health = p.health()
        assert health.stages[2].engine is not None and health.stages[2].engine["num_added"] == 1
        audit_running(p)
    audit_stopped(p)


def test_killed_worker_fails_its_requests_within_5s_and_health_says_so() -> None:
    # Restarts off: this is the stage that stays down (restarts: tests/test_supervision.py).
    p = Pipeline.start("toy-3stage", restart=NO_RESTARTS)
    try:
        handles = [
            p.submit([i], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=LONG))
            for i in range(3)
        ]
        for h in handles:
            next(o for o in h if o.modality == "audio")
        relay_pid = p.pids()[1]
        assert relay_pid is not None
        t0 = time.monotonic()
        os.kill(relay_pid, signal.SIGKILL)
        for h in handles:
            with pytest.raises(RequestFailedError) as info:
                h.result(timeout=5.0)
            assert "stage 1 (relay)" in info.value.reason and "SIGKILL" in info.value.reason
        assert time.monotonic() - t0 < 5.0
        health = p.health()
        assert not health.is_healthy and not health.stages[1].is_alive
        assert "SIGKILL" in (health.stages[1].error or "")
        assert health.stages[0].is_alive and health.stages[2].is_alive
        # the front stays up and text-only requests still work
        res = p.submit([4], modalities=["text"], sampling=SamplingParams(max_tokens=3)).result(10)
        assert res.token_ids() == expected_counting_tokens([4], 3)
    finally:
        report = p.shutdown()
    assert report.exitcodes[1] == -signal.SIGKILL and report.exitcodes[0] == 0 and report.exitcodes[2] == 0
    assert sweep(p.namespace).objects == []
    assert pids_alive(list(p.pids().values())) == []


def test_a_pipeline_that_traces_steps_gives_each_output_its_step() -> None:
    """``trace_steps=True``: every stage process records its steps into its outputs, so
    a request's critical path can be walked from the last audio back to the submit."""
    trace = StageTrace()
    pipe = Pipeline.start("toy-3stage", on_stage_output=trace, trace_steps=True)
    try:
        tl = drive_request(
            pipe, trace, [5], modalities=["text", "audio"], sampling={0: SamplingParams(max_tokens=8)}
        )
        assert tl.finish_reason == "stop" and tl.num_text_tokens == 8 and tl.audio_chunks
        assert set(steps_by_stage(tl.events)) == {0, 1, 2}  # every stage timed its steps
        assert all(a.step is not None for a in tl.arrivals if a.num_tokens or a.num_samples)
        for cp in (tl.cp_first_audio, tl.cp_done):
            assert cp is not None and cp.path and cp.path[-1].stage_id == 2
            assert cp.compute_s + sum(cp.segments.values()) == pytest.approx(cp.wall_s, abs=1e-9)
        audit_running(pipe)  # the tracers' per-request state included
        assert trace.num_watched == 0
    finally:
        audit_stopped(pipe)

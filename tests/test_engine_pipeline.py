"""Three stage engines in one process (counter -> relay -> synth, chunked edges, inproc),
each on the real worker loop, routed by a tiny in-test orchestrator (tests/engine_harness.py).
Every test ends with the leak audit: no objects, no pending keys, ``leak_state() == {}``."""

from __future__ import annotations

import random

import torch

from omnirelay.engine import StageOutput
from omnirelay.models.testing.toy import expected_counting_tokens, expected_relay_tokens, expected_waveform
from tests.engine_harness import (
    CorruptingConnector,
    GatedCountingLM,
    ToyPipelineRun,
    Track,
    fresh_namespace,
)


def assert_complete_and_correct(track: Track, max_tokens: int) -> None:
    assert track.is_done and not track.is_aborted and not track.is_failed, track
    text = expected_counting_tokens(track.prompt, max_tokens)
    assert track.tokens[0] == text
    assert track.finished[0].finish_reason == "length"
    if track.final_stage_id == 0:
        assert set(track.finished) == {0}
        return
    relay = expected_relay_tokens(text)
    assert track.tokens[1] == relay and track.finished[1].finish_reason == "stop"
    assert track.finished[2].finish_reason == "stop"
    assert torch.equal(track.waveform(), expected_waveform(relay, 4))


def test_requests_flow_through_three_stages_with_correct_outputs() -> None:
    with ToyPipelineRun() as run:
        for i in range(8):
            run.submit(f"req-{i}", [i * 7 + 1, i], max_tokens=6 + i)
        run.wait_done()
        for i in range(8):
            assert_complete_and_correct(run.tracks[f"req-{i}"], 6 + i)
        # Stage 2's chunks arrived one per relay step, each computed once.
        assert run.engines[2].health()["scheduler"]["num_chunks_applied"] == sum(6 + i for i in range(8))


def test_stage_two_produces_audio_before_stage_zero_finishes() -> None:
    counter = GatedCountingLM(gate_at_call=4)
    with ToyPipelineRun(executors={0: counter}) as run:
        run.submit("stream", [10], max_tokens=12)
        track = run.tracks["stream"]
        # Stage 0 is held at its 4th step: audio made of its first 3 tokens still comes out.
        # (Wait for all three facts: the audio can beat stage 0 to its gate.)
        run.pump(lambda: bool(track.audio) and counter.reached.is_set() and len(track.tokens[0]) == 3)
        assert 0 not in track.finished and counter.num_calls == 3
        counter.gate.set()
        run.wait_done()
        assert_complete_and_correct(track, 12)
        first_audio = next(i for i, o in enumerate(run.log) if o.audio is not None)
        stage0_done = next(i for i, o in enumerate(run.log) if o.stage_id == 0 and o.finished)
        assert first_audio < stage0_done


def test_abort_mid_stream_leaves_zero_objects_and_zero_state() -> None:
    counter = GatedCountingLM(gate_at_call=5)
    with ToyPipelineRun(executors={0: counter}) as run:
        run.submit("victim", [1], max_tokens=40)
        run.submit("bystander", [2], max_tokens=5)
        run.pump(lambda: bool(run.tracks["victim"].audio))
        run.abort("victim")  # stage 0 is blocked mid-step: the abort lands at its boundary
        counter.gate.set()
        run.wait_done()
        victim = run.tracks["victim"]
        assert victim.is_aborted and 0 not in victim.finished
        answers = {o.stage_id: o.finish_reason for o in run.log if o.request_id == "victim" and o.finished}
        assert answers == {0: "abort", 1: "abort", 2: "abort"}
        assert_complete_and_correct(run.tracks["bystander"], 5)
    # (the audit ran on exit: nothing of "victim" is left anywhere)


def test_a_text_only_request_on_three_stages_never_puts_and_leaves_nothing() -> None:
    with ToyPipelineRun() as run:
        track = run.submit("text", [3], max_tokens=10, final_stage_id=0)
        assert track.submitted == {0}  # no prewarm
        run.wait_done()
        assert_complete_and_correct(track, 10)
        for e in run.engines:
            assert e.flush()
        assert run.connectors[0].health().num_puts == 0
        assert run.engines[0].health()["transfer"]["sender"]["num_admitted"] == 0
        assert run.hub.live_keys() == []


def test_a_corrupt_chunk_fails_the_request_fast_and_the_rest_is_cleaned() -> None:
    ns = fresh_namespace()
    corrupting = CorruptingConnector(ns, 0, {"bad_0_2"})
    with ToyPipelineRun(namespace=ns, connectors={0: corrupting}) as run:
        run.submit("bad", [1], max_tokens=30)
        run.submit("good", [1], max_tokens=30)
        run.wait_done()
        bad = run.tracks["bad"]
        assert bad.is_failed and bad.finished[1].finish_reason == "error"
        error = str(bad.finished[1].error)
        assert "receive_failed at stage 1" in error and "'bad_0_2'" in error and "corrupt payload" in error
        assert len(bad.tokens[1]) == 2  # it ran on the two good chunks, then failed at once
        assert_complete_and_correct(run.tracks["good"], 30)


def test_two_hundred_concurrent_requests_with_random_aborts() -> None:
    rng = random.Random(20240607)
    n = 200
    max_tokens = {f"r{i}": rng.randint(3, 14) for i in range(n)}
    doomed = set(rng.sample(sorted(max_tokens), k=n // 5))
    abort_after = {rid: rng.randint(1, 12) for rid in doomed}
    with ToyPipelineRun(start=False, max_num_seqs=64) as run:
        for i in range(n):
            run.submit(f"r{i}", [i % 50, i], max_tokens=max_tokens[f"r{i}"])
        run.start()

        def maybe_abort(o: StageOutput) -> None:
            track = run.tracks[o.request_id]
            if (
                o.request_id in doomed
                and not track.is_done
                and track.num_outputs >= abort_after[o.request_id]
            ):
                run.abort(o.request_id)

        run.pump(lambda: all(t.is_done for t in run.tracks.values()), on_output=maybe_abort)
        completed = [t for t in run.tracks.values() if not t.is_aborted]
        assert len(completed) >= n - len(doomed)
        for t in completed:
            assert_complete_and_correct(t, max_tokens[t.request_id])
        assert run.executor(0).max_batch_size > 1  # decode steps were batched
        assert run.executor(0).max_batch_size <= 64

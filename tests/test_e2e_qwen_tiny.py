"""End to end on the real multi-process ``qwen3-omni-tiny`` pipeline.

One pipeline for the module (three stage processes, shm connector, tiny seeded models
from the session's tiny-model cache), observed through ``on_stage_output`` so the
Talker's own outputs are visible. Tests wait for outputs and events, never for time:
the abort lands when the first audio chunk has been read. Every test ends with a leak
audit over the control plane; the module ends with shutdown and a full audit.
"""

from __future__ import annotations

import json
import os
import signal
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from benchmarks.pipeline import bench_running_pipeline, render_pipeline_bench, target_met
from omnirelay.api import Pipeline
from omnirelay.cli.main import main
from omnirelay.connectors.shm import sweep
from omnirelay.errors import StageUnavailableError
from omnirelay.models.code2wav import SAMPLE_RATE, measure_receptive_field
from omnirelay.models.qwen3_omni import Checkpoint, encode_chat_prompt, load_tokenizer
from omnirelay.models.qwen3_omni.code2wav import open_code2wav
from omnirelay.models.qwen3_omni.tiny import CACHE_ENV
from omnirelay.orchestrator.requests import stage_sampling_defaults
from omnirelay.timeline import SEGMENTS, StageTrace, drive_request, steps_by_stage
from omnirelay.worker import leak_paths
from tests.orchestrator_audit import audit_stopped, child_pids
from tests.test_models_support import tiny_cache, tiny_dir

U = 1920  # samples per codec frame
LARGEST = 25  # the pipeline's largest codec chunk (its adaptive schedule sizes the others)
TALKER, CODE2WAV = 1, 2


@pytest.fixture(scope="module")
def tiny_env() -> Iterator[None]:
    """Stage processes inherit ``OMNIRELAY_CACHE``: they load the session's tiny model."""
    tiny_dir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tiny_cache()))
        yield


@pytest.fixture(scope="module")
def trace() -> StageTrace:
    return StageTrace()


@pytest.fixture(scope="module")
def pipe(tiny_env: None, trace: StageTrace) -> Iterator[Pipeline]:
    p = Pipeline.start("qwen3-omni-tiny", on_stage_output=trace, trace_steps=True)
    yield p
    audit_stopped(p)  # nothing in /dev/shm for the namespace, no process, no socket dir


@pytest.fixture(scope="module")
def prompt(tiny_env: None) -> list[int]:
    return encode_chat_prompt(load_tokenizer(tiny=True, seed=0), "Hello, who are you?")


@pytest.fixture(scope="module")
def holdback() -> int:
    """Samples the tiny decoder holds back at a window's end (docs/protocol.md §6.2 ``tail``)."""
    model = open_code2wav(Checkpoint.open(tiny_dir())).model
    return measure_receptive_field(model)[1]


def stage_state(pipe: Pipeline) -> dict[int, list[str]]:
    """Per stage, the request state left (after every release sent so far was applied)."""
    return {sid: leak_paths(state) for sid, state in pipe.leak_state().items() if leak_paths(state)}


def not_free_slots(namespace: str) -> list[tuple[str, str, str | None]]:
    """Objects of the namespace other than free pooled slots (reusable memory of live
    producers, holding no key): published objects, claims, slots in use."""
    return [
        (o.kind, o.name, o.key)
        for o in sweep(namespace).objects
        if not (o.kind == "slot" and o.state == "free")
    ]


# ------------------------------------------------------------------------------ tests
# Order matters for the first one: on a fresh pipeline nothing was ever put, so a
# text-only request must leave the namespace literally empty (not even pooled slots).


def test_text_only_request_leaves_no_objects_and_no_state(
    pipe: Pipeline, trace: StageTrace, prompt: list[int]
) -> None:
    tl = drive_request(pipe, trace, prompt, modalities=["text"])
    assert tl.finish_reason in ("stop", "length")
    assert tl.num_text_tokens > 0 and tl.text
    assert tl.num_samples == 0 and tl.first_audio is None
    # Only the Thinker ran: no stage downstream of it saw the request.
    assert {e.stage_id for e in tl.events} == {0}
    assert stage_state(pipe) == {}  # the round trip also proves every release was applied
    assert sweep(pipe.namespace).objects == []
    assert pipe.num_active == 0 and trace.num_watched == 0


def test_text_and_audio_come_back_and_audio_length_is_exact(
    pipe: Pipeline, trace: StageTrace, prompt: list[int], holdback: int
) -> None:
    outputs: list[tuple[str, torch.Tensor | None, int | None]] = []
    tl = drive_request(
        pipe,
        trace,
        prompt,
        modalities=["text", "audio"],
        on_output=lambda out, at: outputs.append((out.modality, out.audio, out.sample_rate)),
    )
    assert tl.finish_reason == "stop"
    assert tl.text and tl.num_text_tokens > 0
    pieces = [a for m, a, _ in outputs if m == "audio" and a is not None]
    assert pieces and all(p.dtype == torch.float32 and p.dim() == 1 for p in pieces)
    assert {r for m, _, r in outputs if m == "audio" and r is not None} == {SAMPLE_RATE}
    assert sum(p.numel() for p in pieces) == tl.num_samples

    # Frames counted from what the Talker itself produced (its outputs, stop token excluded).
    stops = set(stage_sampling_defaults(pipe.config.stage(TALKER)).stop_token_ids)
    talker_tokens = [t for e in tl.events if e.stage_id == TALKER for t in e.token_ids]
    frames = sum(1 for t in talker_tokens if t not in stops)
    assert frames == tl.num_frames and frames > LARGEST  # several chunks
    # The whole stream is exactly the whole-utterance decode length: frames x 1920 minus
    # the decoder's hold-back at the very end (38 samples for the tiny decoder).
    assert tl.num_samples == frames * U - holdback
    # Chunk by chunk: whole frames (the first one less the held-back tail; each later one
    # re-emits the previous tail and holds back its own), small first, at most 25 frames.
    sizes = [a.num_samples for a in tl.audio_chunks]
    assert len(sizes) > 2 and (sizes[0] + holdback) % U == 0 and all(n % U == 0 for n in sizes[1:])
    # Small first: its size follows the slowest recent frame interval (the pacing tests pin
    # that rule: 1-2 frames when frames come fast, more on a machine so loaded that a frame
    # takes longer than the audio of two), never a whole chunk.
    assert (sizes[0] + holdback) // U < LARGEST and max(sizes) <= LARGEST * U

    # The timeline and its critical paths are consistent.
    assert tl.ttft_s is not None and tl.ttfa_s is not None and 0 < tl.ttft_s <= tl.ttfa_s <= tl.total_s
    for cp in (tl.cp_first_audio, tl.cp_done):
        assert cp is not None and cp.wall_s > 0
        assert cp.compute_s + sum(cp.segments.values()) == pytest.approx(cp.wall_s, abs=1e-9)
        assert all(v >= 0 for v in cp.segments.values()) and 0 <= cp.overhead_share < 1
        assert cp.path[-1].stage_id == CODE2WAV
        assert [s.stage_id for s in cp.path] == sorted(s.stage_id for s in cp.path)
        # The path starts where the request's own admission gated it: at the Thinker, or
        # at a consumer whose first chunk was already there when its prewarm placeholder
        # arrived (a busy box can deliver the placeholder after the Thinker's first chunk;
        # the walk then rightly credits the control plane, not the Thinker).
        first = cp.path[0]
        if first.stage_id != 0:
            assert first.input_time_s is None, first  # it did not wait for a chunk
            assert first == steps_by_stage(tl.events)[first.stage_id][0], first  # its stage's first step
    assert stage_state(pipe) == {}
    assert not_free_slots(pipe.namespace) == []


def test_abort_right_after_the_first_audio_chunk_leaves_nothing(pipe: Pipeline, prompt: list[int]) -> None:
    # A long Talker run, so the abort surely lands while every stage still holds the request.
    talker = msgspec.structs.replace(stage_sampling_defaults(pipe.config.stage(TALKER)), max_tokens=400)
    handle = pipe.submit(prompt, modalities=["text", "audio"], sampling={TALKER: talker})
    seen = []
    for out in handle:
        seen.append(out)
        if out.modality == "audio" and out.audio is not None and out.audio.numel():
            handle.abort()
            break
    rest = list(handle)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert (
        sum(1 for o in seen + rest if o.modality == "audio" and o.audio is not None and o.audio.numel()) == 1
    )
    assert stage_state(pipe) == {}
    assert not_free_slots(pipe.namespace) == []
    assert pipe.num_active == 0


def test_bench_pipeline_short_run_measures_every_level_and_audits(
    pipe: Pipeline, trace: StageTrace, prompt: list[int], holdback: int
) -> None:
    report = bench_running_pipeline(pipe, trace, prompt, concurrency=(1, 2), requests=2, warmup=0)
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["num_requests"] == 2
        assert 0 < lv["ttfa_s"]["p50"] <= lv["ttfa_s"]["p99"] <= lv["e2e_s"]["p99"]
        assert 0 <= lv["overhead_first_audio_share"]["p50"] < 1
        assert set(lv["overhead_first_audio_segments_mean_s"]) == set(SEGMENTS)
        assert lv["is_audio_length_exact"]  # frames x 1920 - hold-back, every request
    assert report["decoder_holdback_samples"] == holdback
    assert report["ok"] and report["audit"]["traces_left"] == 0, report["audit"]
    table = render_pipeline_bench(report)
    assert "target: overhead <= 10% of TTFA at concurrency 1" in table
    assert ("— met" in table) == bool(target_met(report))
    assert "leak audit: clean" in table
    json.dumps(report)  # what --json writes
    assert stage_state(pipe) == {}


def test_run_command_writes_a_wav_and_a_json_timeline(
    pipe: Pipeline, tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    wav_path, json_path = f"{tmp_path}/answer.wav", f"{tmp_path}/timeline.json"
    children = set(child_pids())
    rc = main(
        [
            *("run", "--pipeline", "qwen3-omni-tiny", "--prompt", "Hello, who are you?"),
            *("--out", wav_path, "--json", json_path, "--seed", "7"),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "ready in" in captured.err
    assert "first audio" in captured.out and "critical path" in captured.out and "wrote " in captured.out
    report = json.loads(Path(json_path).read_text())
    with wave.open(wav_path, "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == report["num_samples"] == report["wav_samples"] > 0
        pcm = torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16)
    assert pcm.abs().max() > 0
    assert report["text"] and report["finish_reason"] == "stop"
    assert report["ttft_s"] <= report["ttfa_s"] <= report["total_s"]
    assert [c["num_samples"] for c in report["audio_chunks"]] and sum(
        c["num_samples"] for c in report["audio_chunks"]
    ) == report["num_samples"]
    assert report["audio_chunks"][0]["ms"] == pytest.approx(
        1000 * report["audio_chunks"][0]["num_samples"] / SAMPLE_RATE
    )
    for key in ("critical_path_first_audio", "critical_path_done"):
        cp = report[key]
        assert cp["wall_s"] == pytest.approx(cp["compute_s"] + sum(cp["segments_s"].values()), abs=1e-9)
        assert 0 <= cp["overhead_share"] < 1
    assert report["shutdown"] == {"num_killed": 0, "num_objects_left": 0}
    # The command shut its pipeline down: no new child process, no object of its own.
    assert set(child_pids()) <= children
    prefix = f"p{os.getpid()}x"
    assert [
        o.name for o in sweep().objects if o.namespace.startswith(prefix) and o.namespace != pipe.namespace
    ] == []


def test_the_requested_voice_reaches_the_talker(pipe: Pipeline, prompt: list[int]) -> None:
    """extras["voice"] travels orchestrator -> stage engine -> request snapshot -> the
    thinker->talker processor's speaker: two voices give different audio, one voice twice
    gives the same audio (greedy Thinker, seeded Talker) — the same up to float rounding:
    the adaptive schedule cuts chunks where the stream's timing says, and every window is
    decoded with its full left context, so only the last bits of a sample can differ."""

    def audio(voice: str) -> torch.Tensor:
        handle = pipe.submit(prompt, modalities=["text", "audio"], extras={"voice": voice})
        pieces = [o.audio for o in handle if o.modality == "audio" and o.audio is not None]
        return torch.cat([p.reshape(-1) for p in pieces])

    a1, a2, b = audio("chelsie"), audio("chelsie"), audio("ethan")
    assert a1.shape == a2.shape and float((a1 - a2).abs().max()) < 1e-5
    assert not (a1.shape == b.shape and torch.equal(a1, b))
    assert stage_state(pipe) == {}
    assert not_free_slots(pipe.namespace) == []


def test_sigkill_of_each_stage_mid_stream_fails_it_restarts_the_stage_and_serves_again(
    pipe: Pipeline, prompt: list[int]
) -> None:
    """Last in the module (it replaces every stage process): each stage in turn is
    SIGKILLed right after a request's first audio chunk; the request ends within 2 s with
    ``stage_unavailable``, the stage comes back (docs/design.md §10), a new request reusing
    the failed one's id gets its whole answer, and nothing is left."""
    talker = msgspec.structs.replace(stage_sampling_defaults(pipe.config.stage(TALKER)), max_tokens=400)
    for stage_id in (0, TALKER, CODE2WAV):
        rid = f"kill-{stage_id}"
        handle = pipe.submit(prompt, modalities=["text", "audio"], sampling={TALKER: talker}, request_id=rid)
        next(o for o in handle if o.modality == "audio" and o.audio is not None and o.audio.numel())
        t0 = time.monotonic()
        os.kill(pipe.pids()[stage_id] or 0, signal.SIGKILL)
        with pytest.raises(StageUnavailableError, match="killed by SIGKILL"):
            handle.result(timeout=2.0)
        assert time.monotonic() - t0 < 2.0
        pipe.wait_ready(120)
        assert pipe.health().stages[stage_id].num_restarts == 1
        res = pipe.submit(prompt, modalities=["text", "audio"], request_id=rid).result(60)
        assert res.finish_reason in ("stop", "length") and res.audio is not None and res.audio.numel() > 0
        assert stage_state(pipe) == {}
        assert not_free_slots(pipe.namespace) == []
        assert pipe.num_active == 0

"""The adaptive chunk schedule (docs/protocol.md §5.3) under simulated frame timings.

Each test drives the Talker → Code2Wav processor with a virtual clock: frames arrive at
given times, every chunk reaches the client a fixed decode delay after it was sent, and
the client's playback (:func:`omnirelay.timeline.playback.playback_of`) says whether a
listener would have heard a gap. Timings, jitter and stalls are explicit lists: nothing
sleeps, nothing depends on this machine's speed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from omnirelay.errors import ConfigError
from omnirelay.processors import TalkerToCode2WavConfig, TalkerToCode2WavProcessor
from omnirelay.processors.pacing import FrameRate, PacingConfig, StreamPacer
from omnirelay.timeline.playback import GAP_FREE_MAX_S, Playback, playback_of

Q = 16
FRAME_S = 0.080
HOLDBACK_S = 0.023125


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    chunks: list[tuple[int, int]]  # (new frames, left context) per payload
    sent_at: list[float]
    playback: Playback


def frame(index: int) -> torch.Tensor:
    return (torch.arange(Q) * 100 + index % 97 + 1).reshape(1, Q)


def simulate(
    frame_times: Sequence[float],
    *,
    decode_delay_s: float = 0.010,
    processor: TalkerToCode2WavProcessor | None = None,
    clock: Clock | None = None,
    config: TalkerToCode2WavConfig | None = None,
) -> Run:
    """One stream whose frames are made at ``frame_times`` (seconds from the submit); the
    last frame ends it. Each chunk plays ``new × 80 ms`` (the first one less the decoder's
    hold-back) and reaches the client ``decode_delay_s`` after it was sent."""
    clock = clock if clock is not None else Clock()
    if processor is None:
        processor = TalkerToCode2WavProcessor(config or TalkerToCode2WavConfig(), clock=clock)
    state = processor.new_state()
    chunks: list[tuple[int, int]] = []
    sent_at: list[float] = []
    arrivals: list[tuple[float, float]] = []
    for i, at in enumerate(frame_times):
        clock.now = at
        out = processor.step(state, frame(i), chunk_id=len(chunks), finished=i == len(frame_times) - 1)
        if out is None:
            continue
        assert out.meta is not None
        total = 0 if out.codes is None else out.codes.audio.numel() // Q
        left = out.meta.left_context_size
        new = total - left
        chunks.append((new, left))
        sent_at.append(at)
        audio = new * FRAME_S - (HOLDBACK_S if len(chunks) == 1 else 0.0)
        arrivals.append((at + decode_delay_s, audio))
    return Run(chunks, sent_at, playback_of(arrivals))


def steady(first_s: float, interval_s: float, num_frames: int) -> list[float]:
    return [first_s + i * interval_s for i in range(num_frames)]


# ---------------------------------------------------------------- steady load


@pytest.mark.parametrize("interval_s", [0.010, 0.029, 0.045, 0.066])
def test_a_steady_stream_never_runs_dry_and_its_chunks_grow(interval_s: float) -> None:
    run = simulate(steady(0.1, interval_s, 64))
    assert run.playback.num_underruns == 0, run
    assert sum(new for new, _ in run.chunks) == 64  # every frame sent exactly once
    sizes = [new for new, _ in run.chunks[:-1]]  # the last one is the tail flush
    assert sizes[0] <= 2  # the first chunk is small ...
    # ... and they grow as headroom builds: fast where frames come fast, slowly where
    # every frame takes most of its own 80 ms to make
    assert max(sizes) >= (4 if interval_s > 0.05 else 4 * sizes[0] + 1)
    assert all(new <= 25 for new, _ in run.chunks)  # never above C
    # first audio = the first chunk's frames; playable from that moment on
    assert run.playback.first_playable_s == run.playback.first_audio_s


def test_left_context_is_every_frame_sent_so_far_up_to_lc() -> None:
    run = simulate(steady(0.0, 0.03, 80))
    sent = 0
    for new, left in run.chunks:
        assert left == min(sent, 25)
        sent += new


def test_the_fixed_seed_schedule_runs_dry_where_the_adaptive_one_does_not() -> None:
    times = steady(0.1, 0.029, 64)  # one H200, one stream: ~29 ms per frame
    seed = simulate(
        times, config=TalkerToCode2WavConfig(codec_chunk_adaptive=False, initial_codec_chunk_frames=4)
    )
    adaptive = simulate(times)
    assert seed.chunks[:2] == [(4, 0), (25, 4)]
    # 4 frames play 297 ms; the next 25 take 725 ms to make: the player waits ~0.43 s.
    assert seed.playback.worst_gap_s > 0.4 and not seed.playback.is_gap_free
    assert adaptive.playback.num_underruns == 0
    assert adaptive.playback.first_audio_s is not None and seed.playback.first_audio_s is not None
    assert adaptive.playback.first_audio_s < seed.playback.first_audio_s  # and it starts earlier


def test_fewer_chunks_than_one_per_frame_when_frames_are_fast() -> None:
    run = simulate(steady(0.0, 0.010, 200))
    # at 8x real time the stream banks headroom at once and sends full 25-frame chunks
    assert len(run.chunks) <= 200 // 25 + 4
    assert run.playback.num_underruns == 0


# ---------------------------------------------------------------- jitter and stalls


@pytest.mark.parametrize("seed", range(5))
def test_jittered_frames_stay_gap_free(seed: int) -> None:
    rng = random.Random(seed)
    times, t = [], 0.15
    for _ in range(96):
        times.append(t)
        t += rng.uniform(0.015, 0.075)  # mean 45 ms, spikes to 75 ms
    run = simulate(times, decode_delay_s=0.02)
    assert run.playback.num_underruns == 0, run.playback


def test_a_stall_shorter_than_the_margin_is_not_heard() -> None:
    times = steady(0.1, 0.03, 40)
    stall = 0.12  # a busy GPU holds every frame after the 20th back by 120 ms
    times = times[:20] + [at + stall for at in times[20:]]
    run = simulate(times)
    assert run.playback.num_underruns == 0


def test_after_a_long_stall_the_stream_recovers_with_small_chunks() -> None:
    times = steady(0.1, 0.03, 30)
    times = times[:10] + [at + 1.0 for at in times[10:]]  # a 1 s stall: no margin covers it
    run = simulate(times)
    assert run.playback.num_underruns == 1  # the stall is heard once, not again after it
    after = [new for new, at in zip((n for n, _ in run.chunks), run.sent_at) if at > times[10]]
    assert after[0] <= 2  # the first frame after the stall goes out at once


def test_frames_slower_than_real_time_are_sent_as_they_come() -> None:
    run = simulate(steady(0.0, 0.1, 20))  # 100 ms per 80 ms frame: it cannot keep up
    assert [new for new, _ in run.chunks] == [2] + [1] * 18  # nothing is held back
    assert run.playback.num_underruns > 0  # and the gaps are the machine's, not the schedule's


# ---------------------------------------------------------------- first chunk by load


def test_first_chunk_size_follows_the_edge_frame_interval() -> None:
    cfg = PacingConfig(frame_s=FRAME_S, holdback_s=HOLDBACK_S, max_frames=25)
    quiet, busy, overloaded = FrameRate(), FrameRate(), FrameRate()
    quiet.observe(0.025)
    busy.observe(0.070)
    overloaded.observe(0.5)
    assert StreamPacer(cfg, FrameRate()).first_chunk_frames() == 2  # nothing measured: real time
    assert StreamPacer(cfg, quiet).first_chunk_frames() == 1  # 57 ms of audio > 25 ms + slack
    assert StreamPacer(cfg, busy).first_chunk_frames() == 2  # the second chunk would be late
    assert StreamPacer(cfg, overloaded).first_chunk_frames() == 7
    assert StreamPacer(cfg, quiet, min_first_frames=4).first_chunk_frames() == 4
    assert StreamPacer(cfg, overloaded, min_first_frames=40).first_chunk_frames() == 25


def test_a_later_stream_starts_from_the_edge_rate_its_predecessors_measured() -> None:
    clock = Clock()
    processor = TalkerToCode2WavProcessor(TalkerToCode2WavConfig(), clock=clock)
    simulate(steady(0.0, 0.07, 30), processor=processor, clock=clock)
    assert processor.frame_rate.interval_s == pytest.approx(0.07)
    later = simulate(steady(10.0, 0.07, 30), processor=processor, clock=clock)
    assert later.chunks[0][0] == 2
    assert later.playback.worst_gap_s <= GAP_FREE_MAX_S


def test_pacing_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_frames"):
        PacingConfig(max_frames=0)
    with pytest.raises(ConfigError, match="alpha"):
        PacingConfig(alpha=0.0)


def test_a_fresh_stream_on_a_spiky_edge_starts_with_enough_audio_for_a_spike() -> None:
    """Frames come every 35 ms but every eighth step is a 110 ms one (another request's
    prefill): a one-frame first chunk (57 ms of audio) would run dry in such a step."""

    def spiky(start: float, num_frames: int) -> list[float]:
        times, t = [], start
        for i in range(num_frames):
            times.append(t)
            t += 0.110 if i % 8 == 1 else 0.035
        return times

    clock = Clock()
    processor = TalkerToCode2WavProcessor(TalkerToCode2WavConfig(), clock=clock)
    simulate(spiky(0.0, 40), processor=processor, clock=clock)  # the edge learns its spikes
    assert processor.frame_rate.peak_s is not None and processor.frame_rate.peak_s > 0.08
    later = simulate(spiky(10.0, 40), processor=processor, clock=clock)
    assert later.chunks[0][0] == 2
    assert later.playback.num_underruns == 0

"""``omnirelay bench speech``: Poisson arrivals, the verdict, the command line, and a short
real run on ``qwen3-tts-tiny`` (open loop, leak audit at the end)."""

from __future__ import annotations

import itertools
import shutil
import statistics
from typing import Any

import pytest

from benchmarks.mps import CONTROL
from benchmarks.speech import (
    GAP_FREE_TARGET,
    PLAYABLE_TARGETS_S,
    TEXTS,
    frames_for,
    poisson_arrivals,
    render_speech_bench,
    run_speech_bench,
    targets_met,
)
from omnirelay.cli.main import main


def test_poisson_arrivals_are_seeded_exponential_gaps() -> None:
    times = poisson_arrivals(20.0, 2000, seed=3)
    assert times == poisson_arrivals(20.0, 2000, seed=3) and times != poisson_arrivals(20.0, 2000, seed=4)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and min(gaps) >= 0.0
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20.0, rel=0.15)  # exponential: sd = mean
    with pytest.raises(ValueError, match="rate > 0"):
        poisson_arrivals(0.0, 5, seed=0)


def test_a_request_speaks_as_long_as_its_text() -> None:
    assert frames_for("") == 8  # the floor
    assert frames_for("Thanks!") == 11  # 0.5 s of speech, and 4 frames to spare
    long = max(TEXTS, key=len)
    assert frames_for(long) == pytest.approx(len(long) / 14 * 12.5 + 4, abs=1)


def test_targets_are_judged_on_a_gpu_run_only() -> None:
    def report(device: str, p50: float, share: float) -> dict[str, Any]:
        level = {"rate_per_s": 20.0, "first_playable_s": {"p50": p50}, "gap_free_share": share}
        return {"stage_args": {"talker": {"device": device}}, "rates": [level]}

    assert targets_met(report("cpu", 9.0, 0.0)) == {}
    assert targets_met(report("cuda:0", PLAYABLE_TARGETS_S[20.0], GAP_FREE_TARGET)) == {20.0: True}
    assert targets_met(report("cuda:0", 0.151, 1.0)) == {20.0: False}
    assert targets_met(report("cuda:0", 0.1, 0.98)) == {20.0: False}


def test_cli_wiring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "speech", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--rates" in out and "Poisson" in out and "first playable" in out and "--json" in out
    with pytest.raises(SystemExit, match="numbers like 1,20"):
        main(["bench", "speech", "--rates", "fast"])
    assert "--mps" in out and "--device-groups" in out
    if shutil.which(CONTROL) is None:  # no MPS here: a clear error before any stage starts
        with pytest.raises(SystemExit, match="speech: nvidia-cuda-mps-control is not installed"):
            main(["bench", "speech", "--mps", "--pipeline", "qwen3-tts-tiny"])


def test_a_short_open_loop_run_on_the_tiny_pipeline() -> None:
    # As one device group: every stage of the tiny pipeline in one process, one loop.
    report = run_speech_bench(
        pipeline="qwen3-tts-tiny",
        rates=(4.0,),
        requests=4,
        warmup=1,
        max_frames=6,
        timeout_s=300,
        device_groups="on",
    )
    assert report["ok"], report["audit"]
    assert report["device_groups"] == "on" and len(report["processes"]) == 1
    (level,) = report["rates"]
    assert level["device_busy_share"] is None  # a CPU run: no device to sample
    assert set(level["step_time_share"]) == set(level["step_s"]) and level["step_time_share"]
    assert level["num_requests"] == 4 and level["num_streams"] == 4
    assert level["first_playable_s"]["p50"] > 0 and 0 <= level["gap_free_share"] <= 1
    assert level["audio_s"]["max"] == pytest.approx(6 * 0.08)  # 6 frames of 1920 samples, none held back
    assert report["targets_met"] == {}  # a CPU run
    assert "rate/s" in render_speech_bench(report)

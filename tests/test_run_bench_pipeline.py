"""``omnirelay bench pipeline``: percentiles, the verdict, the command line.

A short real run (two levels on the module pipeline) is in ``test_e2e_qwen_tiny.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.pipeline import (
    FIXED_SCHEDULE,
    GAP_FREE_TARGETS,
    OVERHEAD_TARGET,
    PLAYABLE_TARGETS_S,
    audio_targets_met,
    percentile,
    stream_rtf,
    target_met,
    with_codec_schedule,
)
from omnirelay.cli.main import main
from omnirelay.cli.session import load_run_config
from omnirelay.processors import TalkerToCode2WavConfig
from omnirelay.timeline.request import ClientArrival, RequestTimeline


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0 and percentile(values, 0) == 1.0
    assert percentile([7.0], 99) == 7.0


def test_target_verdict() -> None:
    def report(share: float) -> dict[str, object]:
        return {"levels": [{"concurrency": 1, "overhead_first_audio_share": {"p50": share}}]}

    assert target_met(report(OVERHEAD_TARGET)) is True
    assert target_met(report(OVERHEAD_TARGET + 0.001)) is False
    assert target_met({"levels": []}) is None


def test_cli_wiring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "pipeline", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--concurrency" in out and "--requests" in out and "--json" in out and "10%" in out
    assert "--schedule" in out and "first playable" in out and "gap-free" in out
    with pytest.raises(SystemExit, match="integers like 1,4,16"):
        main(["bench", "pipeline", "--concurrency", "one"])
    with pytest.raises(SystemExit, match="concurrency levels must be >= 1"):
        main(["bench", "pipeline", "--concurrency", "0"])


def _stream(chunks: list[tuple[float, int]]) -> RequestTimeline:
    arrivals = [ClientArrival(at, 2, "audio", 0, n, False, None) for at, n in chunks]
    return RequestTimeline("r", 0.0, arrivals, [], "stop", "", 24000, None, None, None)


def test_real_time_factor_and_what_a_listener_hears() -> None:
    # 0.3 s of audio first, then 2 s chunks 1 s apart: twice as fast as real time, but the
    # second chunk comes 0.7 s after the first one has played out.
    stalls = _stream([(0.2, 7200), (1.2, 48000), (2.2, 48000)])
    assert stream_rtf(stalls) == pytest.approx(0.5)
    heard = stalls.playback
    assert heard.first_audio_s == pytest.approx(0.2) and heard.first_playable_s == pytest.approx(0.9)
    assert heard.num_underruns == 1 and heard.worst_gap_s == pytest.approx(0.7) and not heard.is_gap_free
    smooth = _stream([(0.2, 48000), (1.2, 48000), (2.2, 48000)])
    assert stream_rtf(smooth) == pytest.approx(0.5)
    assert smooth.playback.num_underruns == 0 and smooth.playback.first_playable_s == pytest.approx(0.2)
    assert stream_rtf(_stream([(0.2, 48000)])) == 0.0


def test_gpu_targets_need_first_playable_audio_and_gap_free_streams() -> None:
    def level(conc: int, playable: float, share: float) -> dict[str, object]:
        return {"concurrency": conc, "first_playable_s": {"p50": playable}, "gap_free_share": share}

    levels = [level(1, 0.149, 1.0), level(16, 0.39, 0.98), level(64, 1.01, 1.0), level(4, 9.0, 0.0)]
    report = {"levels": levels, "stage_args": {"thinker": {"device": "cuda:0"}}}
    assert audio_targets_met(report) == {1: True, 16: False, 64: False}
    # The targets are the full-size model's on a GPU: a CPU run is not judged by them.
    assert audio_targets_met({"levels": levels, "stage_args": {"thinker": {"device": "cpu"}}}) == {}
    assert set(PLAYABLE_TARGETS_S) == set(GAP_FREE_TARGETS) == {1, 16, 64}


def test_the_fixed_schedule_is_the_seeds_on_the_codec_edge_only() -> None:
    config = load_run_config("qwen3-omni-tiny")
    assert with_codec_schedule(config, "adaptive") is config
    fixed = with_codec_schedule(config, "fixed")
    extra = fixed.connector_spec("codec_shm").extra
    assert {k: extra[k] for k in FIXED_SCHEDULE} == FIXED_SCHEDULE
    cfg = TalkerToCode2WavConfig.from_extra(extra)
    assert not cfg.codec_chunk_adaptive and cfg.initial_codec_chunk_frames == 4
    assert cfg.codec_left_context_frames == 25
    # ... decoded window by window, as the seed's Code2Wav does; the other stages untouched
    assert [s.executor_args.get("stateful") for s in fixed.stages] == [None, None, False]

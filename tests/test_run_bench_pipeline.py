"""``omnirelay bench pipeline``: percentiles, the verdict, the command line.

A short real run (two levels on the module pipeline) is in ``test_e2e_qwen_tiny.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.pipeline import (
    OVERHEAD_TARGET,
    TTFA_TARGETS_S,
    percentile,
    stream_rtf,
    target_met,
    ttfa_targets_met,
)
from omnirelay.cli.main import main
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
    with pytest.raises(SystemExit, match="integers like 1,4,16"):
        main(["bench", "pipeline", "--concurrency", "one"])
    with pytest.raises(SystemExit, match="concurrency levels must be >= 1"):
        main(["bench", "pipeline", "--concurrency", "0"])


def _stream(chunks: list[tuple[float, int]]) -> RequestTimeline:
    arrivals = [ClientArrival(at, 2, "audio", 0, n, False, None) for at, n in chunks]
    return RequestTimeline("r", 0.0, arrivals, [], "stop", "", 24000, None, None, None)


def test_real_time_factor_and_stalls_of_a_stream() -> None:
    # 0.3 s of audio first, then 2 s chunks 1 s apart: twice as fast as real time, but the
    # second chunk comes after the first one has played out (a stall).
    rtf, stalled = stream_rtf(_stream([(0.2, 7200), (1.2, 48000), (2.2, 48000)]))
    assert rtf == pytest.approx(0.5) and stalled
    rtf, stalled = stream_rtf(_stream([(0.2, 48000), (1.2, 48000), (2.2, 48000)]))
    assert rtf == pytest.approx(0.5) and not stalled
    assert stream_rtf(_stream([(0.2, 48000)])) == (0.0, False)


def test_gpu_targets_need_the_ttfa_and_real_time_streams() -> None:
    def level(conc: int, ttfa: float, rtf_max: float) -> dict[str, object]:
        return {"concurrency": conc, "ttfa_s": {"p50": ttfa}, "rtf": {"max": rtf_max}}

    levels = [level(1, 0.149, 0.4), level(16, 0.351, 0.5), level(64, 0.6, 1.01), level(4, 9.0, 9.0)]
    report = {"levels": levels, "stage_args": {"thinker": {"device": "cuda:0"}}}
    assert ttfa_targets_met(report) == {1: True, 16: False, 64: False}
    # The targets are the full-size model's on a GPU: a CPU run is not judged by them.
    assert ttfa_targets_met({"levels": levels, "stage_args": {"thinker": {"device": "cpu"}}}) == {}
    assert set(TTFA_TARGETS_S) == {1, 16, 64}

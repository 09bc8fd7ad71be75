"""``omnirelay bench pipeline``: percentiles, the verdict, the command line.

A short real run (two levels on the module pipeline) is in ``test_e2e_qwen_tiny.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.pipeline import OVERHEAD_TARGET, percentile, target_met
from omnirelay.cli.main import main


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

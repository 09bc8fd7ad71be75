"""``python -m benchmarks.switches``: variants parsed strictly, each run's JSON read back
into one table, a variant without figures named with how it ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.switches import main, parse_variant, summarize


def test_a_variant_is_a_name_and_environment_pairs() -> None:
    assert parse_variant("base=") == ("base", {})
    assert parse_variant("both=OMNIRELAY_FRAME_COMPILE=1,OMNIRELAY_TAIL_SDPA=1") == (
        "both",
        {"OMNIRELAY_FRAME_COMPILE": "1", "OMNIRELAY_TAIL_SDPA": "1"},
    )
    assert parse_variant("url=X_URL=a=b") == ("url", {"X_URL": "a=b"})  # the value keeps its '='
    for bad in ("base", "=X=1", "../x=X=1", "a=lower=1", "a=X", "a=X=1,junk"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)


def test_the_table_reads_each_bench_and_names_a_run_without_figures(tmp_path: Path) -> None:
    talker = {"batches": {"1": {"step_ms": 7.1, "frame_ms": 3.1, "kernels_per_step": 2011}}}
    (tmp_path / "base.json").write_text(json.dumps(talker))
    runs = [
        {"name": "base", "env": {}, "rc": 0, "wall_s": 1.0},
        {"name": "slow", "env": {"X": "1"}, "rc": None, "wall_s": 9.0},
    ]
    columns, table = summarize("tts-talker", runs, tmp_path)
    assert columns == ("variant", "shape", "step ms", "frame ms", "kernels")
    assert table[0] == ["base", "1 rows", 7.1, 3.1, 2011]
    assert table[1][0] == "slow" and "timed out" in table[1][1]
    speech = {
        "rates": [
            {"rate_per_s": 20.0, "first_playable_s": {"p50": 0.044, "p95": 0.066}, "gap_free_share": 1.0}
        ]
    }
    (tmp_path / "base.json").write_text(json.dumps(speech))
    _, table = summarize("speech", runs[:1], tmp_path)
    assert table == [["base", "20.0/s", 44.0, 66.0, 1.0]]
    runner = {
        "device": "x",
        "thinker": {"decode_1": {"graph_ms": 7.5, "floor_ms": 2.1, "kernels_per_step": 1440}},
    }
    (tmp_path / "base.json").write_text(json.dumps(runner))
    _, table = summarize("runner", runs[:1], tmp_path)
    assert table == [["base", "thinker decode_1", 7.5, 2.1, 1440]]
    pipeline = {
        "levels": [{"concurrency": 16, "first_playable_s": {"p50": 0.11, "p99": 1.2}, "gap_free_share": 1.0}]
    }
    (tmp_path / "base.json").write_text(json.dumps(pipeline))
    columns, table = summarize("pipeline", runs[:1], tmp_path)
    assert columns[3] == "p99 ms" and table == [["base", "c=16", 110.0, 1200.0, 1.0]]


def test_the_command_line_refuses_what_it_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--out", str(tmp_path), "--variant", "a=", "--", "speech", "--json", "x"]) == 2
    assert "without --json" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--variant", "a=", "--variant", "a=X=1", "--", "speech"]) == 2
    assert "must differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--variant", "bad", "--", "speech"])

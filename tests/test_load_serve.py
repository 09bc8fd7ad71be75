"""The load script (benchmarks/load_serve.py), reduced: a live ``omnirelay serve`` of the toy
pipeline, 20 clients that hang up after their first audio and 20 that finish, 8 at a time
against a server limit of 6 (so refusals may happen, each a 429 with Retry-After); then
health, the server's leak audit, a SIGTERM stop with exit 0 and an empty /dev/shm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load_serve import main


def test_reduced_load_leaves_nothing_and_stops_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "load.json"
    argv = ["--pipeline", "toy-3stage", "--disconnect", "20", "--finish", "20", "--concurrency", "8"]
    rc = main([*argv, "--max-concurrency", "6", "--json", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0, printed
    assert report["passed"] and all(report["checks"].values()), printed
    disconnect, finish = report["phases"]
    for phase in (disconnect, finish):
        assert phase["errors"] == {} and phase["served"] + phase["gave_up"] == 20
        assert phase["served"] >= 1
    assert disconnect["refused_without_retry_after"] == finish["refused_without_retry_after"] == 0
    assert report["audit"]["clean"] and report["shm_objects_left"] == [] and report["server_exit_code"] == 0
    assert "every refusal a 429 with Retry-After" in printed and "[FAIL]" not in printed


def test_help_explains_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "hangs up right after its first audio",
        "429 with Retry-After",
        "/health?audit=1",
        "--json",
    ):
        assert needle in text

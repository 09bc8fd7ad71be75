"""A reduced ``omnirelay bench adapter`` run: both processes, both phases, the leak audit and
the report's structure (no timing asserts: targets are judged by the full benchmark)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.adapter_latency import (
    render_adapter_latency,
    render_adapter_runs,
    run_adapter_latency,
    summarize_adapter_runs,
)
from omnirelay.cli.main import main


def test_reduced_adapter_bench_runs_clean() -> None:
    result = run_adapter_latency(n_latency=40, n_hol=20, warmup=5, timeout_s=120.0, log=lambda m: None)
    text = render_adapter_latency(result)
    assert result["ok"], f"{result['error']}\n{text}"
    lat = result["latency"]
    assert lat["adapter_published"]["n"] == 40 and lat["adapter"]["n"] == 40
    assert lat["floor_wake"]["n"] == 40 and lat["raw_connector"]["n"] == 40
    # The floor carries no object: it is below what moving one costs.
    assert lat["floor_wake"]["p50_us"] < lat["raw_connector"]["p50_us"]
    assert "(a) floor: one notice-sized datagram wakes the receiver" in text and "p50 / floor" in text
    # Published on the receive worker before the scheduler thread can drain it.
    assert lat["adapter_published"]["p50_us"] <= lat["adapter"]["p50_us"]
    assert "ready published on the receiver" in text and "leak audit" in text
    assert result["env"]["cpu_probe_s"] > 0 and "cpu probe" in text
    # Every figure says which Python build measured it (the build moves them: README).
    assert result["env"]["interpreter"]["version"] and "\npython: CPython " in text


def _run_result(adapter: float, raw: float, hol_p99: float, *, ok: bool = True) -> dict[str, Any]:
    """The fields of one run_adapter_latency result that the summary reads."""
    return {
        "ok": ok,
        "env": {"cpu_probe_s": 0.5},
        "latency": {
            "adapter_published": {"p50_us": adapter, "p99_us": 2 * adapter},
            "raw_connector": {"p50_us": raw},
            "floor_wake": {"p50_us": raw / 2},
            "overhead_p50_us": adapter - raw,
            "adapter": {"p50_us": adapter + 50},
        },
        "hol": {"added_us": {"p99_us": hol_p99}},
    }


def test_several_runs_are_judged_on_their_medians() -> None:
    summary = summarize_adapter_runs(
        [_run_result(140, 70, 3000), _run_result(200, 100, 4000), _run_result(145, 75, 6000)]
    )
    assert summary["medians"]["adapter_p50_us"] == 145 and summary["medians"]["hol_added_p99_us"] == 4000
    assert summary["ok"] and summary["targets_met"]  # one run over each target does not decide
    text = render_adapter_runs(summary)
    assert "| median |" in text and "targets met" in text and text.count("\n| ") == 5
    assert summary["medians"]["floor_p50_us"] == 37.5
    assert "as multiples of the floor (medians): raw connector 2.00x, adapter 3.87x" in text

    slow = summarize_adapter_runs([_run_result(160, 80, 3000), _run_result(150, 70, 3000)])
    assert (
        slow["ok"]
        and not slow["targets_met"]
        and "adapter p50 <= 150 µs: MISSED" in render_adapter_runs(slow)
    )

    broken = summarize_adapter_runs([_run_result(140, 70, 3000), {"ok": False, "error": "the sender died"}])
    assert not broken["ok"] and not broken["targets_met"]
    assert "FAILED: the sender died" in render_adapter_runs(broken)


def test_runs_must_be_positive() -> None:
    with pytest.raises(SystemExit, match="--runs must be >= 1, got 0"):
        main(["bench", "adapter", "--runs", "0"])

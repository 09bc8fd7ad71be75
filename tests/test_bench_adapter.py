"""A reduced ``omnirelay bench adapter`` run: both processes, both phases, the leak audit and
the report's structure (no timing asserts: targets are judged by the full benchmark)."""

from __future__ import annotations

from omnirelay.bench.adapter_latency import render_adapter_latency, run_adapter_latency


def test_reduced_adapter_bench_runs_clean() -> None:
    result = run_adapter_latency(n_latency=40, n_hol=20, warmup=5, timeout_s=120.0, log=lambda m: None)
    text = render_adapter_latency(result)
    assert result["ok"], f"{result['error']}\n{text}"
    lat = result["latency"]
    assert lat["adapter_published"]["n"] == 40 and lat["adapter"]["n"] == 40
    # Published on the receive worker before the scheduler thread can drain it.
    assert lat["adapter_published"]["p50_us"] <= lat["adapter"]["p50_us"]
    assert "ready published on the receiver" in text and "leak audit" in text

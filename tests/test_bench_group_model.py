"""The virtual-time model of a device group (benchmarks/group_model.py): deterministic, and
on the same arrivals the launched Talker starts audio no later than the synchronous one."""

from __future__ import annotations

from benchmarks.group_model import LAYOUTS, run_model, talker_ms


def test_the_model_is_deterministic_and_the_launch_split_does_not_lose() -> None:
    first = run_model(rate=10.0, duration=4.0, seed=1)
    assert first == run_model(rate=10.0, duration=4.0, seed=1)
    assert set(first) == set(LAYOUTS)
    streams = {r["streams"] for r in first.values()}
    assert len(streams) == 1 and streams.pop() > 10  # the same arrivals for every layout
    sync, launched = first["synchronous"], first["launched"]
    assert launched["first_audio_ms"]["p50"] <= sync["first_audio_ms"]["p50"]
    assert all(0 < r["device_busy_share"] <= 1 for r in first.values())
    assert talker_ms(1) == 8.1 and talker_ms(64) == 18.5 and 8.1 < talker_ms(8) < 13.3

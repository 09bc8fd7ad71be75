"""``scripts/trace_adapter_path.py``: the per-step timeline it builds from the two
processes' marks (the instrumented run itself is a diagnostic, run by hand)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "trace_adapter_path.py"
_spec = importlib.util.spec_from_file_location("trace_adapter_path", _PATH)
assert _spec is not None and _spec.loader is not None
trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace)


def _trial(t0: int, *, put_at: int, commit_at: int) -> tuple[list[Any], list[Any]]:
    sender = [["save_async<", t0], ["put<", t0 + put_at]]
    receiver = [["drain_notices<", t0 + put_at + 5_000], ["commit>", t0 + commit_at]]
    return sender, receiver


def test_timeline_takes_medians_per_step_in_time_order() -> None:
    sender: list[Any] = []
    receiver: list[Any] = []
    # One warm-up trial (skipped), three measured, one more of a later series (left out).
    for i, (put_at, commit_at) in enumerate([(90_000, 900_000), (10_000, 100_000), (20_000, 150_000),
                                              (30_000, 120_000), (1, 2)]):  # fmt: skip
        s, r = _trial(1_000_000 * (i + 1), put_at=put_at, commit_at=commit_at)
        sender += s
        receiver += r
    report = trace.timeline(sender, receiver, raw=False, skip=1, count=3)
    assert report["trials"] == 3
    steps = {row["step"]: row["median_us"] for row in report["steps"]}
    assert steps == {"S save_async<": 0.0, "S put<": 20.0, "R drain_notices<": 25.0, "R commit>": 120.0}
    assert [row["step"] for row in report["steps"]] == [
        "S save_async<",
        "S put<",
        "R drain_notices<",
        "R commit>",
    ]


def test_a_mark_of_the_next_trial_is_not_counted_in_this_one() -> None:
    sender = [["save_async<", 1_000], ["save_async<", 2_000], ["put<", 2_500]]
    receiver: list[Any] = []
    report = trace.timeline(sender, receiver, raw=False, skip=0, count=2)
    steps = {row["step"]: (row["n"], row["median_us"]) for row in report["steps"]}
    assert steps["S put<"] == (1, 0.5)  # only the second trial saw a put

"""``scripts/handoff_microbench.py``: a reduced run of each hand-off series (the timing
itself is judged by hand, never here): every hand-off ran its task, on the worker, and left
no worker behind."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "handoff_microbench.py"
_spec = importlib.util.spec_from_file_location("handoff_microbench", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("kind", ["SimpleQueue", "LaneExecutor"])
def test_each_series_measures_every_hand_off_and_stops_its_worker(kind: str) -> None:
    before = {t.ident for t in threading.enumerate()}
    handoff, caller = bench._series(kind, 50)
    assert len(handoff) == len(caller) == 50 - 50 // 10  # the first tenth is warm-up
    assert all(x > 0 for x in handoff) and all(x > 0 for x in caller)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before

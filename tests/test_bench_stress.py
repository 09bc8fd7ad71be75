"""A reduced ``omnirelay bench stress`` run: two processes, cancels, reuse, early stops, leak audit."""

from __future__ import annotations

import pytest

from benchmarks.stress import render_stress, run_stress


@pytest.fixture(scope="module")
def report() -> dict:
    return run_stress(requests=120, chunks=9, cancel_fraction=0.15, seed=7, big_fraction=0.02, timeout_s=50.0)


def test_reduced_stress_run_passes_every_check(report: dict) -> None:
    text = render_stress(report)
    assert report["ok"], f"{report['error']}\n{text}"
    assert all(report["checks"].values()), text
    assert "RESULT: OK" in text


def test_counts_add_up(report: dict) -> None:
    c, plan = report["counts"], report["plan"]
    assert c["sent"] >= 1000  # transfers
    assert c["sent"] <= c["admitted"]
    assert c["sent"] == (
        c["consumed"]
        + c["reclaimed_exact_key_cleanup"]
        + c["reclaimed_prefix_after_cancel"]
        + c["reclaimed_prefix_after_early_stop"]
    )
    assert c["cancelled_unread"] == c["reclaimed_exact_key_cleanup"] + c["reclaimed_prefix_after_cancel"]
    assert c["cancelled"] == plan["cancelled"] >= 0.1 * report["config"]["requests"]
    assert c["reused_ids"] == plan["reused"] == c["completed_reused"] > 0
    assert c["early_stopped"] == plan["early_stop"] > 0 and c["early_stop_unread"] > 0
    assert c["completed"] - c["completed_then_cancelled"] == plan["complete"] + plan["reused"]
    assert sum(c["cancelled_by_phase_planned"].values()) == c["cancelled"]
    assert set(c["cancelled_by_phase_planned"]) == {"before", "during", "after"}
    assert c["sent_big"] > 0 and c["delivered_big"] > 0
    assert c["left_unaccounted"] == 0


def test_leak_audit_is_clean(report: dict) -> None:
    audit = report["audit"]
    for side in ("producer", "consumer"):
        a = audit[side]
        assert a["num_pending_keys"] == 0 and a["pending_keys"] == []
        assert a["leak_state"] == {}
        assert a["live_bytes"] == 0 and a["num_adapter_errors"] == 0 and a["is_flushed"]
    assert audit["producer"]["live_objects"] == []
    assert audit["objects_after_exit"] == []
    assert report["failures"] == [] and report["problems"] == []

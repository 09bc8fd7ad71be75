"""The id-reuse fence and the requests parked behind it, as pure books: no process, no
loop (the orchestrator's use of it is in test_orchestrator_units.py)."""

from __future__ import annotations

import pytest

from omnirelay.orchestrator.fence import IdFence, Sweep


def test_a_parked_reuse_comes_back_with_the_last_release_only() -> None:
    fence: IdFence[str] = IdFence()
    for worker in (0, 1, 2):
        fence.hold("R", worker)
    fence.park("R", "the reuse")
    assert fence.is_fenced("R") and fence.is_parked("R") and fence.parked_ids() == ["R"]
    assert fence.lift(2, "R") == []
    assert fence.lift(2, "R") == []  # a duplicate release changes nothing
    assert fence.lift(7, "R") == []  # nor does one from a worker never told to release
    assert fence.lift(0, "other") == []  # nor one of an id never fenced
    assert fence.holds(0, "R") and fence.holds(1, "R") and not fence.holds(2, "R")
    assert fence.lift(0, "R") == []
    assert fence.lift(1, "R") == ["the reuse"]
    assert fence.is_empty and not fence.is_fenced("R")


def test_an_id_without_a_parked_request_simply_unfences() -> None:
    fence: IdFence[str] = IdFence()
    fence.hold("R", 0)
    assert fence.fenced_ids() == ["R"]
    assert fence.lift(0, "R") == [] and fence.is_empty


def test_a_dead_worker_lifts_its_fences_and_hands_back_what_they_freed() -> None:
    fence: IdFence[str] = IdFence()
    for rid in ("A", "B", "C"):
        fence.hold(rid, 1)
    fence.hold("B", 0)  # B also waits for worker 0
    for rid in ("A", "B", "C"):
        fence.park(rid, f"reuse of {rid}")
    assert fence.worker_died(1) == ["reuse of A", "reuse of C"]  # the order they were fenced
    assert fence.fenced_ids() == ["B"] and fence.parked_ids() == ["B"]
    assert fence.lift(0, "B") == ["reuse of B"] and fence.is_empty


def test_a_swept_later_death_passes_the_fences_to_its_sweep() -> None:
    fence: IdFence[str] = IdFence()
    fence.hold("held", 1)
    fence.park("held", "reuse of held")
    # ``ended``: the requests its death ended; a rerun of one is parked behind the sweep.
    assert fence.worker_died(1, ended=["ended"], swept_later=True) == []
    fence.park("ended", "rerun of ended")
    assert not fence.holds(1, "held")  # the dead worker's own fence is gone...
    assert fence.holds(Sweep(1), "held") and fence.holds(Sweep(1), "ended")  # ...its sweep's holds
    assert fence.swept(0) == []  # another worker's sweep lifts nothing here
    assert sorted(fence.swept(1)) == ["rerun of ended", "reuse of held"]
    assert fence.is_empty


def test_the_sweep_marker_is_its_own_type_never_a_worker_index() -> None:
    fence: IdFence[str] = IdFence()
    fence.hold("R", Sweep(0))
    assert not fence.holds(0, "R") and not fence.holds(-1, "R")
    assert fence.lift(0, "R") == [] and fence.is_fenced("R")
    assert Sweep(0) == Sweep(0) and Sweep(0) != Sweep(1)


def test_aborting_or_draining_parked_requests_keeps_the_fences() -> None:
    fence: IdFence[str] = IdFence()
    for rid in ("A", "B"):
        fence.hold(rid, 0)
        fence.park(rid, f"reuse of {rid}")
    assert fence.unpark("A") == "reuse of A" and fence.unpark("A") is None
    assert fence.drain() == [("B", "reuse of B")]
    assert fence.parked_ids() == [] and fence.fenced_ids() == ["A", "B"]
    assert fence.lift(0, "A") == []  # nothing parked behind it any more
    fence.lift(0, "B")
    assert fence.is_empty


def test_parking_what_cannot_wait_is_refused() -> None:
    fence: IdFence[str] = IdFence()
    with pytest.raises(ValueError, match="not fenced"):
        fence.park("R", "x")
    fence.hold("R", 0)
    fence.park("R", "x")
    with pytest.raises(ValueError, match="already parked"):
        fence.park("R", "y")
    assert fence.lift(0, "R") == ["x"]  # the first one is kept

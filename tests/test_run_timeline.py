"""The critical-path walk of ``omnirelay run`` / ``bench pipeline`` on hand-built timelines.

Each case builds the steps three stages reported (times in ms, as the engine's clock
would give them) and checks which steps the walk puts on the path and how the wall time
splits: ``compute + sum(segments) == wall`` always, to the nanosecond. A step's model
compute is its executor call's wall time (what the stages' step recorder measures).
"""

from __future__ import annotations

import pytest

from omnirelay.engine.interfaces import StageOutput
from omnirelay.timeline import (
    SEGMENTS,
    StageEvent,
    StageTrace,
    Step,
    critical_path,
    step_of,
)

UP = {0: None, 1: 0, 2: 1}
MS = 1e-3


def step(stage: int, start: float, end: float, inp: float | None = None, arrival: float = 0.0) -> Step:
    return Step(
        stage_id=stage,
        start_s=start * MS,
        end_s=end * MS,
        input_time_s=None if inp is None else inp * MS,
        arrival_s=arrival * MS,
    )


def events(*steps: Step) -> list[StageEvent]:
    return [StageEvent(s.stage_id, (1,), 0, False, None, s) for s in steps]


def check_sum(cp) -> None:  # type: ignore[no-untyped-def]
    assert cp.compute_s + sum(cp.segments.values()) == pytest.approx(cp.wall_s, abs=1e-12)
    assert all(v >= -1e-12 for v in cp.segments.values())
    assert set(cp.segments) == set(SEGMENTS)


def test_consumer_waiting_for_chunks_puts_the_producer_on_the_path() -> None:
    t0 = step(0, 1, 5, arrival=0.5)  # prefill
    t1 = step(0, 6, 8, arrival=0.5)  # produces chunk 0 (ends at 8)
    k0 = step(1, 9, 20, inp=8.5, arrival=0.6)  # waited for chunk 0 (arrived 8.5)
    k1 = step(1, 21, 31)  # chunk already there: gated by its own previous step
    c0 = step(2, 32, 36, inp=31.4, arrival=0.7)
    ev = events(t0, t1, k0, k1, c0)
    cp = critical_path(ev, submit_s=0.0, target_s=37 * MS, target_stage=2, target_step=c0, upstream=UP)
    check_sum(cp)
    assert cp.path == [t0, t1, k0, k1, c0]
    assert cp.compute_s == pytest.approx((4 + 2 + 11 + 10 + 4) * MS)  # the steps' calls
    seg = {k: round(v / MS, 6) for k, v in cp.segments.items()}
    assert seg["submit"] == 0.5 and seg["admit"] == 0.5
    assert seg["schedule"] == 1 + 1  # t0 -> t1, k0 -> k1
    assert seg["transfer"] == 0.5 + 0.4  # t1 end -> chunk at 8.5; k1 end -> chunk at 31.4
    assert seg["wake"] == 0.5 + 0.6
    assert seg["deliver"] == 1
    assert cp.overhead_s == pytest.approx(6 * MS)
    assert cp.compute_by_stage() == pytest.approx({0: 6 * MS, 1: 21 * MS, 2: 4 * MS})


def test_producer_is_the_latest_upstream_step_before_the_arrival() -> None:
    t = [step(0, 0, 2), step(0, 2, 4), step(0, 4, 6)]
    k0 = step(1, 5, 9, inp=4.5)  # the chunk of t[1] (ended at 4) arrived at 4.5
    cp = critical_path(
        events(*t, k0), submit_s=0.0, target_s=9 * MS, target_stage=1, target_step=k0, upstream=UP
    )
    check_sum(cp)
    assert cp.path == [t[0], t[1], k0]


def test_a_first_step_that_found_its_chunk_waiting_is_gated_by_its_admission() -> None:
    t0 = step(0, 0.5, 2, arrival=0.2)
    k0 = step(1, 8, 10, arrival=7)  # admitted late (7 ms): the chunk was already there
    cp = critical_path(
        events(t0, k0), submit_s=0.0, target_s=10 * MS, target_stage=1, target_step=k0, upstream=UP
    )
    check_sum(cp)
    assert cp.path == [k0]
    assert cp.segments["submit"] == pytest.approx(7 * MS) and cp.segments["admit"] == pytest.approx(1 * MS)


def test_a_forwarded_stage_waits_for_the_upstream_s_last_step() -> None:
    t = [step(0, 0, 2), step(0, 2, 4)]
    k0 = step(1, 5, 6, arrival=4.5)
    cp = critical_path(
        events(*t, k0),
        submit_s=0.0,
        target_s=6 * MS,
        target_stage=1,
        target_step=k0,
        upstream=UP,
        forwarded=frozenset({1}),
    )
    check_sum(cp)
    assert cp.path == [*t, k0] and cp.segments["forward"] == pytest.approx(1 * MS)


def test_an_output_made_by_no_step_starts_from_the_latest_step_before_it() -> None:
    k = [step(1, 0, 4), step(1, 4, 8)]
    c0 = step(2, 5, 6, inp=4.2)
    # The empty terminal of stage 2 came after the Talker's last step (8 ms): that step
    # (its terminal chunk) is what the end waited for.
    cp = critical_path(
        events(*k, c0), submit_s=0.0, target_s=9 * MS, target_stage=2, target_step=None, upstream=UP
    )
    check_sum(cp)
    assert cp.path == k and cp.segments["deliver"] == pytest.approx(1 * MS)


def test_a_batched_step_counts_whole_on_the_path() -> None:
    # A request in a batch of four waited for the whole call, not its quarter share.
    s = Step(stage_id=0, start_s=0.0, end_s=1 * MS, input_time_s=None, item_compute_s=0.25 * MS)
    cp = critical_path(events(s), submit_s=0.0, target_s=1 * MS, target_stage=0, target_step=s, upstream=UP)
    check_sum(cp)
    assert cp.compute_s == pytest.approx(1 * MS) and cp.overhead_s == pytest.approx(0.0)


def test_step_of_reads_the_engine_metrics() -> None:
    assert step_of(0, {"num_steps": 1.0}) is None  # a final output's own metrics: no step
    s = step_of(
        2,
        {
            "arrival_s": 1.0,
            "step_start_s": 2.0,
            "step_end_s": 3.0,
            "item_compute_s": 0.25,
            "input_time_s": 1.5,
        },
    )
    assert s == Step(2, 2.0, 3.0, 1.5, item_compute_s=0.25, arrival_s=1.0)


def test_stage_trace_keeps_only_watched_requests() -> None:
    trace = StageTrace()
    trace.watch("a")
    trace(StageOutput(request_id="a", stage_id=1, token_ids=[5]))
    trace(StageOutput(request_id="b", stage_id=1, token_ids=[6]))
    assert trace.num_watched == 1
    (event,) = trace.take("a")
    assert event.stage_id == 1 and event.token_ids == (5,) and event.step is None
    assert trace.take("a") == [] and trace.num_watched == 0


def test_the_timeline_package_exports_what_it_lists() -> None:
    import omnirelay.timeline as timeline

    assert sorted(timeline.__all__) == sorted(set(timeline.__all__))
    for name in timeline.__all__:
        assert getattr(timeline, name) is not None, name
    assert {"StageTrace", "StepRecorder", "critical_path", "drive_request"} <= set(timeline.__all__)

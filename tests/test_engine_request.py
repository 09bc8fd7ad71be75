"""The request lifecycle: the transition table and the named methods that enforce it."""

from __future__ import annotations

import itertools

import pytest

from omnirelay.engine import (
    ALLOWED_TRANSITIONS,
    FINISHED_STATUSES,
    IllegalTransitionError,
    Request,
    RequestStatus,
    SamplingParams,
)
from omnirelay.engine.request import make_internal_id

S = RequestStatus


def _request(**kw: object) -> Request:
    args: dict[str, object] = {
        "internal_id": "r@s0.1",
        "external_id": "r",
        "stage_id": 0,
        "prompt_token_ids": [1, 2, 3],
        "sampling": SamplingParams(),
        "arrival_time": 0.0,
    }
    args.update(kw)
    return Request(**args)  # type: ignore[arg-type]


def _in(status: RequestStatus) -> Request:
    """A request brought to ``status`` through legal transitions only."""
    r = _request()
    if status is S.WAITING:
        return r
    if status is S.WAITING_FOR_CHUNK:
        r.park_for_chunk()
        return r
    r.start_running(1.0)
    if status is S.RUNNING:
        return r
    if status is S.PREEMPTED:
        r.preempt()
        return r
    r.finish(status, 2.0)
    return r


#: How each named method moves a request, applied to a request in a given status.
_EVENTS = {
    "start_running": lambda r: r.start_running(5.0),
    "park_for_chunk": lambda r: r.park_for_chunk(),
    "unpark": lambda r: r.unpark(),
    "preempt": lambda r: r.preempt(),
    **{
        f"finish:{s.name}": (lambda r, s=s: r.finish(s, 5.0))
        for s in sorted(FINISHED_STATUSES, key=lambda s: s.name)
    },
    "finish:RUNNING": lambda r: r.finish(S.RUNNING, 5.0),
}


def test_table_covers_every_status_and_finished_statuses_are_terminal() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(RequestStatus)
    for s in FINISHED_STATUSES:
        assert ALLOWED_TRANSITIONS[s] == frozenset()
        assert s.is_finished and s.finish_reason in {"stop", "length", "abort", "error"}
    for s in set(RequestStatus) - FINISHED_STATUSES:
        assert not s.is_finished and s.finish_reason is None
        assert ALLOWED_TRANSITIONS[s] >= FINISHED_STATUSES, f"{s} cannot be aborted or failed"


@pytest.mark.parametrize(("status", "event"), list(itertools.product(list(RequestStatus), list(_EVENTS))))
def test_every_named_method_obeys_the_table(status: RequestStatus, event: str) -> None:
    r = _in(status)
    before = r.status
    try:
        _EVENTS[event](r)
    except IllegalTransitionError as exc:
        assert r.status is before, "a refused transition must not change the status"
        assert r.internal_id in str(exc)
        return
    assert r.status in ALLOWED_TRANSITIONS[before], (
        f"{event}: {before.name} -> {r.status.name} not in the table"
    )


def test_the_legal_paths() -> None:
    r = _request()
    r.park_for_chunk()  # a prewarmed placeholder waits for its first chunk
    assert r.status is S.WAITING_FOR_CHUNK and r.parked_from is S.WAITING and not r.holds_slot
    r.attach_ar_chunk({"x": 1}, is_finished=False)
    r.unpark()
    assert r.status is S.WAITING and r.parked_from is None and r.has_ready_chunk
    r.start_running(1.0)
    assert r.status is S.RUNNING and r.first_scheduled_time == 1.0 and r.holds_slot
    r.has_ready_chunk = False
    r.park_for_chunk()  # parked from RUNNING keeps its slot
    assert r.parked_from is S.RUNNING and r.holds_slot
    r.unpark()
    assert r.status is S.RUNNING
    r.num_steps = 1
    r.preempt()
    assert r.status is S.PREEMPTED and r.num_computed_tokens == 0 and r.is_recompute
    r.start_running(2.0)
    assert r.first_scheduled_time == 1.0
    r.finish(S.FINISHED_LENGTH, 3.0)
    assert r.is_finished and r.finished_time == 3.0 and r.status.finish_reason == "length"


def test_illegal_transitions_raise_with_a_clear_message() -> None:
    r = _in(S.FINISHED_STOPPED)
    with pytest.raises(IllegalTransitionError, match=r"FINISHED_STOPPED -> WAITING_FOR_CHUNK.*terminal"):
        r.park_for_chunk()
    with pytest.raises(AssertionError, match="start_running needs status WAITING or PREEMPTED, got RUNNING"):
        _in(S.RUNNING).start_running(1.0)
    with pytest.raises(IllegalTransitionError, match="unpark while RUNNING"):
        _in(S.RUNNING).unpark()
    with pytest.raises(IllegalTransitionError, match="preempt needs status RUNNING"):
        _in(S.WAITING).preempt()
    with pytest.raises(IllegalTransitionError, match="needs a FINISHED_"):
        _in(S.RUNNING).finish(S.WAITING, 1.0)
    ready = _request()
    ready.attach_ar_chunk({}, is_finished=False)
    with pytest.raises(IllegalTransitionError, match="parked with a ready chunk"):
        ready.park_for_chunk()


def test_generation_chunk_replaces_the_prompt_and_resets_computed() -> None:
    r = _request(prompt_token_ids=[0, 0], is_placeholder=True)
    r.num_computed_tokens = 2
    r.attach_generation_chunk([7, 8, 9], {"codes": {}}, is_finished=True)
    assert r.prompt_token_ids == [7, 8, 9] and r.num_computed_tokens == 0
    assert (
        r.is_upstream_exhausted and r.num_chunks_received == 1 and r.additional_information == {"codes": {}}
    )


def test_internal_ids_carry_the_external_id_and_a_stage_local_suffix() -> None:
    assert make_internal_id("req-1", 2, 7) == "req-1@s2.7"
    snap = _request().snapshot((4,))
    assert snap.all_token_ids == (1, 2, 3) and snap.new_token_ids == (4,) and not snap.is_finished

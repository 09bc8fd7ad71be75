"""Unit tests of the transfer adapter's parts: config, keys, the chunk envelope, the
generation token's transition table, lanes, budget, events, and the public surface."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import omnirelay.transfer as transfer
from omnirelay.connectors.base import validate_key
from omnirelay.errors import ConfigError, PayloadEncodeError
from omnirelay.ids import MAX_REQUEST_ID_LEN, request_id_problem
from omnirelay.payload import Codes, Meta, OmniPayload, decode, encode
from omnirelay.transfer import (
    ByteBudget,
    CancelAction,
    LaneExecutor,
    SenderGeneration,
    StallTimeoutDisabledWarning,
    TransferConfig,
    key_prefix,
    make_key,
)
from omnirelay.transfer.envelope import ChunkEnvelope, check_envelope
from omnirelay.transfer.events import EventBox, FailureKind, SaveResult, TransferFailure
from omnirelay.transfer.keys import IdMap
from tests.transfer_fakes import (
    GATE_TIMEOUT_S,
    Gate,
    collect,
    make_pipeline,
    ready_for,
    wait_until,
)

# --------------------------------------------------------------------- config


def test_config_defaults() -> None:
    c = TransferConfig(stage_id=1, send_to_stage=2, receive_from_stage=0)
    assert c.stall_timeout_s == 600.0 and c.is_sender and c.is_receiver
    assert not TransferConfig(stage_id=0).is_receiver


def test_zero_stall_timeout_warns() -> None:
    with pytest.warns(StallTimeoutDisabledWarning, match="disabled"):
        TransferConfig(stage_id=0, stall_timeout_s=0)


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, "600", True, None, [600]])
def test_bad_stall_timeouts_are_rejected(value: Any) -> None:
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        TransferConfig(stage_id=0, stall_timeout_s=value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stage_id", -1),
        ("stage_id", 1.0),
        ("send_to_stage", 0),
        ("receive_from_stage", 0),
        ("edge_budget_bytes", 0),
        ("backpressure_wait_s", -1),
        ("num_send_workers", 0),
        ("num_recv_workers", 0),
        ("arrival_wait_s", 0),
        ("fallback_poll_s", math.inf),
        ("reap_interval_s", "fast"),
        ("max_undrained_failures", False),
    ],
)
def test_bad_config_values_name_the_field(field: str, value: Any) -> None:
    kw: dict[str, Any] = {"stage_id": 0, field: value}
    with pytest.raises(ConfigError, match=field):
        TransferConfig(**kw)


def test_config_from_mapping_rejects_unknown_keys() -> None:
    assert TransferConfig.from_mapping({"stage_id": 2, "receive_from_stage": 1}).receive_from_stage == 1
    with pytest.raises(ConfigError, match="stall_timeout"):
        TransferConfig.from_mapping({"stage_id": 0, "stall_timeout": 5})
    with pytest.raises(ConfigError, match="stage_id"):
        TransferConfig.from_mapping({})
    # How a chunk is read is the consuming stage's business, not a transfer setting.
    with pytest.raises(ConfigError, match="receiver_kind"):
        TransferConfig.from_mapping({"stage_id": 1, "receive_from_stage": 0, "receiver_kind": "generation"})


# --------------------------------------------------------------------- keys


def test_keys_and_ids() -> None:
    assert make_key("req-1", 1, 0) == "req-1_1_0"
    assert key_prefix("task", 1) == "task_1_"
    assert make_key("task_1", 1, 0) != make_key("task", 1, 10)  # "task_1_1_0" vs "task_1_10"
    assert request_id_problem("ok") is None
    assert "empty" in str(request_id_problem(""))
    assert "the limit is 256" in str(request_id_problem("x" * 9000))
    # The longest usable id (4 UTF-8 bytes a character) still forms a key the connectors take.
    longest = "\U0001f44d" * MAX_REQUEST_ID_LEN
    assert request_id_problem(longest) is None
    assert validate_key(make_key(longest, 10**6, 10**19))
    m = IdMap()
    m.set("i", "E")
    assert m.get("i") == "E" and len(m) == 1 and m.pop("i") == "E" and m.pop("i") is None


# --------------------------------------------------------------------- chunk envelope


@pytest.mark.parametrize(
    "envelope",
    [
        ChunkEnvelope(body={"codes": {"audio": torch.arange(4)}}),
        ChunkEnvelope(body=OmniPayload(codes=Codes(audio=torch.arange(4)), meta=Meta(left_context_size=2))),
        ChunkEnvelope(is_finished=True),  # the end of the stream, nothing new
        ChunkEnvelope(body=[1, 2], is_segment_finished=True),
    ],
)
def test_envelope_round_trips_the_codec_with_its_flags_and_an_opaque_body(envelope: ChunkEnvelope) -> None:
    assert check_envelope(envelope) is None
    back = decode(encode(envelope))
    assert type(back) is ChunkEnvelope and check_envelope(back) is None
    assert (back.is_finished, back.is_segment_finished) == (
        envelope.is_finished,
        envelope.is_segment_finished,
    )
    assert type(back.body) is type(envelope.body)
    assert encode(back) == encode(envelope)


@pytest.mark.parametrize(
    ("obj", "problem"),
    [
        ({"meta": {"finished": True}}, "expected a ChunkEnvelope, got dict"),
        (None, "expected a ChunkEnvelope, got NoneType"),
        (ChunkEnvelope(body=1, is_finished=1), "is_finished must be a bool, got int"),
        (
            ChunkEnvelope(body=1, is_segment_finished=torch.tensor([True])),
            "is_segment_finished must be a bool, got Tensor",
        ),
        (ChunkEnvelope(), "carries nothing"),
        (ChunkEnvelope(is_segment_finished=False), "carries nothing"),
    ],
)
def test_check_envelope_says_what_is_wrong(obj: Any, problem: str) -> None:
    reason = check_envelope(obj)
    assert reason is not None and problem in reason


def test_a_flag_that_is_not_a_bool_never_reaches_the_wire() -> None:
    with pytest.raises(PayloadEncodeError, match="is_finished"):
        encode(ChunkEnvelope(body=1, is_finished=torch.tensor([True, False])))


# --------------------------------------------------------------------- generation token (docs/protocol.md §4.5 table)


def _gen(**flags: Any) -> SenderGeneration:
    g = SenderGeneration("R", "r")
    for k, v in flags.items():
        setattr(g, k, v)
    return g


def test_generation_transition_table() -> None:
    # admit terminal: sets the fence
    g = _gen()
    g.admit(is_terminal=True, is_segment_end=False, confirmed=None)
    assert g.terminal_pending and g.is_terminal_admitted
    # admit while draining / failed / after terminal: refused by precondition
    for bad in (_gen(cancelled=True), _gen(has_failed=True), _gen(is_terminal_admitted=True)):
        with pytest.raises(AssertionError):
            bad.admit(is_terminal=False, is_segment_end=False, confirmed=None)
    # task start: current ∧ ¬failed ∧ (terminal ∨ ¬cancelled)
    assert _gen().may_run(is_terminal=False)
    assert not _gen(cancelled=True).may_run(is_terminal=False)
    assert _gen(cancelled=True).may_run(is_terminal=True)
    assert not _gen(has_failed=True).may_run(is_terminal=True)
    g = _gen()
    g.start()
    assert g.in_flight
    with pytest.raises(AssertionError):
        g.start()
    # before put counts the in-flight key
    g = _gen(in_flight=True, num_sent=3)
    assert g.before_put() == 3 and g.num_puts == 4
    with pytest.raises(AssertionError):
        _gen().before_put()
    # put ok: terminal → terminal_sent; honored unless cancelled non-terminal w/o pending terminal
    g = _gen(in_flight=True)
    assert g.put_succeeded(is_terminal=True) and g.terminal_sent and g.num_sent == 1
    g = _gen(in_flight=True, cancelled=True)
    assert not g.put_succeeded(is_terminal=False) and g.num_sent == 0
    g = _gen(in_flight=True, cancelled=True, terminal_pending=True)
    assert g.put_succeeded(is_terminal=False) and g.num_sent == 1  # terminal takes the next key
    # cleanup_sender rows
    g = _gen(terminal_pending=True)
    assert g.cancel() is CancelAction.DEFER and g.cancelled and g.cleanup_deferred
    g = _gen(in_flight=True)
    assert g.cancel() is CancelAction.WAIT and g.cancelled and not g.cleanup_deferred
    assert _gen().cancel() is CancelAction.RETIRE
    # terminal task ends: releases the fence, reports a deferred cleanup once
    g = _gen(terminal_pending=True, cleanup_deferred=True)
    assert g.end_terminal() and not g.terminal_pending and not g.cleanup_deferred
    with pytest.raises(AssertionError):
        g.end_terminal()
    # any task finally: retire iff cancelled ∧ ¬terminal_pending
    assert _gen(in_flight=True, cancelled=True).end_task()
    assert not _gen(in_flight=True, cancelled=True, terminal_pending=True).end_task()
    assert not _gen(in_flight=True).end_task()
    # cleanup keys: exact count, never a successful terminal, always a failed one
    assert _gen(num_puts=3).keys_to_clean() == 3
    assert _gen(num_puts=3, terminal_sent=True).keys_to_clean() == 0
    assert _gen(num_puts=0).keys_to_clean() == 0
    with pytest.raises(AssertionError):
        _gen(in_flight=True, num_puts=1).keys_to_clean()


def test_generation_watermark_and_segments() -> None:
    g = _gen()
    g.admit(is_terminal=False, is_segment_end=False, confirmed=7)
    assert g.watermark == 7
    g.admit(is_terminal=False, is_segment_end=True, confirmed=9)
    assert g.watermark is None and g.segment_generation == 1


# --------------------------------------------------------------------- lanes


def test_lanes_serial_per_lane_parallel_across_lanes() -> None:
    errors: list[BaseException] = []
    lanes = LaneExecutor("t", 2, on_error=errors.append)
    lanes.start()
    try:
        gate = Gate("lane A")
        order: list[str] = []
        lanes.submit("A", gate.enter)
        lanes.submit("A", lambda: order.append("A1"))
        gate.wait_started()
        done_b = threading.Event()
        lanes.submit("B", lambda: (order.append("B0"), done_b.set()))
        assert done_b.wait(10)  # B ran while A's first task was blocked
        assert order == ["B0"]  # A's second task waits for A's first
        gate.release()
        assert lanes.wait_idle(10)
        assert order == ["B0", "A1"] and lanes.lanes() == [] and errors == []
        lanes.submit("C", lambda: 1 / 0)
        assert lanes.wait_idle(10)
        assert len(errors) == 1 and isinstance(errors[0], ZeroDivisionError)
    finally:
        assert lanes.stop(5) == []
    assert lanes.stop(5) == []  # idempotent
    assert not lanes.submit("A", lambda: None)


def test_lanes_keep_submission_order_under_load() -> None:
    lanes = LaneExecutor("t", 4, on_error=lambda e: None)
    lanes.start()
    seen: dict[int, list[int]] = {k: [] for k in range(8)}
    for i in range(400):
        lanes.submit(i % 8, lambda i=i: seen[i % 8].append(i))
    assert lanes.wait_idle(10)
    lanes.stop(5)
    for k, values in seen.items():
        assert values == list(range(k, 400, 8))


class _Arrivals:
    """A source for a LaneExecutor: blocks until the test feeds one batch of (lane, task,
    now) items, submits them (``now``: runs them with ``run_now``, after the others), and
    records which thread ran each pass."""

    def __init__(self) -> None:
        self.lanes: LaneExecutor | None = None
        self._cv = threading.Condition()
        self._batches: list[list[tuple[str, Any, bool]]] = []
        self.passes: list[int] = []  # thread ident of each pass that got a batch
        self.num_waiting = 0

    def feed(self, *items: tuple[str, Any, bool]) -> None:
        with self._cv:
            self._batches.append(list(items))
            self._cv.notify_all()

    def wait_listening(self, n: int) -> None:
        """Until ``n`` passes have run and a worker waits in the source again."""
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.passes) >= n and self.num_waiting, 10)

    def __call__(self) -> None:
        assert self.lanes is not None
        with self._cv:
            self.num_waiting += 1
            self._cv.notify_all()  # wait_listening watches num_waiting
            self._cv.wait_for(lambda: bool(self._batches), 0.05)
            self.num_waiting -= 1
            if not self._batches:
                return
            batch = self._batches.pop(0)
            self.passes.append(threading.get_ident())
            self._cv.notify_all()
        for lane, task, now in batch:
            if not now:
                self.lanes.submit(lane, task)
        for lane, task, now in batch:
            if now:
                self.lanes.run_now(lane, lambda t: t(), task)


def _leader_pool(n: int = 2) -> tuple[LaneExecutor, _Arrivals, list[BaseException]]:
    errors: list[BaseException] = []
    src = _Arrivals()
    lanes = LaneExecutor("t", n, on_error=errors.append, source=src)
    src.lanes = lanes
    lanes.start()
    return lanes, src, errors


def test_a_task_run_now_runs_on_the_leader_which_keeps_the_lead() -> None:
    lanes, src, errors = _leader_pool()
    try:
        gate = Gate("task run now")
        ran_on: list[int] = []
        src.feed(("A", lambda: (ran_on.append(threading.get_ident()), gate.enter()), True))
        gate.wait_started()
        # The leader runs it itself: same thread as the pass that submitted it.
        assert ran_on == [src.passes[0]]
        # It kept the lead: a batch fed now waits until that task is done, and the same
        # thread then takes it (no follower was handed the lead meanwhile).
        src.feed(("B", lambda: ran_on.append(threading.get_ident()), False))
        gate.release()
        src.wait_listening(2)
        assert lanes.wait_idle(10)
        assert src.passes == [src.passes[0]] * 2 and ran_on == [src.passes[0]] * 2
        assert errors == [] and lanes.lanes() == []
    finally:
        assert lanes.stop(5) == []


def test_a_task_that_is_not_inline_hands_the_lead_to_a_follower() -> None:
    lanes, src, errors = _leader_pool()
    try:
        gate = Gate("long task")
        src.feed(("A", gate.enter, False))
        gate.wait_started()
        # While A's task blocks its worker, the other worker listens: B is dispatched and runs.
        done_b = threading.Event()
        src.feed(("B", done_b.set, False))
        assert done_b.wait(10)
        assert len(set(src.passes)) == 2  # the second pass ran on the follower
        gate.release()
        assert lanes.wait_idle(10) and errors == []
    finally:
        assert lanes.stop(5) == []


def test_lanes_submitted_before_a_task_run_now_go_to_a_follower_meanwhile() -> None:
    lanes, src, errors = _leader_pool()
    try:
        gate = Gate("task run now")
        done = threading.Event()
        src.feed(("B", done.set, False), ("A", gate.enter, True))
        gate.wait_started()
        assert done.wait(10)  # B was queued for the follower while A runs on the leader
        gate.release()
        assert lanes.wait_idle(10) and errors == []
    finally:
        assert lanes.stop(5) == []


def test_run_now_on_a_busy_lane_queues_behind_it() -> None:
    lanes, src, errors = _leader_pool()
    try:
        gate = Gate("lane A")
        order: list[str] = []
        assert lanes.submit("A", gate.enter)  # from the test thread: a follower runs it
        gate.wait_started()
        src.feed(("A", lambda: order.append("now"), True))
        src.wait_listening(1)  # the pass is over: "now" was queued, not run
        assert order == []
        gate.release()
        assert lanes.wait_idle(10)
        assert order == ["now"] and errors == [] and lanes.lanes() == []
    finally:
        assert lanes.stop(5) == []


def test_stop_with_a_task_run_now_drops_queued_work_and_leaves_no_lane() -> None:
    lanes, src, _ = _leader_pool()
    gate = Gate("task run now")
    src.feed(("A", gate.enter, True))
    gate.wait_started()
    assert lanes.submit("A", lambda: None)  # queued behind the running inline task
    stopper = threading.Thread(target=lanes.stop, args=(5,))
    stopper.start()
    gate.release()
    stopper.join(10)
    assert not stopper.is_alive()
    assert lanes.lanes() == [] and lanes.num_dropped_at_stop == 1


# --------------------------------------------------------------------- budget, events


def test_budget_reconciliation_never_releases_a_put_newer_than_the_snapshot() -> None:
    b = ByteBudget(100)
    edge = (0, 1)
    b.add("k0", edge, 60)
    snap = b.snapshot()
    b.release(["k0"])
    b.add("k0", edge, 70)  # the same key published again after the snapshot
    assert b.release_absent(snap, present=set()) == 0  # different record: kept
    assert b.used(edge) == 70 and not b.is_over(edge)
    b.add("k1", edge, 40)
    assert b.is_over(edge)
    assert b.release_absent(b.snapshot(), present={"k1"}) == 1
    assert b.used(edge) == 40
    assert b.stats()["edges"] == {"0->1": {"pending_bytes": 40, "pending_keys": 1}}
    b.release(["k1"])
    assert b.leak_state() == {} and b.stats()["edges"] == {}


def test_budget_releases_every_record_of_zero_bytes() -> None:
    # By-reference puts (an in-process edge of a device group) carry no bytes: releasing one
    # of them must not drop the edge's books from under the others.
    b = ByteBudget(100)
    edge = (0, 1)
    for n in range(3):
        b.add(f"z{n}", edge, 0)
    b.add("k", (1, 2), 10)
    assert not b.is_over(edge) and b.used(edge) == 0
    assert b.release(["z0"]) == 1  # one by the sender's cleanup ...
    assert b.release_absent(b.snapshot(), present={"k"}) == 2  # ... the rest by a reap pass
    assert b.leak_state() == {"budget_records": ["k"]} and b.stats()["edges"] == {
        "1->2": {"pending_bytes": 10, "pending_keys": 1}
    }
    b.add("z0", edge, 0)
    b.add("z1", edge, 30)
    assert b.release(["z1", "z0"]) == 2 and b.used(edge) == 0
    assert b.release(["k"]) == 1 and b.leak_state() == {} and b.used((1, 2)) == 0


def test_event_box_keeps_failures_for_both_sides_and_bounds_the_external_copy() -> None:
    box = EventBox(max_external=2)
    fs = [TransferFailure(f"i{n}", "E", FailureKind.SEND_FAILED, f"r{n}", 0) for n in range(3)]
    for f in fs:
        box.record(f)
    _, failed, _ = box.drain()
    assert failed == tuple(fs)
    assert box.take_external() == {"E": fs[1:]} and box.num_external_dropped == 1
    box.record(fs[0])
    box.discard_request("i0")
    assert box.drain() == ((), (), ())
    box.take_external()
    assert box.leak_state() == {}


def test_event_box_hands_each_retired_sender_over_once_and_wakes_a_waiter() -> None:
    box = EventBox(max_external=2)
    assert not box.wait(0)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(box.wait(GATE_TIMEOUT_S)))
    waiter.start()
    box.record_retired("A")
    waiter.join()
    assert woke == [True]  # a retirement wakes a waiting scheduler, as a failure does
    box.record_retired("B")
    box.record_retired("A")  # a reused id retired twice before the drain: reported once
    assert box.leak_state() == {"undrained_retirements": ["A", "B"]}
    assert box.drain() == ((), (), ("A", "B"))
    assert box.drain() == ((), (), ()) and not box.wait(0)
    assert box.leak_state() == {}


# --------------------------------------------------------------------- wake-ups


class _ScriptedParker:
    """A :class:`~omnirelay.transfer.wakeup.Parker` the test drives: a timed wait ends on a
    wake-up or when the test ends it (a timeout), and ``wake`` can be held at its start, so
    each step of a park/wake race happens when the test says."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.pending = 0
        self.num_timed_waits = 0
        self.num_untimed_waits = 0
        self._end_timed = 0
        self.wake_gate: Gate | None = None
        self.is_closed = False

    def wake(self) -> None:
        if self.wake_gate is not None:
            self.wake_gate.enter()
        with self._cv:
            self.pending += 1
            self._cv.notify_all()

    def wait(self, timeout: float | None) -> bool:
        with self._cv:
            if timeout is None:
                self.num_untimed_waits += 1
                self._cv.notify_all()
                assert self._cv.wait_for(lambda: self.pending > 0, 10), "never woken"
                self.pending -= 1
                return True
            self.num_timed_waits += 1
            n = self.num_timed_waits
            self._cv.notify_all()
            assert self._cv.wait_for(lambda: self._end_timed >= n or self.pending > 0, 10), "never ended"
            if self.pending:
                self.pending -= 1
                return True
            return False

    def end_timed_wait(self) -> None:
        with self._cv:
            self._end_timed += 1
            self._cv.notify_all()

    def wait_for(self, what: Callable[[_ScriptedParker], bool]) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: what(self), 10), "the parker never got there"

    def close(self) -> None:
        self.is_closed = True


def _scripted_lanes(
    num_workers: int, idles: list[int] | None = None
) -> tuple[LaneExecutor, list[_ScriptedParker]]:
    """A started executor whose workers park on scripted parkers (in ``made``, in the order
    the workers made them); with ``idles``, an idle hook (30 s interval) that appends to it."""
    made: list[_ScriptedParker] = []
    lanes = LaneExecutor(
        "t",
        num_workers,
        on_error=lambda e: None,
        on_idle=None if idles is None else (lambda: idles.append(1)),
        idle_interval_s=30.0,
        parker=lambda: made.append(_ScriptedParker()) or made[-1],
    )
    lanes.start()
    return lanes, made


def test_an_idle_worker_whose_timeout_races_a_submit_runs_the_task_and_not_the_idle_hook() -> None:
    idles: list[int] = []
    lanes, made = _scripted_lanes(1, idles)
    wait_until(lambda: bool(made), "the worker parked")
    p = made[0]
    p.wait_for(lambda q: q.num_timed_waits == 1)
    p.wake_gate = Gate("wake")
    ran = threading.Event()
    submitter = threading.Thread(target=lanes.submit, args=("A", ran.set))
    submitter.start()
    p.wake_gate.wait_started()  # the submit popped the worker and is about to wake it
    p.end_timed_wait()  # the worker's idle timeout passes first
    p.wait_for(lambda q: q.num_untimed_waits == 1)  # it waits for the wake-up it is owed
    assert not ran.is_set() and idles == []
    p.wake_gate.release()
    submitter.join(10)
    assert ran.wait(10) and lanes.wait_idle(10)
    p.wake_gate = None
    p.wait_for(lambda q: q.num_timed_waits == 2)  # parked again, idle timer running
    p.end_timed_wait()  # a real idle timeout now: the idle hook runs
    wait_until(lambda: idles == [1], "the idle hook ran")
    assert lanes.stop(5) == [] and p.is_closed and p.pending == 0
    assert lanes.lanes() == [] and lanes.stats()["num_running"] == 0


def test_workers_are_woken_most_recently_parked_first_and_one_per_task() -> None:
    lanes, made = _scripted_lanes(3)
    wait_until(lambda: len(made) == 3 and len(lanes._parked) == 3, "all workers parked")
    last = lanes._parked[-1]
    ran = threading.Event()
    lanes.submit("A", ran.set)
    assert ran.wait(10) and lanes.wait_idle(10)
    assert [q.pending for q in made] == [0, 0, 0]
    assert sum(q.num_untimed_waits for q in made) == 4  # 3 parks + the woken one parked again
    assert last.num_untimed_waits == 2  # the most recently parked worker took the task
    assert lanes.stop(5) == [] and all(q.is_closed for q in made)


def test_the_idle_duty_worker_is_woken_last() -> None:
    idles: list[int] = []
    lanes, made = _scripted_lanes(3, idles)
    wait_until(lambda: len(made) == 3 and len(lanes._parked) == 3, "all workers parked")
    timed = [q for q in made if q.num_timed_waits]
    assert len(timed) == 1 and lanes._parked[0] is timed[0]  # at the bottom of the stack
    for n, lane in ((2, "A"), (3, "B")):  # one after the other: the same untimed worker takes both
        ran = threading.Event()
        lanes.submit(lane, ran.set)
        assert ran.wait(10) and lanes.wait_idle(10)
        wait_until(lambda n=n: sorted(q.num_untimed_waits for q in made) == [0, 1, n], "it parked again")
    assert timed[0].num_timed_waits == 1 and timed[0].num_untimed_waits == 0 and idles == []
    # All others busy: the idle-duty worker takes work too.
    gates = [threading.Event() for _ in range(3)]
    for i, g in enumerate(gates):
        lanes.submit(f"busy{i}", g.wait)
    wait_until(lambda: lanes.stats()["num_running"] == 3, "all three workers busy")
    for g in gates:
        g.set()
    assert lanes.wait_idle(10)
    timed[0].wait_for(lambda q: q.num_timed_waits == 2)  # it ran one and parked again
    assert lanes.stop(5) == [] and all(q.is_closed for q in made) and idles == []


def test_adapters_leave_no_file_descriptors_behind() -> None:
    import gc

    def num_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def lifecycle() -> None:
        with make_pipeline() as pl:
            assert pl.sender.save_async("i", "e", {"x": 1}, is_finished=True) is SaveResult.ENQUEUED
            assert pl.receiver.load_async("r", "e")
            collect(pl.receiver, ready_for("r"))
            pl.receiver.finish_requests(["r"])
            pl.audit()

    lifecycle()  # warm-up: imports, lazily made descriptors
    gc.collect()
    before = num_fds()
    for _ in range(10):
        lifecycle()
    gc.collect()
    assert num_fds() <= before


# --------------------------------------------------------------------- public surface


def test_public_exports() -> None:
    assert sorted(transfer.__all__) == sorted(set(transfer.__all__))
    for name in transfer.__all__:
        assert hasattr(transfer, name), name
    assert {"TransferAdapter", "TransferConfig", "TransferEvents", "SaveResult", "ChunkInput"} <= set(
        transfer.__all__
    )

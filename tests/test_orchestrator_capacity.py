"""Admission by real-time capacity (:class:`StreamGate`): the books on a virtual clock, and a
waiter woken by a release (forced with the gate's own waiting count, never a sleep); the
front's queue in front of the gate (:class:`StreamQueue`)."""

from __future__ import annotations

import threading
import time

import pytest

from omnirelay.errors import ConfigError
from omnirelay.orchestrator.capacity import StreamGate, StreamQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_fixed_limit_refuses_one_stream_too_many_until_one_ends() -> None:
    gate = StreamGate(2, clock=Clock())
    assert gate.try_acquire("a") is None and gate.try_acquire("b") is None
    assert gate.try_acquire("a") is None  # idempotent: a stream is counted once
    reason = gate.try_acquire("c")
    assert reason is not None and "real-time capacity of 2 audio streams" in reason
    gate.release("a")
    gate.release("a")  # idempotent
    assert gate.try_acquire("c") is None
    health = gate.health()
    assert (health.max_streams, health.num_streams, health.num_refused) == (2, 2, 1)
    for rid in ("b", "c"):
        gate.release(rid)
    assert gate.leak_state() == {} and gate.health().num_streams == 0


def test_a_stream_running_dry_holds_new_streams_back_until_it_is_ahead_again() -> None:
    clock = Clock()
    gate = StreamGate(None, min_headroom_s=0.0, clock=clock)
    assert gate.try_acquire("a") is None
    clock.now = 1.0
    gate.note_audio("a", 0.057)  # a one-frame first chunk: low, but not dry
    assert gate.try_acquire("b") is None
    clock.now = 1.2  # "a" played its 57 ms and waits: it ran dry
    gate.note_audio("b", 0.5)
    assert gate.health().num_running_low == 1
    reason = gate.try_acquire("c")
    assert reason is not None and "running dry" in reason
    gate.note_audio("a", 1.0)  # its next chunk came: ahead again
    assert gate.health().num_running_low == 0
    assert gate.try_acquire("c") is None
    gate.release("b")  # a stream that ends is no longer watched, dry or not
    # Without the brake (the default) only the fixed limit holds streams back.
    lenient = StreamGate(None, clock=clock)
    lenient.try_acquire("x")
    lenient.note_audio("x", 0.01)
    clock.now += 5.0
    assert lenient.health().num_running_low == 0 and lenient.try_acquire("y") is None


def test_a_waiter_is_admitted_when_a_stream_ends_and_a_timeout_says_why() -> None:
    gate = StreamGate(1)
    assert gate.try_acquire("a") is None
    result: list[str | None] = []
    waiter = threading.Thread(target=lambda: result.append(gate.acquire("b", timeout_s=30)))
    waiter.start()
    deadline = time.monotonic() + 10
    while gate.health().num_waiting == 0:  # until the waiter is blocked in the gate
        assert time.monotonic() < deadline, "the waiter never reached the gate"
        time.sleep(0.001)
    assert "b" not in gate
    gate.release("a")
    waiter.join(10)
    assert result == [None] and "b" in gate and gate.health().num_waiting == 0
    clock = Clock()
    full = StreamGate(1, clock=clock)
    full.try_acquire("x")
    reason = full.acquire("y", timeout_s=0.0)
    assert reason is not None and "capacity" in reason and full.health().num_refused == 1


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"max_streams": 0}, ">= 1"), ({"min_headroom_s": -1}, ">= 0")]
)
def test_bad_settings_are_config_errors(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StreamGate(**kwargs)  # type: ignore[arg-type]


def test_the_queue_lets_requests_for_audio_through_in_arrival_order() -> None:
    gate = StreamGate(1, clock=Clock())
    queue: StreamQueue[str] = StreamQueue(gate, speaks=True)
    assert not queue.enter("a", ("text", "audio"), "A")  # a stream is free: it goes on
    assert "a" in gate and not queue.enter("a", None, "A")  # holding one already: goes on
    assert not queue.enter("t", ("text",), "T")  # asks for no audio: never waits
    assert queue.enter("b", None, "B") and queue.enter("c", ("audio",), "C")
    assert len(queue) == 2 and "b" in queue and queue.waiting_ids() == ["b", "c"]
    assert queue.pop_admitted() is None  # the gate is shut
    gate.release("a")
    assert queue.pop_admitted() == "B" and "b" in gate  # the first waiter, with its stream
    assert queue.pop_admitted() is None  # the next one waits for b's stream
    gate.release("b")
    # A newcomer queues behind a waiter even with a stream free: first come first served.
    assert queue.enter("d", None, "D") and queue.waiting_ids() == ["c", "d"]
    assert queue.pop_admitted() == "C" and queue.pop_admitted() is None
    gate.release("c")
    assert queue.withdraw("d") == "D" and queue.withdraw("d") is None  # an abort
    assert len(queue) == 0 and queue.pop_admitted() is None
    assert gate.leak_state() == {}


def test_a_pipeline_without_audio_output_never_queues_and_shutdown_drains() -> None:
    gate = StreamGate(1, clock=Clock())
    silent: StreamQueue[str] = StreamQueue(gate, speaks=False)
    assert not silent.takes_stream(None) and not silent.enter("a", None, "A")
    assert "a" not in gate
    queue: StreamQueue[str] = StreamQueue(gate, speaks=True)
    assert queue.takes_stream(None) and not queue.takes_stream(("text",))
    assert not queue.enter("a", None, "A")
    assert queue.enter("b", None, "B") and queue.enter("c", None, "C")
    assert queue.drain() == [("b", "B"), ("c", "C")] and len(queue) == 0
    gate.release("a")

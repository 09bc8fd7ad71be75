"""Receive side of the transfer adapter: registrations, identity checks, commit, wakeups.

Interleavings are forced with gates inside the fake connector's get; the stall clock is a
fake clock. Every test ends with the leak audit.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from omnirelay.payload import Codes, Meta, OmniPayload
from omnirelay.transfer import ChunkEnvelope, FailureKind, StallTimeoutDisabledWarning
from tests.transfer_fakes import (
    FakeClock,
    Gate,
    collect,
    failed_for,
    make_pipeline,
    ready_for,
)


def send(p: Any, iid: str, ext: str, payload: Any, *, finished: bool = False, **kw: Any) -> None:
    p.sender.save_async(iid, ext, payload, is_finished=finished, **kw)


def receive(p: Any, iid: str, ext: str) -> Any:
    assert p.receiver.load_async(iid, ext)
    (chunk,) = collect(p.receiver, ready_for(iid)).ready
    return chunk


# --------------------------------------------------------------------- docs/protocol.md §8 item 5


@pytest.mark.parametrize("reregister", [False, True])
def test_late_result_after_cleanup_recreates_nothing(reregister: bool) -> None:
    with make_pipeline() as p:
        send(p, "s1", "R", {"c": 0}, finished=True)
        assert p.sender.flush()
        gate = Gate("get R_0_0")
        p.recv_conn.get_gates["R_0_0"] = gate
        assert p.receiver.load_async("i1", "R")
        gate.wait_started()  # the get is in flight
        cleaner = threading.Thread(target=p.receiver.cleanup_receiver, args=("i1",))
        cleaner.start()
        gate.release()
        cleaner.join()
        if reregister:
            assert p.receiver.load_async("i1", "R")  # a new entry for the same internal id
        assert p.receiver.flush()
        assert p.recv_conn.num_gets["R_0_0"] == (2 if reregister else 1)
        assert p.receiver.poll_events().is_empty  # the late chunk was dropped
        state = p.receiver.leak_state()
        assert "get_counters" not in state
        assert "upstream_exhausted" not in state and "ready" not in state
        if reregister:
            assert state["registrations"] == ["i1"] and state["registrations_by_key"] == ["R_0_0"]
            assert p.receiver.is_waiting_for_chunk("i1")
        else:
            assert "registrations" not in state
        assert not p.receiver.is_upstream_exhausted("i1")
        assert p.receiver.health()["receiver"]["num_stale_results"] == 1
        p.receiver.finish_requests(["i1"])
        p.audit()


def test_cleanup_returns_only_after_the_get_in_flight_ended() -> None:
    """A reused id: once the cleanup of its earlier request returned (the stage then reports
    the id released), no get of that request may still run, or it could consume the chunk
    the request under the same id puts next, under the same key, and drop it as stale."""
    with make_pipeline() as p:
        send(p, "s1", "R", {"old": 1}, finished=True)
        assert p.sender.flush()
        gate = Gate("get R_0_0")
        p.recv_conn.get_gates["R_0_0"] = gate
        assert p.receiver.load_async("old", "R")
        gate.wait_started()  # the old request's get is in flight
        cleaned = threading.Event()

        def clean() -> None:
            p.receiver.cleanup_receiver("old")
            cleaned.set()

        cleaner = threading.Thread(target=clean)
        cleaner.start()
        # Whatever the scheduling, the cleanup cannot end while the get is held at the gate.
        assert not cleaned.wait(0.2)
        assert p.receiver.leak_state().get("gets_in_flight") == {"old": 1}
        gate.release()
        cleaner.join()
        assert p.recv_conn.num_gets["R_0_0"] == 1
        del p.recv_conn.get_gates["R_0_0"]
        # The id is released: its next request puts and reads R_0_0 again, and gets its own chunk.
        send(p, "s2", "R", {"new": 2}, finished=True)
        assert p.sender.flush()
        assert receive(p, "new", "R").payload == {"new": 2}
        assert p.receiver.health()["receiver"]["num_stale_results"] == 1
        p.receiver.finish_requests(["old", "new"])
        p.audit()


# --------------------------------------------------------------------- docs/protocol.md §8 item 6


def test_many_receiver_cleanups_leave_no_residue() -> None:
    with make_pipeline() as p:
        for i in range(2000):
            iid, ext = f"i{i}", f"E{i}"
            if i % 4 == 0:  # a chunk is there: the cleanup races the get and the commit
                send(p, f"s{i}", ext, {"i": i}, finished=True)
            p.receiver.load_async(iid, ext)
            p.receiver.cleanup_receiver(iid)
            assert p.receiver.poll_events().ready == ()  # every request so far is cleaned
        assert p.sender.flush() and p.receiver.flush()
        assert p.receiver.poll_events().is_empty
        p.receiver.finish_requests([f"i{i}" for i in range(2000)])
        assert p.receiver.leak_state() == {}
        for i in range(0, 2000, 4):  # unread terminals: released by id
            p.send_conn.cleanup_prefix(f"E{i}_0_")
        p.audit()


# --------------------------------------------------------------------- cleanup racing a commit


def test_cleanup_after_commit_before_drain_withdraws_the_chunk() -> None:
    with make_pipeline() as p:
        send(p, "s1", "R", {"c": 0}, finished=True)
        assert p.sender.flush()
        assert p.receiver.load_async("i1", "R")
        assert p.receiver.flush()  # committed and published, not drained
        assert p.receiver.is_upstream_exhausted("i1")
        p.receiver.cleanup_receiver("i1")
        assert p.receiver.poll_events().is_empty
        assert not p.receiver.is_upstream_exhausted("i1")
        p.receiver.finish_requests(["i1"])
        p.audit()


def test_cleanup_racing_commit_never_publishes_after_it_returns() -> None:
    with make_pipeline() as p:
        for i in range(500):
            iid, ext = f"i{i}", f"E{i}"
            send(p, f"s{i}", ext, {"i": i}, finished=True)
            # The put is asynchronous: let it land, so the race below is the receiver's
            # commit against cleanup, and the prefix cleanup at the end finds every object
            # (a put still queued then would write its object after the cleanup).
            assert p.sender.flush()
            barrier = threading.Barrier(2)

            def register(iid: str = iid, ext: str = ext, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                p.receiver.load_async(iid, ext)

            t = threading.Thread(target=register)
            t.start()
            barrier.wait()
            p.receiver.cleanup_receiver(iid)
            t.join()
            p.receiver.cleanup_receiver(iid)
            assert p.receiver.flush()
            ev = p.receiver.poll_events()
            assert iid not in {c.internal_id for c in ev.ready}, "a chunk outlived its cleanup"
        p.receiver.finish_requests([f"i{i}" for i in range(500)])
        for i in range(500):
            p.send_conn.cleanup_prefix(f"E{i}_0_")
        p.audit()


# --------------------------------------------------------------------- docs/protocol.md §8 item 9 and §10.6


def test_corrupt_chunk_fails_the_request_fast_with_the_reason() -> None:
    clock = FakeClock()
    with make_pipeline(clock=clock) as p:
        p.recv_conn.corrupt.add("R_0_0")
        send(p, "s1", "R", {"c": 0})
        assert p.receiver.load_async("i1", "R")
        acc = collect(p.receiver, failed_for("i1"))  # no clock advance: not a timeout
        (failure,) = acc.failed
        assert failure.kind is FailureKind.RECEIVE_FAILED and "corrupt payload" in failure.reason
        assert not p.receiver.is_waiting_for_chunk("i1")
        assert p.store.live_keys() == []  # consumed: the object is gone
        assert p.receiver.take_external_failures()["R"] == [failure]
        p.receiver.finish_requests(["i1"])
        p.sender.finish_requests(["s1"])
        p.audit()


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"meta": {"finished": True}}, "expected a ChunkEnvelope, got dict"),
        (ChunkEnvelope(body=1, is_finished=torch.tensor([True, False])), "is_finished must be a bool"),
        (ChunkEnvelope(), "carries nothing"),
    ],
)
def test_an_object_that_breaks_the_transfer_contract_fails_fast(obj: Any, reason: str) -> None:
    with make_pipeline() as p:
        # Not what an adapter puts: a peer wrote something else under the chunk's key.
        assert p.send_conn.put(0, 1, "R_0_0", obj).ok
        assert p.receiver.load_async("i1", "R")
        (failure,) = collect(p.receiver, failed_for("i1")).failed
        assert (
            failure.kind is FailureKind.RECEIVE_FAILED and "violates the transfer contract" in failure.reason
        )
        assert reason in failure.reason and "R_0_0" in failure.reason
        assert not p.receiver.is_waiting_for_chunk("i1") and not p.receiver.is_upstream_exhausted("i1")
        assert p.receiver.take_external_failures()["R"] == [failure]
        p.receiver.finish_requests(["i1"])
        p.audit()


# --------------------------------------------------------------------- commit (docs/protocol.md §4.8)


def test_receiver_hands_every_body_over_unread_with_its_envelope_flags() -> None:
    """What a chunk means is the consumer's business: the receiver commits every chunk
    (one with nothing for a step too) and reads nothing but the envelope's flags."""
    with make_pipeline() as p:
        codes = OmniPayload(codes=Codes(audio=torch.tensor([1, 2, 3])), meta=Meta(left_context_size=0))
        send(p, "s1", "R", codes)
        send(p, "s1", "R", {"speaker": "ethan"})  # plain data, nothing for a codec step
        send(p, "s1", "R", OmniPayload(), is_segment_finished=True)
        send(p, "s1", "R", None, finished=True)

        c0 = receive(p, "i1", "R")
        assert c0.chunk_id == 0 and type(c0.payload) is OmniPayload and not c0.is_finished
        assert torch.equal(c0.payload.codes.audio, torch.tensor([1, 2, 3]))
        assert c0.payload.meta == Meta(left_context_size=0)
        c1 = receive(p, "i1", "R")
        assert c1.chunk_id == 1 and c1.payload == {"speaker": "ethan"}
        c2 = receive(p, "i1", "R")
        assert c2.chunk_id == 2 and c2.payload == OmniPayload() and c2.is_segment_finished
        assert p.receiver.is_segment_finished("i1")
        c3 = receive(p, "i1", "R")
        assert c3.chunk_id == 3 and c3.payload is None and c3.is_finished and not c3.is_segment_finished
        assert p.receiver.is_upstream_exhausted("i1") and not p.receiver.is_segment_finished("i1")
        assert not p.receiver.load_async("i1", "R")  # nothing comes after the end of the stream
        assert p.receiver.health()["receiver"]["num_committed"] == 4
        p.receiver.finish_requests(["i1"])
        p.audit()


def test_ar_receiver_commit_hands_the_payload_over() -> None:
    with make_pipeline() as p:
        embed = torch.arange(6.0).reshape(2, 3)
        send(p, "s1", "R", {"embed": embed, "ids": [1, 2]}, is_segment_finished=True)
        send(p, "s1", "R", {"embed": embed + 1, "ids": [3]})
        send(p, "s1", "R", None, finished=True)
        c0 = receive(p, "i1", "R")
        assert torch.equal(c0.payload["embed"], embed) and c0.payload["ids"] == [1, 2]
        assert c0.is_segment_finished and not c0.is_finished
        assert p.receiver.is_segment_finished("i1")
        c1 = receive(p, "i1", "R")
        assert torch.equal(c1.payload["embed"], embed + 1)
        assert not p.receiver.is_segment_finished("i1")  # a new segment started
        c2 = receive(p, "i1", "R")
        assert c2.is_finished and c2.payload is None  # the end of the stream, nothing else
        p.receiver.finish_requests(["i1"])
        p.audit()


def test_ar_receiver_reads_a_whole_stream_in_order() -> None:
    with make_pipeline() as p:
        for i in range(5):
            send(p, "s1", "R", {"ids": [i]}, is_segment_finished=i == 2)
        send(p, "s1", "R", None, finished=True)
        chunks = [receive(p, "i1", "R") for _ in range(6)]
        assert [c.chunk_id for c in chunks] == list(range(6))
        assert [c.payload["ids"] for c in chunks[:5]] == [[0], [1], [2], [3], [4]]
        assert [c.is_segment_finished for c in chunks] == [False, False, True, False, False, False]
        assert chunks[-1].is_finished and p.receiver.is_upstream_exhausted("i1")
        p.receiver.finish_requests(["i1"])
        p.audit()


def test_load_async_is_a_noop_while_registered_or_ready() -> None:
    with make_pipeline() as p:
        assert p.receiver.load_async("i1", "R")
        assert not p.receiver.load_async("i1", "R")  # already waiting
        send(p, "s1", "R", {"c": 0})
        send(p, "s1", "R", {"c": 1})
        assert p.receiver.wait_events(10.0)  # published, not drained
        assert not p.receiver.load_async("i1", "R")  # one undrained chunk per request
        (c0,) = p.receiver.poll_events().ready
        assert c0.payload["c"] == 0
        assert receive(p, "i1", "R").payload["c"] == 1
        p.receiver.finish_requests(["i1"])
        p.sender.finish_requests(["s1"])
        p.audit()


# --------------------------------------------------------------------- wakeups (docs/protocol.md §10.5)


def test_only_announced_entries_are_polled_and_fallback_covers_lost_notices() -> None:
    clock = FakeClock()
    with make_pipeline(clock=clock, receiver_kw={"fallback_poll_s": 0.5}) as p:
        idle = [f"idle{i}" for i in range(20)]
        for iid in idle:
            assert p.receiver.load_async(iid, iid.upper())
        assert p.receiver.flush()
        send(p, "s1", "T", {"t": 1}, finished=True)
        receive(p, "t1", "T")
        assert p.receiver.flush()
        # Idle entries cost one get at registration and nothing since.
        assert all(p.recv_conn.num_gets[f"{iid.upper()}_0_0"] == 1 for iid in idle)

        p.send_conn.lose_notices = True
        assert p.receiver.load_async("u1", "U")
        assert p.receiver.flush()
        send(p, "s2", "U", {"u": 1}, finished=True)
        assert p.sender.flush()
        assert p.receiver.poll_events().is_empty  # no notice, no fallback yet: not polled
        assert p.recv_conn.num_gets["U_0_0"] == 1
        clock.advance(0.6)  # the next arrival wait ends with a fallback pass over every entry
        (u,) = collect(p.receiver, ready_for("u1")).ready
        assert u.payload["u"] == 1
        assert p.receiver.flush()
        assert all(p.recv_conn.num_gets[f"{iid.upper()}_0_0"] >= 2 for iid in idle)
        p.receiver.finish_requests([*idle, "t1", "u1"])
        p.audit()


def test_a_small_arrival_is_polled_by_the_thread_that_took_its_notice() -> None:
    """Arrivals.small: the arrival leader runs the get itself (no hand-off to a follower)."""
    with make_pipeline() as p:
        p.recv_conn.small_keys = {"E_0_0"}
        assert p.receiver.load_async("r", "E")
        p.recv_conn.wait_found_nothing("E_0_0")  # the registration's own poll came first
        assert p.receiver.flush(10)  # ... and its worker let go of the request's lane
        send(p, "s", "E", {"v": torch.arange(3)}, finished=True)
        chunk = collect(p.receiver, ready_for("r")).ready[0]
        assert torch.equal(chunk.payload["v"], torch.arange(3))
        assert p.recv_conn.got_by["E_0_0"] == p.recv_conn.noticed_by["E_0_0"]
        p.receiver.finish_requests(["r"])
        p.sender.finish_requests(["s"])
        p.audit()


def test_take_announced_hands_out_a_waiting_entry_once_and_never_a_queued_one() -> None:
    """The leader's single-arrival path dedupes notices exactly as entries_to_poll does."""
    with make_pipeline() as p:
        side = p.receiver._receiver
        assert side is not None
        assert p.receiver.load_async("r", "E")
        p.recv_conn.wait_found_nothing("E_0_0")
        assert p.receiver.flush(10)  # the registration's poll ended: the entry waits
        assert side.take_announced("E_0_1") is None  # not the key it waits for
        entry = side.take_announced("E_0_0")
        assert entry is not None and entry.is_queued
        assert side.take_announced("E_0_0") is None  # a duplicate notice: already queued
        assert side.entries_to_poll(["E_0_0"], include_all=False) == []
        assert p.receiver._poll(entry) is None  # the poll the leader would run: not there yet
        assert not entry.is_queued
        p.receiver.finish_requests(["r"])
        assert side.take_announced("E_0_0") is None  # cleaned: nothing to hand out
        p.audit()


def test_one_requests_slow_get_does_not_delay_another_requests_chunk() -> None:
    with make_pipeline(receiver_kw={"num_recv_workers": 2}) as p:
        gate = Gate("big decode of A")
        p.recv_conn.get_gates["A_0_0"] = gate
        send(p, "sa", "A", {"data": b"\0" * (1 << 20)}, finished=True)
        assert p.sender.flush()
        assert p.receiver.load_async("ra", "A")
        gate.wait_started()  # one receive worker is stuck in A's get
        send(p, "sb", "B", {"codec": [1, 2]}, finished=True)
        assert receive(p, "rb", "B").payload["codec"] == [1, 2]
        assert not gate.is_released
        gate.release()
        (a,) = collect(p.receiver, ready_for("ra")).ready
        assert len(a.payload["data"]) == 1 << 20
        p.receiver.finish_requests(["ra", "rb"])
        p.audit()


# --------------------------------------------------------------------- stall timeout (docs/protocol.md §4.10)


def test_stall_timeout_reports_once_with_the_reason() -> None:
    clock = FakeClock()
    with make_pipeline(clock=clock) as p:
        assert p.receiver.load_async("w1", "W")
        clock.advance(599.0)
        assert p.receiver.poll_events().is_empty
        clock.advance(2.0)
        ev = p.receiver.poll_events()
        (t,) = ev.timed_out
        assert t.internal_id == "w1" and t.kind is FailureKind.TIMEOUT and "600 s" in t.reason
        assert p.receiver.poll_events().is_empty  # reported once
        assert p.receiver.take_external_failures() == {"W": [t]}
        p.receiver.finish_requests(["w1"])
        p.audit()


def test_arrival_resets_the_stall_clock() -> None:
    clock = FakeClock()
    with make_pipeline(clock=clock) as p:
        assert p.receiver.load_async("w1", "W")
        clock.advance(500.0)
        send(p, "s1", "W", {"speaker": "x"})  # an arrival 500 s into the wait
        (chunk,) = collect(p.receiver, ready_for("w1")).ready
        assert chunk.payload == {"speaker": "x"}
        assert p.receiver.load_async("w1", "W")  # the consumer waits for the next one
        clock.advance(500.0)
        assert p.receiver.poll_events().is_empty  # 500 s since the arrival, not 1000
        clock.advance(101.0)
        assert len(p.receiver.poll_events().timed_out) == 1
        p.receiver.take_external_failures()
        p.receiver.finish_requests(["w1"])
        p.sender.finish_requests(["s1"])
        p.audit()


def test_zero_stall_timeout_disables_it_with_a_warning() -> None:
    clock = FakeClock()
    with pytest.warns(StallTimeoutDisabledWarning):
        p = make_pipeline(clock=clock, receiver_kw={"stall_timeout_s": 0})
    with p:
        assert p.receiver.load_async("w1", "W")
        clock.advance(1e9)
        assert p.receiver.poll_events().is_empty
        p.receiver.finish_requests(["w1"])
        p.audit()


def test_cleanup_receiver_alone_drops_the_id_mapping() -> None:
    """docs/protocol.md §4.6: cleanup_receiver removes the id mapping too (no per-id residue)."""
    from omnirelay.connectors import create_connector
    from omnirelay.transfer import TransferAdapter, TransferConfig

    conn = create_connector("inproc", namespace="rcvmap", stage_id=2)
    adapter = TransferAdapter(conn, TransferConfig(stage_id=2, receive_from_stage=1))
    try:
        assert adapter.load_async("r1", "R1")
        adapter.cleanup_receiver("r1")
        assert adapter.flush(10)  # the registration's first poll has run and seen no entry
        assert adapter.leak_state() == {}
    finally:
        adapter.shutdown()

"""Send side of the transfer adapter: generations, cleanup ordering, failures, backpressure.

Each interleaving is forced with gates (fakes that block until released); every test ends
with the leak audit (no objects, no pending keys, no adapter state).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from omnirelay.transfer import BuildRequest, ChunkEnvelope, FailureKind, ReleaseScope, SaveResult, key_prefix
from omnirelay.transfer.wakeup import Parker
from tests.transfer_fakes import (
    GATE_TIMEOUT_S,
    FakeClock,
    Gate,
    RecordingProcessor,
    assert_only_retired,
    collect,
    failed_for,
    make_pipeline,
    ready_for,
    wait_until,
)


def read_chunks(p: Any, internal_id: str, external_id: str, n: int) -> list[Any]:
    """Receive ``n`` chunks of one request in order, as a consumer scheduler would."""
    out = []
    for _ in range(n):
        assert p.receiver.load_async(internal_id, external_id)
        acc = collect(p.receiver, ready_for(internal_id))
        (chunk,) = acc.ready
        out.append(chunk)
    return out


# --------------------------------------------------------------------- docs/protocol.md §8 item 1


def test_abort_during_inflight_put_returns_at_once_and_reclaims() -> None:
    with make_pipeline() as p:
        gate = Gate("put R_0_0")
        p.send_conn.put_gates["R_0_0"] = gate
        assert p.sender.save_async("r1", "R", {"data": b"x" * 100}) is SaveResult.ENQUEUED
        gate.wait_started()
        p.sender.finish_requests(["r1"])  # the abort
        p.store.note("abort_returned")
        assert not gate.is_released  # the abort did not wait for the put
        gen = p.sender.sender_generation("R")
        assert gen is not None and gen["cancelled"] and gen["in_flight"] and gen["num_puts"] == 1
        # The sender stays alive for other requests while R's put is blocked.
        p.sender.save_async("q1", "Q", {"q": 1}, is_finished=True)
        (q,) = read_chunks(p, "rq1", "Q", 1)
        assert q.payload["q"] == 1 and q.is_finished
        p.receiver.finish_requests(["rq1"])
        p.store.note("put_released")
        gate.release()
        assert p.sender.flush()
        log = p.store.log
        assert (
            log.index("put_start:R_0_0")
            < log.index("abort_returned")
            < log.index("put_released")
            < log.index("cleanup:R_0_0")
        )
        assert p.sender.sender_generation("R") is None
        assert_only_retired(p.sender, "Q", "R")
        p.audit()


def test_a_retirement_is_reported_only_once_its_keys_are_gone() -> None:
    """Release as data: a cancelled generation's retirement reaches ``poll_events`` after
    its exact-key cleanup ran on its lane (and after the processor was told to drop the
    processor's state of the id); a generation with nothing to clean, at retirement."""
    processor = RecordingProcessor()
    hooks = processor.released
    with make_pipeline(processor=processor) as p:
        p.sender.save_async("a1", "R", {"c": 0})
        p.sender.save_async("a1", "R", {"c": 1})
        assert p.sender.flush()
        assert p.store.live_keys() == ["R_0_0", "R_0_1"]  # sent, never read
        gate = p.send_conn.cleanup_gates["R_0_1"] = Gate("cleanup R_0_1")
        p.sender.finish_requests(["a1"])  # the abort: A retires, its cleanup is queued
        gate.wait_started()  # R_0_0 is gone, R_0_1 not yet
        assert p.sender.sender_generation("R") is None  # retired: the id is free for admission
        assert p.sender.poll_events().is_empty and not p.sender.wait_events(0)
        assert hooks == []  # nor is the processor's state dropped before the keys
        waiter: list[bool] = []
        scheduler = threading.Thread(target=lambda: waiter.append(p.sender.wait_events(GATE_TIMEOUT_S)))
        scheduler.start()
        gate.release()
        scheduler.join()
        assert waiter == [True]  # the report wakes a waiting scheduler
        assert p.store.live_keys() == [] and hooks == [("R", ReleaseScope.REQUEST)]
        assert_only_retired(p.sender, "R")
        # Nothing to clean (the terminal is downstream's): reported at retirement.
        p.sender.save_async("b1", "T", {"c": 0}, is_finished=True)
        assert p.sender.wait_events(GATE_TIMEOUT_S)
        assert p.store.live_keys() == ["T_0_0"]
        assert_only_retired(p.sender, "T")
        assert hooks == [("R", ReleaseScope.REQUEST), ("T", ReleaseScope.REQUEST)]
        read_chunks(p, "rt", "T", 1)
        p.receiver.finish_requests(["rt"])
        p.audit()


# --------------------------------------------------------------------- docs/protocol.md §8 item 2


def test_reuse_while_draining_is_rejected_with_a_reason() -> None:
    with make_pipeline() as p:
        gate = Gate("put R_0_0")
        p.send_conn.put_gates["R_0_0"] = gate
        p.sender.save_async("a1", "R", {"gen": "A"})
        gate.wait_started()
        p.sender.finish_requests(["a1"])
        assert not p.sender.has_active_sender("R") and p.sender.is_draining("R")
        assert p.sender.save_async("b1", "R", {"gen": "B"}) is SaveResult.REJECTED
        (failure,) = p.sender.poll_events().failed
        assert failure.internal_id == "b1" and failure.external_id == "R"
        assert failure.kind is FailureKind.REUSE_REJECTED and "still drains" in failure.reason
        assert p.sender.take_external_failures() == {"R": [failure]}
        gate.release()
        assert p.sender.flush()
        assert not p.sender.is_draining("R")
        p.sender.finish_requests(["b1"])  # the scheduler fails the rejected request
        # Once A is released, B is admitted and reads back fine.
        assert p.sender.save_async("b2", "R", {"gen": "B"}, is_finished=True) is SaveResult.ENQUEUED
        (chunk,) = read_chunks(p, "rb", "R", 1)
        assert chunk.payload["gen"] == "B"
        p.receiver.finish_requests(["rb"])
        p.audit()


def test_old_generation_cleanup_runs_before_new_generation_put() -> None:
    with make_pipeline() as p:
        p.sender.save_async("a1", "R", {"gen": "A"})
        assert p.sender.flush()
        assert p.store.live_keys() == ["R_0_0"]  # A's chunk, never read
        cleanup_gate = Gate("cleanup R_0_0")
        p.send_conn.cleanup_gates["R_0_0"] = cleanup_gate
        p.sender.finish_requests(["a1"])  # retires A: cleanup of R_0_0 queued on lane R
        cleanup_gate.wait_started()
        # A's token is gone, so B is admitted at once, but its put queues behind the cleanup.
        assert p.sender.save_async("b1", "R", {"gen": "B"}, is_finished=True) is SaveResult.ENQUEUED
        assert p.store.log.count("put_start:R_0_0") == 1
        cleanup_gate.release()
        # Register downstream only once B is out: a receiver registered earlier could read
        # A's stale R_0_0 (keys carry no generation, docs/protocol.md §10.3).
        assert p.sender.flush()
        (chunk,) = read_chunks(p, "rb", "R", 1)
        assert chunk.payload["gen"] == "B"  # A's cleanup did not delete B's R_0_0
        log = p.store.log
        first_put = log.index("put_start:R_0_0")
        second_put = log.index("put_start:R_0_0", first_put + 1)
        assert log.index("cleanup:R_0_0") < second_put
        p.receiver.finish_requests(["rb"])
        assert_only_retired(p.sender, "R")  # A's and B's generation: one report until drained
        p.audit()


# --------------------------------------------------------------------- docs/protocol.md §8 item 3


def test_cancel_cleans_exact_keys_and_spares_similar_ids() -> None:
    with make_pipeline(first_stage=1) as p:
        p.sender.save_async("t_sib", "task_1", {"who": "sibling"})
        p.sender.save_async("t", "task", {"who": "task"})
        assert p.sender.flush()
        assert p.store.live_keys() == ["task_1_0", "task_1_1_0"]
        p.sender.finish_requests(["t"])
        assert p.sender.flush()
        assert p.store.live_keys() == ["task_1_1_0"]
        (chunk,) = read_chunks(p, "r_sib", "task_1", 1)  # the sibling still reads back
        assert chunk.payload["who"] == "sibling"
        p.receiver.finish_requests(["r_sib"])
        p.sender.finish_requests(["t_sib"])
        p.audit()


# --------------------------------------------------------------------- docs/protocol.md §8 item 4


def test_successful_terminal_is_never_cleaned_by_the_sender() -> None:
    with make_pipeline() as p:
        gate = Gate("terminal put")
        p.send_conn.put_gates["R_0_1"] = gate
        p.sender.save_async("r1", "R", {"c": 0})
        p.sender.save_async("r1", "R", None, is_finished=True)
        gate.wait_started()
        # The scheduler finishes the request right after admitting the terminal.
        p.sender.finish_requests(["r1"])
        gen = p.sender.sender_generation("R")
        assert gen is not None and gen["cleanup_deferred"] and gen["terminal_pending"]
        gate.release()
        assert p.sender.flush()
        assert p.sender.sender_generation("R") is None  # fence released, token retired
        assert p.store.live_keys() == ["R_0_0", "R_0_1"]  # nothing cleaned
        assert "cleanup:R_0_1" not in p.store.log
        chunks = read_chunks(p, "rr", "R", 2)
        assert [c.chunk_id for c in chunks] == [0, 1]
        assert chunks[1].is_finished and not chunks[0].is_finished
        assert p.receiver.is_upstream_exhausted("rr")
        assert not p.receiver.load_async("rr", "R")  # nothing more will come
        p.receiver.finish_requests(["rr"])
        p.audit()


@pytest.mark.parametrize("mode", ["returns_false", "raises"])
def test_failed_terminal_is_cleaned_even_if_the_backend_created_it(mode: str) -> None:
    with make_pipeline() as p:
        hooks = p.send_conn.fail_after_create if mode == "returns_false" else p.send_conn.raise_after_create
        hooks.add("R_0_1")
        p.sender.save_async("r1", "R", {"c": 0})
        p.sender.save_async("r1", "R", None, is_finished=True)
        acc = collect(p.sender, failed_for("r1"))
        (failure,) = acc.failed
        assert failure.kind is FailureKind.SEND_FAILED and "R_0_1" in failure.reason
        assert ("lost" if mode == "returns_false" else "exploded") in failure.reason
        assert p.sender.flush()
        gen = p.sender.sender_generation("R")
        assert gen is not None and gen["has_failed"] and not gen["terminal_pending"]  # fence released
        assert p.store.live_keys() == ["R_0_0", "R_0_1"]  # the backend did create it
        assert p.sender.save_async("r1", "R", {"late": 1}) is SaveResult.REJECTED
        p.sender.finish_requests(["r1"])  # the scheduler acts on the failure
        assert p.sender.flush()
        assert "cleanup:R_0_1" in p.store.log and "cleanup:R_0_0" in p.store.log
        p.sender.poll_events()
        assert set(p.sender.take_external_failures()) == {"R"}
        p.audit()


def test_put_that_raises_after_creating_the_object_fails_fast_and_is_cleaned() -> None:
    with make_pipeline() as p:
        p.send_conn.raise_after_create.add("R_0_0")
        gate = Gate("put R_0_0")
        p.send_conn.put_gates["R_0_0"] = gate  # the second chunk is admitted before the put fails
        p.sender.save_async("r1", "R", {"c": 0})
        gate.wait_started()
        p.sender.save_async("r1", "R", {"c": 1})  # vetoed when it runs: the generation failed
        gate.release()
        acc = collect(p.sender, failed_for("r1"))
        assert acc.failed[0].kind is FailureKind.SEND_FAILED and "exploded" in acc.failed[0].reason
        assert p.sender.flush()
        assert p.store.log.count("put_start:R_0_0") == 1 and "put_start:R_0_1" not in p.store.log
        ext = p.sender.take_external_failures()
        assert [f.reason for f in ext["R"]] == [acc.failed[0].reason]
        p.sender.finish_requests(["r1"])
        assert p.sender.flush()
        assert "cleanup:R_0_0" in p.store.log
        p.audit()


def test_processor_failure_fails_the_request_with_the_reason() -> None:
    def processor(req: BuildRequest) -> Any:
        if req.external_id == "P":
            raise KeyError("no such codec frame")
        return req.output

    with make_pipeline(processor=processor) as p:
        p.sender.save_async("p1", "P", {"c": 0})
        p.sender.save_async("p1", "P", None, is_finished=True)  # discarded: the generation failed
        acc = collect(p.sender, failed_for("p1"))
        assert "processor raised KeyError" in acc.failed[0].reason
        assert p.sender.flush()
        assert not any(e.startswith("put_start:P") for e in p.store.log)
        gen = p.sender.sender_generation("P")
        assert gen is not None and not gen["terminal_pending"]
        p.sender.finish_requests(["p1"])
        p.sender.take_external_failures()
        p.audit()


# --------------------------------------------------------------------- aborts around the terminal / first put


def test_abort_while_the_terminal_is_queued_still_delivers_end_of_stream() -> None:
    with make_pipeline() as p:
        gate = Gate("put R_0_0")
        p.send_conn.put_gates["R_0_0"] = gate
        p.sender.save_async("r1", "R", {"c": 0})
        gate.wait_started()
        p.sender.save_async("r1", "R", None, is_finished=True)  # queued behind chunk 0
        p.sender.finish_requests(["r1"])
        gen = p.sender.sender_generation("R")
        assert gen is not None
        assert gen["cancelled"] and gen["cleanup_deferred"] and gen["terminal_pending"]
        gate.release()
        assert p.sender.flush()
        # The terminal is the downstream's only end-of-stream signal: it went out on the
        # next key (chunk 0's counter advanced), and the sender cleaned nothing.
        assert p.sender.sender_generation("R") is None
        assert p.store.live_keys() == ["R_0_0", "R_0_1"]
        chunks = read_chunks(p, "rr", "R", 2)
        assert [c.is_finished for c in chunks] == [False, True]
        p.receiver.finish_requests(["rr"])
        p.audit()


def test_abort_while_terminal_queued_unread_is_released_by_id() -> None:
    with make_pipeline() as p:
        gate = Gate("put R_0_0")
        p.send_conn.put_gates["R_0_0"] = gate
        p.sender.save_async("r1", "R", {"c": 0})
        gate.wait_started()
        p.sender.save_async("r1", "R", None, is_finished=True)
        p.sender.finish_requests(["r1"])
        gate.release()
        assert p.sender.flush()
        # Nobody downstream reads an aborted request: the orchestrator's release by id.
        assert p.send_conn.cleanup_prefix(key_prefix("R", 0)) == 2
        p.audit()


def test_abort_while_the_first_chunk_is_being_built_sends_nothing() -> None:
    gate = Gate("processor")

    def processor(req: BuildRequest) -> Any:
        gate.enter()
        return req.output

    with make_pipeline(processor=processor) as p:
        p.sender.save_async("r1", "R", {"c": 0})
        gate.wait_started()
        p.sender.finish_requests(["r1"])
        gate.release()
        assert p.sender.flush()
        assert not any(e.startswith("put_start:R") for e in p.store.log)
        assert not any(e.startswith("cleanup:R") for e in p.store.log)  # num_puts was 0
        p.audit()


def test_abort_before_the_first_put_starts_discards_the_queued_task() -> None:
    with make_pipeline(sender_kw={"num_send_workers": 1}) as p:
        gate = Gate("put Q_0_0")
        p.send_conn.put_gates["Q_0_0"] = gate
        p.sender.save_async("q1", "Q", {"q": 0})
        gate.wait_started()  # the only worker is busy
        p.sender.save_async("r1", "R", {"c": 0})
        p.sender.finish_requests(["r1"])  # nothing in flight: retired at once
        assert p.sender.sender_generation("R") is None
        gate.release()
        assert p.sender.flush()
        assert not any(e.startswith("put_start:R") for e in p.store.log)
        assert p.sender.health()["sender"]["num_discarded"] == 1
        p.sender.finish_requests(["q1"])
        p.audit()


def test_abort_racing_the_first_put_never_leaks() -> None:
    """Abort right after admission, racing the worker's build and put, many times:
    whichever wins (discard, skip after build, cleanup after put), nothing leaks."""
    with make_pipeline() as p:
        for i in range(500):
            p.sender.save_async(f"r{i}", f"R{i}", {"i": i}, is_finished=i % 2 == 0)
            p.sender.finish_requests([f"r{i}"])
        assert p.sender.flush()
        assert_only_retired(p.sender, *[f"R{i}" for i in range(500)])
        # Terminals always go out (end of stream); nobody reads them here, so the
        # orchestrator releases them by id. Non-terminal chunks were never sent or cleaned.
        for i in range(500):
            p.send_conn.cleanup_prefix(key_prefix(f"R{i}", 0))
        assert not any(e.startswith("put_start:R") and e.endswith("_0_1") for e in p.store.log)
        p.audit()


# --------------------------------------------------------------------- order per request only


def test_one_requests_blocked_big_put_does_not_delay_another_requests_chunk() -> None:
    with make_pipeline(sender_kw={"num_send_workers": 2}) as p:
        gate = Gate("64 MB put of A")
        p.send_conn.put_gates["A_0_0"] = gate
        p.sender.save_async("a1", "A", {"data": b"\0" * (4 << 20)})
        gate.wait_started()
        p.sender.save_async("b1", "B", {"codec": [1, 2, 3]}, is_finished=True)
        (b,) = read_chunks(p, "rb", "B", 1)
        assert b.payload["codec"] == [1, 2, 3]
        assert not gate.is_released  # B arrived while A's put was still blocked
        gate.release()
        p.sender.save_async("a1", "A", None, is_finished=True)
        chunks = read_chunks(p, "ra", "A", 2)
        assert len(chunks[0].payload["data"]) == 4 << 20 and chunks[1].is_finished
        p.receiver.finish_requests(["ra", "rb"])
        p.audit()


def test_chunks_of_one_request_keep_their_order() -> None:
    with make_pipeline(sender_kw={"num_send_workers": 4}) as p:
        for i in range(50):
            p.sender.save_async("r1", "R", {"i": i}, is_finished=i == 49)
        chunks = read_chunks(p, "rr", "R", 50)
        assert [c.payload["i"] for c in chunks] == list(range(50))
        assert [c.chunk_id for c in chunks] == list(range(50))
        p.receiver.finish_requests(["rr"])
        p.audit()


def test_send_workers_are_woken_only_once_the_sender_lock_is_released(monkeypatch: Any) -> None:
    """A worker woken inside ``save_async``'s lock (or a cleanup's) would run into that lock
    on its task's first step: a futile switch on a CPU it shares with the caller."""
    woken_under_lock: list[bool] = []
    wake = Parker.wake
    # No idle timer firing meanwhile: every worker stays parked until a submit wakes one.
    with make_pipeline(sender_kw={"reap_interval_s": 30.0}) as p:
        side, lanes = p.sender._sender, p.sender._send_lanes
        assert side is not None and lanes is not None
        caller = threading.get_ident()

        def recording_wake(self: Parker) -> None:
            if threading.get_ident() == caller:
                woken_under_lock.append(side._lock.locked())
            wake(self)

        monkeypatch.setattr(Parker, "wake", recording_wake)

        def all_parked() -> bool:
            return len(lanes._parked) == lanes.stats()["num_workers"]

        wait_until(all_parked, "every send worker parked")
        assert p.sender.save_async("a", "A", {"x": 1}) is SaveResult.ENQUEUED
        assert p.sender.flush()
        wait_until(all_parked, "the worker parked again")
        p.sender.finish_requests(["a"])  # retires A's generation: its cleanup task is queued
        assert p.sender.flush()
        assert woken_under_lock == [False, False]  # one wake-up each, both after the lock
        assert p.store.live_keys() == []
        p.audit()


def test_processor_sees_the_request_snapshot_and_the_chunk_id() -> None:
    seen: list[tuple[int, bool, Any]] = []

    def processor(req: BuildRequest) -> Any:
        seen.append((req.chunk_id, req.is_finished, req.context))
        return None if req.output is None else {"n": req.output}

    with make_pipeline(processor=processor) as p:
        p.sender.save_async("r1", "R", 0, context={"prompt": [1]})
        p.sender.save_async("r1", "R", None, context={"prompt": [1, 2]})  # nothing this step
        p.sender.save_async("r1", "R", 1, context={"prompt": [1, 2, 3]})
        p.sender.save_async("r1", "R", None, is_finished=True)  # no body at the boundary
        chunks = read_chunks(p, "rr", "R", 3)
        assert [c.payload for c in chunks] == [{"n": 0}, {"n": 1}, None] and chunks[2].is_finished
        assert seen == [(0, False, {"prompt": [1]}), (1, False, {"prompt": [1, 2]}),
                        (1, False, {"prompt": [1, 2, 3]}), (2, True, None)]  # fmt: skip
        p.receiver.finish_requests(["rr"])
        p.audit()


def test_a_processor_that_owns_its_finish_flag_returns_the_envelope_itself() -> None:
    """The adapter wraps a body with the admission's flags; an envelope the processor
    built is put as it is (a streaming processor knows when its own stream ends), and one
    with a flag that is not a bool fails the request with the reason."""

    def processor(req: BuildRequest) -> Any:
        if req.external_id == "BAD":
            return ChunkEnvelope(body=req.output, is_finished=torch.tensor([True, False]))
        return ChunkEnvelope(body=req.output, is_finished=req.output == "last")

    with make_pipeline(processor=processor) as p:
        p.sender.save_async("s1", "R", "first")
        p.sender.save_async("s1", "R", "last")  # not a terminal for the scheduler: ends the stream
        chunks = read_chunks(p, "r1", "R", 2)
        assert [(c.payload, c.is_finished) for c in chunks] == [("first", False), ("last", True)]
        assert p.receiver.is_upstream_exhausted("r1")
        p.sender.save_async("b1", "BAD", "x")
        (failure,) = collect(p.sender, failed_for("b1")).failed
        assert failure.kind is FailureKind.SEND_FAILED and "malformed" in failure.reason
        assert "is_finished must be a bool" in failure.reason
        assert not any(e.startswith("put_start:BAD") for e in p.store.log)
        p.sender.take_external_failures()
        p.sender.finish_requests(["s1", "b1"])
        p.receiver.finish_requests(["r1"])
        p.audit()


# --------------------------------------------------------------------- admission rules


def test_admission_drops_stale_chunks_and_refuses_bad_ones() -> None:
    processor = RecordingProcessor()
    released = processor.released
    with make_pipeline(processor=processor) as p:
        s = p.sender
        gate = Gate("terminal put")
        p.send_conn.put_gates["R_0_2"] = gate  # keeps the generation alive while we probe it
        assert s.save_async("r1", "R", {"c": 0}, num_confirmed_tokens=10) is SaveResult.ENQUEUED
        assert s.save_async("r1", "R", {"c": 1}, num_confirmed_tokens=5) is SaveResult.DROPPED  # preempted
        assert (
            s.save_async("r1", "R", {"c": 1}, is_segment_finished=True, segment_generation=0)
            is SaveResult.ENQUEUED
        )
        assert s.save_async("r1", "R", {"late": 1}, segment_generation=0) is SaveResult.DROPPED
        assert s.save_async("x1", "R", {"c": 2}) is SaveResult.REJECTED  # in use by r1
        assert s.save_async("r1", "R", None, is_finished=True, segment_generation=1) is SaveResult.ENQUEUED
        gate.wait_started()
        assert s.save_async("r1", "R", {"after": 1}) is SaveResult.REJECTED  # after the terminal
        assert s.save_async("r2", "", {"c": 0}) is SaveResult.REJECTED  # not a usable id
        failed = collect(s, failed_for("x1", "r1", "r2")).failed
        reasons = {f.internal_id: f.reason for f in failed}
        assert "in use by request 'r1'" in reasons["x1"]
        assert "after the request's terminal" in reasons["r1"]
        assert "non-empty" in reasons["r2"]
        gate.release()
        chunks = read_chunks(p, "rr", "R", 3)
        assert [c.is_segment_finished for c in chunks] == [False, True, False]
        assert chunks[2].is_finished
        assert ("R", ReleaseScope.SEGMENT) in released and ("R", ReleaseScope.REQUEST) in released
        s.finish_requests(["x1", "r2"])
        s.take_external_failures()
        p.receiver.finish_requests(["rr"])
        p.audit()


# --------------------------------------------------------------------- backpressure


def test_sender_over_budget_waits_then_fails_with_backpressure() -> None:
    clock = FakeClock()
    with make_pipeline(clock=clock, sender_kw={"edge_budget_bytes": 1000, "backpressure_wait_s": 5.0}) as p:
        p.sender.save_async("a1", "A", {"data": b"a" * 2000})
        assert p.sender.flush()
        edges = p.sender.health()["budget"]["edges"]
        assert edges["0->1"]["pending_bytes"] >= 2000 and edges["0->1"]["pending_keys"] == 1
        p.sender.save_async("b1", "B", {"data": b"b"})
        wait_until(lambda: p.sender.health()["budget"]["num_waiters"] == 1, "B waits for budget")
        clock.advance(4.0)
        p.sender.kick()
        clock.advance(1.5)
        p.sender.kick()
        acc = collect(p.sender, failed_for("b1"))
        (failure,) = acc.failed
        assert failure.kind is FailureKind.BACKPRESSURE and "budget 1000" in failure.reason
        assert "put_start:B_0_0" not in p.store.log
        p.sender.finish_requests(["a1", "b1"])
        p.sender.take_external_failures()
        p.audit()


def test_consumption_releases_budget_and_the_waiting_sender_proceeds() -> None:
    with make_pipeline(sender_kw={"edge_budget_bytes": 1000}) as p:
        p.sender.save_async("a1", "A", {"data": b"a" * 2000}, is_finished=True)
        assert p.sender.flush()
        p.sender.save_async("b1", "B", {"data": b"b"}, is_finished=True)
        wait_until(lambda: p.sender.health()["budget"]["num_waiters"] == 1, "B waits for budget")
        assert "put_start:B_0_0" not in p.store.log
        read_chunks(p, "ra", "A", 1)  # the consumer catches up
        (b,) = read_chunks(p, "rb", "B", 1)
        assert b.payload["data"] == b"b"
        p.receiver.finish_requests(["ra", "rb"])
        assert_only_retired(p.sender, "A", "B")
        p.audit()
        assert p.sender.health()["budget"]["edges"] == {}

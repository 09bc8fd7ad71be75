"""Whole lifecycles through two adapters: many requests, reaping, shutdown, inproc end to end."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from omnirelay.connectors import create_connector
from omnirelay.connectors.base import Connector
from omnirelay.connectors.inproc import InprocConnector, hub_for
from omnirelay.errors import TransferError
from omnirelay.transfer import FailureKind, SaveResult, TransferAdapter
from tests.transfer_fakes import (
    FakeConnector,
    FakeStore,
    assert_no_leaks,
    assert_only_retired,
    collect,
    make_config,
    make_pipeline,
    ready_for,
)

_NS = itertools.count()


def test_ten_thousand_sequential_lifecycles_leave_every_map_empty() -> None:
    with make_pipeline() as p:
        for i in range(10_000):
            ext = f"E{i % 7}"  # external ids are reused, one lifetime after another
            assert p.sender.save_async(f"s{i}", ext, {"i": i}, is_finished=True) is SaveResult.ENQUEUED
            assert p.receiver.load_async(f"r{i}", ext)
            (chunk,) = collect(p.receiver, ready_for(f"r{i}")).ready
            assert chunk.payload["i"] == i and chunk.is_finished and chunk.chunk_id == 0
            p.receiver.finish_requests([f"r{i}"])
            # The terminal put's completion cleans the sender; wait for it before reusing the id.
            assert p.sender.flush()
        assert_only_retired(p.sender, *[f"E{i}" for i in range(7)])
        p.audit()
        health = p.sender.health()
        assert health["sender"]["num_puts"] == 10_000 and health["sender"]["num_generations"] == 0
        assert p.receiver.health()["receiver"]["num_committed"] == 10_000


# --------------------------------------------------------------------- docs/protocol.md §8 items 7 and 8


def test_idle_send_loop_reaps_pending_keys_after_the_last_send() -> None:
    with make_pipeline() as p:
        for i in range(3):
            p.sender.save_async("s1", "R", {"i": i})
        assert p.sender.flush()
        assert p.send_conn.pending_keys() == ["R_0_0", "R_0_1", "R_0_2"]
        for i in range(3):  # consumed by another process; this one sends nothing more
            p.send_conn.consume_external(f"R_0_{i}")
        p.send_conn.wait_pending(lambda keys: keys == [])  # drained by the idle loop alone
        p.sender.finish_requests(["s1"])
        p.audit()


def test_reap_rotation_reaches_consumed_keys_behind_many_unread_ones() -> None:
    with make_pipeline() as p:
        for i in range(100):
            p.sender.save_async("u1", "U", {"i": i})  # never read
        for i in range(5):
            p.sender.save_async("c1", "C", {"i": i})
        assert p.sender.flush()
        for i in range(5):
            p.send_conn.consume_external(f"C_0_{i}")
        p.send_conn.wait_pending(lambda keys: not any(k.startswith("C_") for k in keys))
        assert len(p.send_conn.pending_keys()) == 100
        p.sender.finish_requests(["u1", "c1"])
        p.audit()


# --------------------------------------------------------------------- health, shutdown


def test_health_reports_queues_budget_state_and_connector() -> None:
    with make_pipeline() as p:
        p.sender.save_async("s1", "R", {"data": b"x" * 500})
        assert p.sender.flush()
        h = p.sender.health()
        assert h["status"] == "healthy" and h["stage_id"] == 0 and h["send_to_stage"] == 1
        assert h["send_queue"]["num_workers"] == 4 and h["send_queue"]["num_queued"] == 0
        assert h["sender"]["num_generations"] == 1 and h["sender"]["num_in_flight"] == 0
        assert h["budget"]["limit_bytes"] == 1 << 30
        assert h["budget"]["edges"]["0->1"]["pending_keys"] == 1
        assert h["connector"]["backend"] == "fake" and h["connector"]["num_pending_keys"] == 1
        assert h["events"]["num_undrained_failures"] == 0 and h["num_errors"] == 0
        r = p.receiver.health()
        assert r["receiver"]["num_registrations"] == 0 and r["recv_queue"]["num_workers"] == 2
        assert r["send_queue"] is None
        p.sender.finish_requests(["s1"])
        p.audit()


def test_shutdown_is_idempotent_joins_threads_and_closes_the_connector() -> None:
    p = make_pipeline()
    p.sender.save_async("s1", "R", {"c": 0})
    assert p.receiver.load_async("r1", "Q")
    assert p.sender.flush()
    p.sender.shutdown()
    p.sender.shutdown()
    p.receiver.close()
    p.receiver.close()
    assert p.send_conn.num_closes == 1 and p.recv_conn.num_closes == 1
    assert p.store.live_keys() == []  # close released what the sender still owned
    for a in p.adapters:
        assert a.leak_state() == {}
        assert a.health()["status"] == "closed" and a.health()["num_errors"] == 0
    with pytest.raises(TransferError, match="closed"):
        p.sender.save_async("s2", "R", {"c": 1})
    assert not p.receiver.load_async("r2", "Q")


def test_roles_are_enforced() -> None:
    store = FakeStore()
    with TransferAdapter(FakeConnector(store, 1), make_config(1, receive_from_stage=0)) as a:
        with pytest.raises(TransferError, match="no send edge"):
            a.save_async("i", "E", {})
        assert not a.has_active_sender("E")
    with TransferAdapter(FakeConnector(store, 0), make_config(0, send_to_stage=1)) as a:
        assert not a.load_async("i", "E")
        assert not a.is_upstream_exhausted("i")


# --------------------------------------------------------------------- inproc end to end


def _inproc_pair(ns: str) -> tuple[Connector, Connector]:
    return create_connector("inproc", namespace=ns, stage_id=0), create_connector(
        "inproc", namespace=ns, stage_id=1
    )


def test_inproc_many_interleaved_streams_arrive_in_order_exactly_once() -> None:
    ns = f"tx{os.getpid()}x{next(_NS)}"
    hub = hub_for(ns)
    c0, c1 = _inproc_pair(ns)
    sender = TransferAdapter(c0, make_config(0, send_to_stage=1))
    receiver = TransferAdapter(c1, make_config(1, receive_from_stage=0))
    try:
        n_req, n_chunks = 40, 6
        for j in range(n_chunks):
            for i in range(n_req):
                codes = torch.arange(j * 4, j * 4 + 4) + i * 1000
                payload = {"codes": {"audio": codes}} if j < n_chunks - 1 else None
                sender.save_async(f"s{i}", f"req-{i}", payload, is_finished=j == n_chunks - 1)
        got: dict[str, list[list[int]]] = {f"r{i}": [] for i in range(n_req)}
        done: set[str] = set()
        for i in range(n_req):
            assert receiver.load_async(f"r{i}", f"req-{i}")
        while len(done) < n_req:
            assert receiver.wait_events(10.0)
            ev = receiver.poll_events()
            assert not ev.failed and not ev.timed_out
            for c in ev.ready:
                got[c.internal_id].append([] if c.payload is None else c.payload["codes"]["audio"].tolist())
                if c.is_finished:
                    done.add(c.internal_id)
                else:
                    assert receiver.load_async(c.internal_id, c.external_id)
        for i in range(n_req):
            expect = [[x + i * 1000 for x in range(j * 4, j * 4 + 4)] for j in range(n_chunks - 1)]
            assert got[f"r{i}"] == [*expect, []]  # in order, exactly once, then the end of stream
        receiver.finish_requests(list(got))
        assert_no_leaks([sender, receiver], [c0, c1], hub.live_keys)
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_inproc_cancel_then_reuse_and_corrupt_chunk() -> None:
    ns = f"tx{os.getpid()}x{next(_NS)}"
    hub = hub_for(ns)
    c0, c1 = _inproc_pair(ns)
    sender = TransferAdapter(c0, make_config(0, send_to_stage=1))
    receiver = TransferAdapter(c1, make_config(1, receive_from_stage=0))
    try:
        # Generation A of R: two unread chunks, then cancelled.
        sender.save_async("a", "R", {"gen": "A", "x": torch.ones(3)})
        sender.save_async("a", "R", {"gen": "A"})
        assert sender.flush()
        sender.finish_requests(["a"])
        assert sender.flush()
        assert hub.live_keys() == []
        # Generation B of R reads back from chunk 0.
        assert sender.save_async("b", "R", {"gen": "B"}, is_finished=True) is SaveResult.ENQUEUED
        assert receiver.load_async("rb", "R")
        (chunk,) = collect(receiver, ready_for("rb")).ready
        assert chunk.payload["gen"] == "B" and chunk.is_finished
        receiver.finish_requests(["rb"])
        # A corrupt object fails the request at once.
        assert isinstance(c0, InprocConnector)
        c0.inject_raw(1, "Z_0_0", b"not a payload")
        assert receiver.load_async("rz", "Z")
        (failure,) = collect(receiver, lambda a: bool(a.failed)).failed
        assert failure.kind is FailureKind.RECEIVE_FAILED and failure.internal_id == "rz"
        assert set(receiver.take_external_failures()) == {"Z"}
        receiver.finish_requests(["rz"])
        assert_no_leaks([sender, receiver], [c0, c1], hub.live_keys)
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_middle_stage_adapter_relays_and_cleans_both_roles() -> None:
    """Stage 0 → stage 1 (receives and sends, one adapter) → stage 2."""
    store = FakeStore()
    conns = [FakeConnector(store, s) for s in range(3)]
    first = TransferAdapter(conns[0], make_config(0, send_to_stage=1))
    middle = TransferAdapter(conns[1], make_config(1, receive_from_stage=0, send_to_stage=2))
    last = TransferAdapter(conns[2], make_config(2, receive_from_stage=1))
    adapters = [first, middle, last]
    try:
        for j in range(3):
            first.save_async("t0", "REQ", {"ids": [j]}, is_finished=j == 2)
        # The middle stage's scheduler: wait for a chunk, forward what it made of it.
        done = False
        while not done:
            assert middle.load_async("t1", "REQ")
            (chunk,) = collect(middle, ready_for("t1")).ready
            done = chunk.is_finished
            codes = {"codes": {"audio": torch.tensor(chunk.payload["ids"] * 2)}} if not done else None
            assert middle.save_async("t1", "REQ", codes, is_finished=done) is SaveResult.ENQUEUED
        # The terminal's completion released the middle stage's state for t1, both roles.
        assert middle.flush()
        assert_only_retired(middle, "REQ")
        # (Its puts stay in the budget until stage 2 consumes them.)
        assert set(middle.leak_state()) == {"budget_records"}
        prompts = []
        while not last.is_upstream_exhausted("t2"):
            assert last.load_async("t2", "REQ")
            (c,) = collect(last, ready_for("t2")).ready
            prompts.append([] if c.payload is None else c.payload["codes"]["audio"].tolist())
        assert prompts == [[0, 0], [1, 1], []]
        last.finish_requests(["t2"])
        assert_no_leaks(adapters, conns, store.live_keys)
    finally:
        for a in adapters:
            a.shutdown()

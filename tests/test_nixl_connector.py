"""The nixl connector beyond the shared contract: across processes over TCP, dead peers,
leases, corrupt reads (the contract suite itself runs on nixl in test_connectors_contract)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from omnirelay.connectors import GetStatus, create_connector
from omnirelay.errors import ConnectorError

pytest.importorskip("nixl_cu12")

_CTX = mp.get_context("spawn")
_SIZES = [16, 50_000, 4 << 20 // 4]  # float32 elements: 64 B, 200 KB, 4 MB


def _producer(namespace: str, reader_at: str, n: int, ready: Any, release: Any) -> None:
    if reader_at.startswith("tcp://"):
        os.environ["UCX_TLS"] = "tcp"  # a spawned process of its own
        prod = create_connector(
            "nixl", namespace=namespace, stage_id=1, endpoints={1: "tcp://127.0.0.1:0", 2: reader_at}
        )
    else:  # one host: abstract-socket notices, UCX's own choice of transport
        prod = create_connector("nixl", namespace=namespace, stage_id=1)
    for i in range(n):
        obj = {"i": i, "t": torch.full((_SIZES[i % len(_SIZES)],), float(i))}
        assert prod.put(1, 2, f"S_1_{i}", obj).ok
    ready.set()
    release.wait(60)
    deadline = time.monotonic() + 10
    while prod.num_objects() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)  # acks are on their way
    prod.reap_consumed()
    assert prod.pending_keys() == [] and prod.num_objects() == 0  # type: ignore[attr-defined]
    prod.close()
    assert prod.num_registered() == 0  # type: ignore[attr-defined]


def _reader(tcp: bool, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    if not tcp:
        monkeypatch.delenv("UCX_TLS", raising=False)
        return create_connector("nixl", namespace=namespace, stage_id=2, claim_timeout_s=0.5)
    monkeypatch.setenv("UCX_TLS", "tcp")
    return create_connector(
        "nixl", namespace=namespace, stage_id=2, endpoints={2: "tcp://127.0.0.1:0"}, claim_timeout_s=0.5
    )


def _collect(cons: Any, keys: set[str]) -> dict[str, Any]:
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while len(got) < len(keys) and time.monotonic() < deadline:
        for key in cons.wait_arrivals(2, timeout=1):
            res = cons.get(1, 2, key)
            assert res.status is GetStatus.READY, res.error
            assert key not in got
            got[key] = res.obj
    return got


@pytest.mark.parametrize("tcp", [True, False], ids=["tcp", "one-host"])
def test_a_stream_crosses_processes_exactly_once(
    namespace: str, tcp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cons = _reader(tcp, namespace, monkeypatch)
    ready, release = _CTX.Event(), _CTX.Event()
    n = 9
    proc = _CTX.Process(target=_producer, args=(namespace, cons.listening_at, n, ready, release))
    proc.start()
    try:
        got = _collect(cons, {f"S_1_{i}" for i in range(n)})
        assert sorted(got) == sorted(f"S_1_{i}" for i in range(n))
        for i in range(n):
            obj = got[f"S_1_{i}"]
            assert obj["i"] == i and torch.equal(obj["t"], torch.full((_SIZES[i % len(_SIZES)],), float(i)))
        assert cons.get(1, 2, "S_1_0").status is GetStatus.NOT_YET  # consumed once
    finally:
        release.set()
        proc.join(30)
        cons.close()
    assert proc.exitcode == 0
    assert cons.num_registered() == 0 and cons.num_notices() == 0


def _put_and_hang(namespace: str, reader_at: str, ready: Any) -> None:
    os.environ["UCX_TLS"] = "tcp"
    prod = create_connector(
        "nixl", namespace=namespace, stage_id=1, endpoints={1: "tcp://127.0.0.1:0", 2: reader_at}
    )
    assert prod.put(1, 2, "D_1_0", {"x": 1}).ok
    assert prod.put(1, 2, "D_1_1", {"x": 2}).ok
    ready.set()
    time.sleep(60)


def test_a_dead_producers_object_fails_fast_and_names_it(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cons = _reader(True, namespace, monkeypatch)
    ready = _CTX.Event()
    proc = _CTX.Process(target=_put_and_hang, args=(namespace, cons.listening_at, ready))
    proc.start()
    try:
        assert ready.wait(30)
        deadline = time.monotonic() + 10
        seen: set[str] = set()
        while seen != {"D_1_0", "D_1_1"}:
            seen.update(cons.wait_arrivals(2, timeout=1))
            assert time.monotonic() < deadline
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        res = cons.get(1, 2, "D_1_0")
        assert res.status is GetStatus.FAILED  # announced, then unreachable: not NOT_YET
        assert time.monotonic() - t0 < 2.0
        assert "did not answer" in (res.error or "") and "omnirelay-" in (res.error or "")
        assert cons.get(1, 2, "D_1_0").status is GetStatus.NOT_YET  # the notice is spent
        t0 = time.monotonic()  # the producer's other object: no second wait on a silent producer
        res = cons.get(1, 2, "D_1_1")
        assert res.status is GetStatus.FAILED and "stopped answering" in (res.error or "")
        assert time.monotonic() - t0 < 0.2
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        cons.close()
    assert cons.num_notices() == 0


def test_a_release_forgets_a_dead_producers_notices_so_a_reused_id_never_waits_on_it(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reading stage's release calls ``cleanup_prefix`` on the incoming prefix
    (docs/protocol.md §2.8): the notices of a producer that died go with it, so a get of
    the key a reuse of the id reads is NOT_YET at once, never FAILED after the claim timeout."""
    cons = _reader(True, namespace, monkeypatch)
    ready = _CTX.Event()
    proc = _CTX.Process(target=_put_and_hang, args=(namespace, cons.listening_at, ready))
    proc.start()
    try:
        assert ready.wait(30)
        deadline = time.monotonic() + 10
        while cons.num_notices() < 2:
            cons.wait_arrivals(2, timeout=1)
            assert time.monotonic() < deadline
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert cons.cleanup_prefix("D_1_") == 0  # none of them its own to withdraw
        assert cons.num_notices() == 0
        t0 = time.monotonic()
        assert cons.get(1, 2, "D_1_0").status is GetStatus.NOT_YET
        assert time.monotonic() - t0 < 0.2
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        cons.close()


@pytest.fixture
def pair(namespace: str) -> Any:
    prod = create_connector("nixl", namespace=namespace, stage_id=1, lease_s=0.2)
    cons = create_connector("nixl", namespace=namespace, stage_id=2)
    yield prod, cons
    prod.close()
    cons.close()
    assert prod.num_registered() == 0 and cons.num_registered() == 0  # type: ignore[attr-defined]


def _arrive(cons: Any, key: str) -> None:
    deadline = time.monotonic() + 10
    while key not in cons.wait_arrivals(2, timeout=1):
        assert time.monotonic() < deadline


def test_a_claim_never_acknowledged_is_reclaimed_by_its_lease(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prod, cons = pair
    monkeypatch.setattr(cons._reader, "_ack", lambda notice, ok: None)  # the reader "dies" after its READ
    assert prod.put(1, 2, "L_1_0", {"x": torch.zeros(100)}).ok
    _arrive(cons, "L_1_0")
    assert cons.get(1, 2, "L_1_0").is_ready
    assert prod.cleanup("L_1_0") is False  # the reader's, lease or not
    deadline = time.monotonic() + 10
    while prod.num_objects():
        assert time.monotonic() < deadline, "the lease never reclaimed the object"
        time.sleep(0.02)
    assert "never acknowledged" in (prod.health().last_error or "")
    prod.reap_consumed()
    assert prod.pending_keys() == []


def test_a_corrupt_object_fails_is_consumed_and_freed(pair: Any) -> None:
    prod, cons = pair
    assert prod.put(1, 2, "C_1_0", {"x": torch.arange(1000)}).ok
    item = next(iter(prod._producer._objects.values()))
    item.buf.array[64:80] = 0xFF  # the payload's prefix, as a bad host would deliver it
    _arrive(cons, "C_1_0")
    res = cons.get(1, 2, "C_1_0")
    assert res.status is GetStatus.FAILED and "corrupt" in (res.error or "")
    assert cons.get(1, 2, "C_1_0").status is GetStatus.NOT_YET
    deadline = time.monotonic() + 10
    while prod.num_objects():  # the failed reader still acknowledges
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_frame_of_another_object_is_refused(pair: Any) -> None:
    prod, cons = pair
    assert prod.put(1, 2, "F_1_0", {"x": 1}).ok
    item = next(iter(prod._producer._objects.values()))
    item.buf.array[8:16] = 0  # header names another object: a buffer reused under a late reader
    _arrive(cons, "F_1_0")
    res = cons.get(1, 2, "F_1_0")
    assert res.status is GetStatus.FAILED and "not " in (res.error or "")


def test_invalid_options_are_refused(namespace: str) -> None:
    for bad in ({"lease_s": 0}, {"endpoints": {1: "nowhere"}}, {"progress_delay_us": -1}, {"nope": 1}):
        with pytest.raises(ConnectorError):
            create_connector("nixl", namespace=namespace, stage_id=1, **bad)


# -- after a producer dies: its notices never reach another incarnation's objects ----------


def _incarnation(namespace: str, reader_at: str, claim_at: str | None, puts: Any, conn: Any) -> None:
    """A producer process over TCP; ``claim_at``: bind the claim server there (the port of
    a producer that died: a process that got it again). It runs the puts ``conn`` sends —
    ``(key, payload, to_replica)`` — answering each with its claim endpoint, then on
    ``"withdraw KEY"`` answers whether it could still withdraw KEY (nobody claimed it)."""
    os.environ["UCX_TLS"] = "tcp"
    if claim_at is not None:
        from omnirelay.connectors.nixl import connector as module

        real = module.Producer

        def at_that_port(**kw: Any) -> Any:
            return real(**{**kw, "claim_at": claim_at})

        module.Producer = at_that_port  # type: ignore[misc,assignment]
    prod = create_connector(
        "nixl", namespace=namespace, stage_id=1, endpoints={1: "tcp://127.0.0.1:0", 2: reader_at}
    )
    for key, payload, to_replica in puts:
        assert prod.put(1, 2, key, {"who": payload}, to_replica).ok
    conn.send(prod._producer.claim_at)  # type: ignore[attr-defined]
    while True:
        msg = conn.recv()
        if msg == "close":
            break
        conn.send(prod.cleanup(msg.split(" ", 1)[1]))
    prod.close()


def test_a_dead_producers_notice_never_takes_an_object_of_the_process_after_it(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reader holds the notice of R_1_0 that producer A sent; A is SIGKILLed. Producer
    # B gets A's claim port and puts R_1_0 again (a rerun reusing the id; the same object
    # id, as each process counts from 1), its notice not here yet. A get of R_1_0 then
    # claims with A's notice at A's endpoint — B's. B must refuse it: otherwise the stale
    # notice takes B's object (lost to the request that reused the id, which then waits
    # for it for ever) and the read from dead A fails.
    cons = _reader(True, namespace, monkeypatch)
    here_a, there_a = _CTX.Pipe()
    a = _CTX.Process(
        target=_incarnation, args=(namespace, cons.listening_at, None, [("R_1_0", "A", 0)], there_a)
    )
    a.start()
    b: Any = None
    here_b: Any = None
    try:
        assert here_a.poll(30)
        claim_at = here_a.recv()
        _arrive(cons, "R_1_0")
        os.kill(a.pid or 0, signal.SIGKILL)
        a.join(10)
        here_b, there_b = _CTX.Pipe()
        # B's R_1_0 is announced to another replica's inbox: this reader still holds A's notice.
        puts = [("R_1_0", "B", 1)]
        b = _CTX.Process(target=_incarnation, args=(namespace, cons.listening_at, claim_at, puts, there_b))
        b.start()
        assert here_b.poll(30) and here_b.recv() == claim_at  # B answers at A's claim port
        res = cons.get(1, 2, "R_1_0")
        assert res.status is GetStatus.NOT_YET, (res.status, res.obj, res.error)
        here_b.send("withdraw R_1_0")
        assert here_b.poll(30) and here_b.recv() is True  # B's object was never taken
        here_b.send("close")
        b.join(30)
        assert b.exitcode == 0
    finally:
        for proc in (a, b):
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(10)
        cons.close()
    assert cons.num_notices() == 0

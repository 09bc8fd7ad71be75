"""shm backend specifics: cross-process transfer, exclusive claims, corruption, ENOSPC,
crash reclamation. Every test ends with the namespace leak audit (conftest)."""

from __future__ import annotations

import dataclasses
import errno
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
from typing import Any

import pytest
import torch

from omnirelay.connectors import GetStatus, create_connector
from omnirelay.connectors.shm import names, slot, sweep
from omnirelay.connectors.shm.connector import ShmConnector
from tests.conftest import shm_entries

CTX = mp.get_context("spawn")


def _producer(namespace: str, n: int, published: Any, release: Any) -> None:
    conn = create_connector("shm", namespace=namespace, stage_id=1, sweep_on_start=False)
    for i in range(n):
        assert conn.put(1, 2, f"P_1_{i}", {"i": i, "t": torch.full((64,), i)}).ok
    published.set()
    release.wait(60)
    conn.close()


def _reader(namespace: str, key: str, barrier: Any, out: Any) -> None:
    conn = create_connector("shm", namespace=namespace, stage_id=2, listen=False, sweep_on_start=False)
    barrier.wait(60)
    got = conn.get(1, 2, key)
    out.put((got.status.value, got.obj))
    conn.close()


def _consume_all(namespace: str, keys: list[str], done: Any) -> None:
    conn = create_connector("shm", namespace=namespace, stage_id=2, listen=False, sweep_on_start=False)
    for k in keys:
        assert conn.get(1, 2, k).is_ready
    conn.close()
    done.set()


def test_cross_process_stream_with_notices(namespace: str) -> None:
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    published, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_producer, args=(namespace, 20, published, release))
    p.start()
    try:
        seen: list[str] = list(cons.wait_arrivals(2, timeout=30))  # woken by the first notice
        assert seen
        assert published.wait(60)
        while arrived := cons.wait_arrivals(2, timeout=0):
            seen += arrived
        # Notices past the socket queue (net.unix.max_dgram_qlen) may be lost while the
        # producer outruns us; the rest name each key once, and every key is there to get.
        assert len(seen) == len(set(seen)) and set(seen) <= {f"P_1_{i}" for i in range(20)}
        for i in range(20):
            got = cons.get(1, 2, f"P_1_{i}")
            assert got.is_ready and got.obj["i"] == i and torch.equal(got.obj["t"], torch.full((64,), i))
    finally:
        release.set()
        p.join(60)
        cons.close()
    assert p.exitcode == 0


def test_two_reader_processes_exactly_one_ready(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    assert prod.put(1, 2, "RACE_1_0", {"v": 42}).ok
    barrier, out = CTX.Barrier(2), CTX.Queue()
    readers = [CTX.Process(target=_reader, args=(namespace, "RACE_1_0", barrier, out)) for _ in range(2)]
    for r in readers:
        r.start()
    results = [out.get(timeout=60) for _ in readers]
    for r in readers:
        r.join(60)
    statuses = sorted(s for s, _ in results)
    assert statuses == ["not_yet", "ready"], results
    assert [o for s, o in results if s == "ready"] == [{"v": 42}]
    assert prod.reap_consumed() == 1 and prod.pending_keys() == []
    prod.close()


def test_idle_reap_drains_after_consumption_elsewhere(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    keys = [f"I{i}_1_0" for i in range(100)]
    for k in keys:
        assert prod.put(1, 2, k, {"k": k}).ok
    done = CTX.Event()
    c = CTX.Process(target=_consume_all, args=(namespace, keys, done))
    c.start()
    assert done.wait(60)
    c.join(60)
    passes = 0
    while prod.pending_keys():
        prod.reap_consumed()  # what the adapter's idle send loop does
        passes += 1
        assert passes <= 3
    assert prod.health().live_bytes == 0
    prod.close()


def test_housekeeping_forgets_mappings_of_a_dead_producers_slots(namespace: str) -> None:
    # The sweep unlinks a dead producer's slot files, but their memory lives on while a
    # consumer's mapping cache holds them: housekeeping must drop those mappings.
    published, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_producer, args=(namespace, 4, published, release))
    p.start()
    assert published.wait(60)
    cons = create_connector("shm", namespace=namespace, stage_id=2, listen=False, dead_owner_scan_s=0.0)
    try:
        for i in range(4):
            assert cons.get(1, 2, f"P_1_{i}").is_ready
        assert len(cons._maps) >= 1
        assert cons._maps.drop_dead_owners(lambda owner: True) == 0  # a live producer's stay
        p.kill()
        p.join(60)
        assert sweep(namespace, reclaim=True).reclaimed  # its slot files, unlinked
        cons.reap_consumed()
        assert len(cons._maps) == 0 and cons._maps.nbytes == 0
        assert cons.num_dead_mappings_dropped >= 1
    finally:
        cons.close()


def test_garbage_object_fails_consumed_and_removed(namespace: str) -> None:
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    path = os.path.join("/dev/shm", names.key_name(namespace, "BAD_1_0"))
    with open(path, "wb") as f:
        f.write(b"\x00garbage" * 100)
    got = cons.get(1, 2, "BAD_1_0")
    assert got.status is GetStatus.FAILED and "not an omnirelay object" in (got.error or "")
    assert not os.path.exists(path)
    assert cons.get(1, 2, "BAD_1_0").status is GetStatus.NOT_YET
    assert cons.health().num_get_failures == 1
    cons.close()


def test_corrupt_payload_fails_and_slot_returns_to_pool(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert prod.put(1, 2, "C_1_0", {"t": torch.ones(100)}).ok
    path = os.path.join("/dev/shm", names.key_name(namespace, "C_1_0"))
    with open(path, "r+b") as f:
        hdr = f.read(slot.HEADER_SIZE)
        key_len = slot.key_len_of(hdr)
        f.seek(slot.payload_offset(key_len))
        f.write(b"NOPE")  # break the payload magic
    got = cons.get(1, 2, "C_1_0")
    assert got.status is GetStatus.FAILED and "corrupt payload" in (got.error or "")
    assert cons.get(1, 2, "C_1_0").status is GetStatus.NOT_YET  # consumed: never read twice
    assert prod.reap_consumed() == 1 and prod.pending_keys() == []
    assert not os.path.exists(path)  # the producer's reap removed the name
    assert prod.put(1, 2, "C_1_1", {"ok": True}).ok  # the slot is reusable
    assert cons.get(1, 2, "C_1_1").obj == {"ok": True}
    prod.close()
    cons.close()


def test_enospc_put_fails_and_leaves_nothing(namespace: str) -> None:
    def full_allocator(path: str, size: int) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    prod = ShmConnector(namespace, 1, allocator=full_allocator)
    res = prod.put(1, 2, "F_1_0", torch.zeros(1 << 16))
    assert not res.ok and "no space left in /dev/shm" in (res.error or "")
    assert shm_entries(namespace) == [] and prod.pending_keys() == []
    assert prod.health().num_put_failures == 1 and prod.health().last_error
    prod.close()


def _closing_allocator(conn: list[ShmConnector]) -> Any:
    """An allocator that closes the connector first: ``close`` runs while the put that
    asked for the slot is in flight (forced on one thread, no timing involved)."""
    from omnirelay.connectors.shm.connector import default_allocator

    def allocate(path: str, size: int) -> Any:
        conn[0].close()
        return default_allocator(path, size)

    return allocate


def test_close_during_a_put_withdraws_its_object(namespace: str) -> None:
    holder: list[ShmConnector] = []
    prod = ShmConnector(namespace, 1, allocator=_closing_allocator(holder))
    holder.append(prod)
    cons = ShmConnector(namespace, 2)
    res = prod.put(1, 2, "W_1_0", {"x": torch.arange(8)})
    assert not res.ok and "closed during the put" in (res.error or "")
    assert prod.pending_keys() == []
    assert cons.get(1, 2, "W_1_0").status is GetStatus.NOT_YET  # never visible after the put
    cons.close()
    assert shm_entries(namespace) == []  # close released the rest; the put its own object


def test_close_during_a_put_that_a_reader_already_took(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder: list[ShmConnector] = []
    prod = ShmConnector(namespace, 1, allocator=_closing_allocator(holder))
    holder.append(prod)
    cons = ShmConnector(namespace, 2)
    got: list[Any] = []
    real_link = os.link

    def link_then_read(src: str, dst: str) -> None:
        real_link(src, dst)  # the key's name exists now: a reader takes the object by it
        got.append(cons.get(1, 2, "R_1_0"))

    monkeypatch.setattr(os, "link", link_then_read)
    res = prod.put(1, 2, "R_1_0", {"x": torch.arange(8)})
    monkeypatch.undo()
    assert len(got) == 1 and got[0].status is GetStatus.READY
    assert torch.equal(got[0].obj["x"], torch.arange(8))
    assert res.ok  # delivered: the reader has it
    assert prod.pending_keys() == []
    cons.close()
    assert shm_entries(namespace) == []


def test_a_put_reports_its_bytes_when_its_reader_was_faster(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader may consume the object between its notice and the end of the put, and the
    put's own reap then recycles the slot: the result still reports the bytes put (the
    adapter's byte budget books them)."""
    from omnirelay.payload import codec

    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    obj = {"x": torch.arange(8)}
    expected = codec.plan_encode(obj).nbytes
    got: list[Any] = []
    real_link = os.link

    def link_then_read(src: str, dst: str) -> None:
        real_link(src, dst)
        got.append(cons.get(1, 2, "N_1_0"))  # consumed before the put returns

    monkeypatch.setattr(os, "link", link_then_read)
    res = prod.put(1, 2, "N_1_0", obj)
    monkeypatch.undo()
    assert got[0].is_ready and got[0].nbytes == expected
    assert res.ok and res.nbytes == expected
    assert prod.pending_keys() == [] and prod.health().bytes_put == expected  # reaped in the put
    prod.close()
    cons.close()


def _dead_pid() -> int:
    p = CTX.Process(target=os.getpid)
    p.start()
    p.join()
    assert p.pid is not None
    return p.pid


def test_slot_claimed_by_a_dead_consumer_is_reclaimed(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    assert prod.put(1, 2, "Z_1_0", {"z": 1}).ok
    # Simulate a consumer that claimed the object (CLAIMED), removed its name, then died.
    path = os.path.join("/dev/shm", names.key_name(namespace, "Z_1_0"))
    with open(path, "r+b") as f:
        buf = bytearray(f.read(slot.HEADER_SIZE))
        slot.write_claim(buf, _dead_pid(), 1)
        f.seek(0)
        f.write(buf)
    os.unlink(path)
    assert prod.reap_consumed() == 1 and prod.pending_keys() == []
    prod.close()


def test_sigkilled_producer_is_swept_live_owner_kept(namespace: str) -> None:
    live = create_connector("shm", namespace=namespace, stage_id=1)
    for i in range(3):
        assert live.put(1, 2, f"LIVE_1_{i}", {"i": i}).ok
    published, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_producer, args=(namespace, 10, published, release))
    p.start()
    assert published.wait(60)
    os.kill(p.pid or 0, signal.SIGKILL)
    p.join(60)
    before = sweep(namespace)
    dead = [o for o in before.objects if o.owner_alive is False]
    assert len([o for o in dead if o.kind == "object"]) == 10
    assert {o.key for o in dead if o.kind == "object"} == {f"P_1_{i}" for i in range(10)}
    report = sweep(namespace, reclaim=True)
    assert len([o for o in report.reclaimed if o.kind == "object"]) == 10
    assert all(o.owner_pid == p.pid for o in report.reclaimed)
    left = sweep(namespace)
    assert all(o.owner_alive for o in left.objects)
    assert len([o for o in left.objects if o.kind == "object"]) == 3
    cons = create_connector("shm", namespace=namespace, stage_id=2)  # its startup sweep is harmless
    for i in range(3):
        assert cons.get(1, 2, f"LIVE_1_{i}").obj == {"i": i}
    live.close()
    cons.close()


def _producer_then_killed(namespace: str, pipe: Any) -> None:
    """Put R_1_0, wait until it was read, then R_1_1 into the same pooled slot; then wait
    to be killed with R_1_1 unread."""
    conn = create_connector("shm", namespace=namespace, stage_id=1, sweep_on_start=False)
    assert conn.put(1, 2, "R_1_0", {"t": torch.full((64,), 1)}).ok
    pipe.send("put")
    pipe.recv()  # read by the consumer
    assert conn.reap_consumed() == 1  # its slot is pooled again
    assert conn.put(1, 2, "R_1_1", {"t": torch.full((64,), 2)}).ok
    pipe.send("put")
    pipe.recv()  # never comes: the test kills this process


def test_a_swept_dead_producers_object_is_gone_for_a_reader_that_mapped_its_slot(namespace: str) -> None:
    # The consumer mapped the producer's pooled slot for R_1_0 and holds the arrival notice
    # of R_1_1 (same slot). The producer dies; the sweep removes its names. A request that
    # reuses the id R must not get the dead incarnation's R_1_1 through the cached mapping
    # and the notice.
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    here, there = CTX.Pipe()
    p = CTX.Process(target=_producer_then_killed, args=(namespace, there))
    p.start()
    try:
        assert here.poll(60) and here.recv() == "put"
        assert "R_1_0" in cons.wait_arrivals(2, timeout=30)
        assert cons.get(1, 2, "R_1_0").obj["t"][0] == 1
        here.send("read")
        assert here.poll(60) and here.recv() == "put"
        assert "R_1_1" in cons.wait_arrivals(2, timeout=30)  # its hint names the mapped slot
    finally:
        os.kill(p.pid or 0, signal.SIGKILL)
        p.join(60)
    report = sweep(namespace, reclaim=True)
    assert {o.key for o in report.reclaimed if o.kind == "object"} == {"R_1_1"}
    got = cons.get(1, 2, "R_1_1")
    assert got.status is GetStatus.NOT_YET, got.obj
    cons.close()


def test_names_are_prefixed_and_fixed_length(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    assert prod.put(1, 2, "../" * 300, {"x": 1}).ok
    entries = shm_entries(namespace)
    assert entries and all(e.startswith(f"omnirelay-{namespace}-") and len(e) < 120 for e in entries)
    objs = [o for o in sweep(namespace).objects if o.kind == "object"]
    assert [o.key for o in objs] == ["../" * 300]  # recoverable for audits
    prod.close()


def test_invalid_namespace_and_options_are_rejected() -> None:
    from omnirelay.errors import ConfigError, ConnectorError

    for ns in ("", "a-b", "a/b", "x" * 100, "../x"):
        with pytest.raises(ConnectorError):
            create_connector("shm", namespace=ns)
    with pytest.raises(ConnectorError, match="unknown shm connector option"):
        create_connector("shm", namespace="ok", bogus=1)
    with pytest.raises(ConnectorError, match="pool_max_slots"):
        create_connector("shm", namespace="ok", pool_max_slots=-1)
    with pytest.raises(ConfigError, match="unknown connector backend"):
        create_connector("nccl", namespace="ok")


def test_notice_overflow_is_signalled_not_silently_lost(namespace: str) -> None:
    """Linux queues only a few datagrams per socket (net.unix.max_dgram_qlen, 10 by
    default): when notices overflow, the receiver is told to poll everything."""
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    with open("/proc/sys/net/unix/max_dgram_qlen") as f:
        qlen = int(f.read())
    n = qlen + 20
    for i in range(n):
        assert prod.put(1, 2, f"O_1_{i}", i).ok
    first = cons.wait_arrivals(2, timeout=0)
    assert len(first) < n  # some notices did not fit
    assert prod.health().num_notices_lost == n - len(first)
    prod.reap_consumed()  # room again: the overflow marker goes out
    second = cons.wait_arrivals(2, timeout=5)
    assert second.overflowed is True
    for i in range(n):  # what a receiver does on overflow: poll every key it waits for
        assert cons.get(1, 2, f"O_1_{i}").obj == i
    prod.reap_consumed()
    assert prod.pending_keys() == []
    prod.close()
    cons.close()


def test_two_connectors_of_one_namespace_in_one_process(namespace: str) -> None:
    a = create_connector("shm", namespace=namespace, stage_id=1)
    b = create_connector("shm", namespace=namespace, stage_id=2)
    c = create_connector("shm", namespace=namespace, stage_id=3)
    assert a.put(1, 2, "X_1_0", {"from": "a"}).ok
    assert b.put(2, 3, "X_2_0", {"from": "b"}).ok  # distinct slot files, no name clash
    assert b.get(1, 2, "X_1_0").obj == {"from": "a"}
    assert c.get(2, 3, "X_2_0").obj == {"from": "b"}
    for conn in (a, b, c):
        conn.reap_consumed()
        assert conn.pending_keys() == []
        conn.close()


class _PreemptingLock:
    """Wraps a connector's lock; runs ``hook`` right after the next release (forces an
    interleaving between a lookup under the lock and the I/O that follows it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hook: Any = None

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        result = self.inner.__exit__(*exc)
        hook, self.hook = self.hook, None
        if hook:
            hook()
        return result


def test_cleanup_never_removes_a_recycled_slots_new_object(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert prod.put(1, 2, "A_1_0", {"v": 1}).ok
    lock = _PreemptingLock(prod._producer._lock)  # type: ignore[attr-defined]
    prod._producer._lock = lock  # type: ignore[attr-defined]

    def others() -> None:  # a reader takes A, the slot is recycled for B
        assert cons.get(1, 2, "A_1_0").status is GetStatus.READY
        assert prod.reap_consumed() == 1
        assert prod.put(1, 2, "B_1_0", {"v": 2}).ok

    lock.hook = others
    assert prod.cleanup("A_1_0") is False  # A was consumed; B must be untouched
    assert cons.get(1, 2, "B_1_0").obj == {"v": 2}
    prod.reap_consumed()
    assert prod.pending_keys() == []
    prod.close()
    cons.close()


# ---------------------------------------------------------------- notices carry the slot


def test_get_through_a_notice_needs_no_name_and_the_reap_removes_it(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert prod.put(1, 2, "H_1_0", {"v": 1}).ok
    assert list(cons.wait_arrivals(2, timeout=0)) == ["H_1_0"]
    path = os.path.join("/dev/shm", names.key_name(namespace, "H_1_0"))
    assert cons.get(1, 2, "H_1_0").obj == {"v": 1}
    assert cons.get(1, 2, "H_1_0").status is GetStatus.NOT_YET  # the name lingers, consumed
    assert os.path.exists(path)
    assert prod.reap_consumed() == 1 and not os.path.exists(path)
    prod.close()
    cons.close()


def test_stale_notice_never_takes_the_slots_next_object(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    other = create_connector("shm", namespace=namespace, stage_id=3, listen=False)
    assert prod.put(1, 2, "A_1_0", {"v": 1}).ok
    assert list(cons.wait_arrivals(2, timeout=0)) == ["A_1_0"]  # hint: slot s, seq 1
    assert other.get(1, 2, "A_1_0").obj == {"v": 1}  # someone else took A by its name
    assert prod.reap_consumed() == 1
    assert prod.put(1, 2, "B_1_0", {"v": 2}).ok  # same slot, seq 2
    assert prod.health().pool_slots == 1
    assert cons.get(1, 2, "A_1_0").status is GetStatus.NOT_YET  # stale hint: CAS fails
    assert cons.get(1, 2, "B_1_0").obj == {"v": 2}
    prod.reap_consumed()
    assert prod.pending_keys() == []
    for c in (prod, cons, other):
        c.close()


def test_forged_notices_are_ignored_and_lose_nothing(namespace: str) -> None:
    from omnirelay.connectors.shm import notice_address

    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert prod.put(1, 2, "F_1_0", {"v": 1}).ok
    assert prod.put(1, 2, "G_1_0", {"v": 2}).ok
    slot_names = [e for e in shm_entries(namespace) if f"{namespace}-s-" in e]
    forger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = notice_address(namespace, 2)
    try:
        forger.sendto(b"\x00garbage", addr)  # not a notice: poll everything
        head = struct.pack("<BQH", 0x4E, 1, len("../../etc/passwd")) + b"../../etc/passwd"
        forger.sendto(head + b"F_1_0", addr)  # a path outside /dev/shm: hint ignored
        for name in slot_names:  # real slots, wrong keys or seqs: CAS or key check fails
            for seq in (1, 2, 99):
                forger.sendto(struct.pack("<BQH", 0x4E, seq, len(name)) + name.encode() + b"F_1_0", addr)
    finally:
        forger.close()
    arrivals = cons.wait_arrivals(2, timeout=0)
    assert arrivals.overflowed
    assert cons.get(1, 2, "F_1_0").obj == {"v": 1}
    assert cons.get(1, 2, "G_1_0").obj == {"v": 2}
    prod.reap_consumed()
    assert prod.pending_keys() == []
    prod.close()
    cons.close()


def test_put_of_a_key_another_producer_holds_is_retracted(namespace: str) -> None:
    a = create_connector("shm", namespace=namespace, stage_id=1)
    b = create_connector("shm", namespace=namespace, stage_id=3, listen=False)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert b.put(3, 2, "K_1_0", {"from": "b"}).ok
    res = a.put(1, 2, "K_1_0", {"from": "a"})
    assert not res.ok and "already published by another producer" in (res.error or "")
    assert a.pending_keys() == [] and a.health().num_put_failures == 1
    cons.wait_arrivals(2, timeout=0)  # both notices: a's hint now fails its CAS
    assert cons.get(1, 2, "K_1_0").obj == {"from": "b"}
    assert cons.get(1, 2, "K_1_0").status is GetStatus.NOT_YET
    res = a.put(1, 2, "K_1_0", {"from": "a"})
    assert not res.ok  # consumed, but its name is b's until b reaps
    assert b.reap_consumed() == 1
    assert a.put(1, 2, "K_1_0", {"from": "a"}).ok
    assert cons.get(1, 2, "K_1_0").obj == {"from": "a"}
    for c in (a, b, cons):
        c.reap_consumed()
        assert c.pending_keys() == []
        c.close()


def test_notice_taken_before_the_link_fails_counts_as_delivered(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = create_connector("shm", namespace=namespace, stage_id=1)
    b = create_connector("shm", namespace=namespace, stage_id=3, listen=False)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert b.put(3, 2, "D_1_0", {"from": "b"}).ok
    cons.wait_arrivals(2, timeout=0)
    real_link = os.link
    got: list[Any] = []

    def reader_first(src: str, dst: str) -> None:  # the notice is out; a reader wins the race
        got.extend(cons.wait_arrivals(2, timeout=0))
        got.append(cons.get(1, 2, "D_1_0").obj)
        real_link(src, dst)  # then the name clashes with b's object

    monkeypatch.setattr(os, "link", reader_first)
    res = a.put(1, 2, "D_1_0", {"from": "a"})
    monkeypatch.setattr(os, "link", real_link)
    assert got == ["D_1_0", {"from": "a"}]
    assert res.ok  # delivered through the notice: no failure to report
    a.reap_consumed()  # (the put's own reap pass may have taken it already)
    assert a.pending_keys() == [] and a.health().num_put_failures == 0
    assert cons.get(1, 2, "D_1_0").obj == {"from": "b"}  # b's object untouched
    for c in (a, b, cons):
        c.reap_consumed()
        assert c.pending_keys() == []
        c.close()


def _backends() -> list[Any]:
    from omnirelay.connectors.shm import atomics

    return [atomics.EXTENSION, atomics.LIBATOMIC]


@pytest.mark.parametrize("backend_index", [0, 1], ids=["c-extension", "libatomic-ctypes"])
def test_atomic_word_compare_and_swap(backend_index: int) -> None:
    import mmap

    from omnirelay.connectors.shm.atomics import Word

    backend, other_backend = _backends()[backend_index], _backends()[1 - backend_index]
    assert backend is not None and other_backend is not None, (
        "the C extension is not built (pip install -e . compiles it) or libatomic is missing"
    )
    mm = mmap.mmap(-1, 4096)
    w = Word(mm, 8, backend)
    other = Word(mm, 8, other_backend)  # both kinds act on one word
    assert w.load() == 0
    assert w.cas(0, slot.stamp(slot.PUBLISHED, 7))
    assert not w.cas(0, 1) and w.load() == slot.stamp(slot.PUBLISHED, 7)
    assert not w.cas(slot.stamp(slot.PUBLISHED, 6), slot.stamp(slot.CLAIMED, 6))  # another publish
    assert w.cas(slot.stamp(slot.PUBLISHED, 7), slot.stamp(slot.CLAIMED, 7))
    w.store(slot.stamp(slot.FREE, 7))
    assert slot.read_state(mm) == slot.FREE
    assert other.load() == slot.stamp(slot.FREE, 7) and other.cas(slot.stamp(slot.FREE, 7), 2**64 - 1)
    assert w.load() == 2**64 - 1  # the full 64 bits round-trip
    with pytest.raises(ValueError):
        Word(mm, 4)
    w.release()
    other.release()
    mm.close()


def test_a_claim_without_its_record_is_not_taken_for_abandoned(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader between its CAS and its claim record (or the producer's own cleanup) must
    never look dead to the reap: freeing the slot then would hand it to the next put while
    the reader copies it out."""
    from omnirelay.connectors.shm import producer as producer_module

    prod = create_connector("shm", namespace=namespace, stage_id=1)
    assert prod.put(1, 2, "R_1_0", {"v": 1}).ok
    sl = prod._producer._pending["R_1_0"]  # type: ignore[attr-defined]
    assert sl.word.cas(slot.stamp(slot.PUBLISHED, sl.seq), slot.stamp(slot.CLAIMED, sl.seq))
    for _ in range(3):  # CLAIMED, no record of this claim yet (the stale one names pid 0)
        assert prod.reap_consumed() == 0
    assert prod.pending_keys() == ["R_1_0"] and prod.cleanup("R_1_0") is False
    slot.write_claimer(sl.mm, _dead_pid(), 1)  # the record of a claimer that then died
    sl.claim_word.store(sl.seq)
    assert prod.reap_consumed() == 1 and prod.pending_keys() == []
    # A claimer killed between its CAS and its record: abandoned only after a long wait.
    assert prod.put(1, 2, "R_1_1", {"v": 2}).ok
    sl = prod._producer._pending["R_1_1"]  # type: ignore[attr-defined]
    assert sl.word.cas(slot.stamp(slot.PUBLISHED, sl.seq), slot.stamp(slot.CLAIMED, sl.seq))
    assert prod.reap_consumed() == 0
    monkeypatch.setattr(producer_module, "_UNRECORDED_CLAIM_S", -1.0)
    assert prod.reap_consumed() == 1 and prod.pending_keys() == []
    assert prod.health().pool_slots == 1  # one slot, pooled once
    prod.close()


def _greedy_reader(namespace: str, keys: list[str], barrier: Any, out: Any) -> None:
    conn = create_connector("shm", namespace=namespace, stage_id=2, listen=False, sweep_on_start=False)
    barrier.wait(60)
    got = {}
    for k in keys:
        res = conn.get(1, 2, k)
        assert res.status is not GetStatus.FAILED, res.error
        if res.is_ready:
            got[k] = res.obj["k"]
    out.put(got)
    conn.close()


def test_three_reader_processes_take_each_of_200_keys_exactly_once(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    keys = [f"X{i}_1_0" for i in range(200)]
    for k in keys:
        assert prod.put(1, 2, k, {"k": k, "t": torch.zeros(16)}).ok
    barrier, out = CTX.Barrier(3), CTX.Queue()
    readers = [
        CTX.Process(target=_greedy_reader, args=(namespace, keys[i:] + keys[:i], barrier, out))
        for i in (0, 67, 134)
    ]
    for r in readers:
        r.start()
    results = [out.get(timeout=60) for _ in readers]
    for r in readers:
        r.join(60)
        assert r.exitcode == 0
    taken = [k for got in results for k in got]
    assert sorted(taken) == sorted(keys)  # every key once: no loss, no duplicate
    assert all(v == k for got in results for k, v in got.items())
    while prod.pending_keys():
        assert prod.reap_consumed()
    prod.close()


def test_a_name_reaped_and_its_slot_recycled_under_a_reader_is_not_corruption(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader opens a key's lingering name (consumed, not reaped yet); before it reads the
    header, the producer reaps it and recycles the slot for another key. The reader must see
    NOT_YET, not a corrupt object (that failed requests whose ids were reused after an abort)."""
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    late = create_connector("shm", namespace=namespace, stage_id=3, listen=False)
    assert prod.put(1, 2, "A_0_0", {"v": 1}).ok
    cons.wait_arrivals(2, timeout=0)
    assert cons.get(1, 2, "A_0_0").obj == {"v": 1}  # its name lingers until the reap
    real_read_header = slot.read_header
    calls = []

    def recycle_first(buf: Any, size: int) -> Any:
        if not calls:
            calls.append(1)
            assert prod.reap_consumed() == 1  # name unlinked, slot pooled...
            assert prod.put(1, 2, "B_0_0", {"v": 2}).ok  # ...and reused for another key
        return real_read_header(buf, size)

    monkeypatch.setattr(slot, "read_header", recycle_first)
    got = late.get(1, 2, "A_0_0")
    monkeypatch.setattr(slot, "read_header", real_read_header)
    assert calls and got.status is GetStatus.NOT_YET, got
    assert late.health().num_get_failures == 0
    assert cons.get(1, 2, "B_0_0").obj == {"v": 2}  # untouched
    prod.reap_consumed()
    assert prod.pending_keys() == []
    for c in (prod, cons, late):
        c.close()


# ---------------------------------------------------------------- early notices
# A small object is announced before it is encoded (the receiver's wake-up overlaps the
# encoding). These tests hold the producer between its notice and its publish with an
# Event inside the encoder, so every interleaving below is forced, not hoped for.


class _HeldEncoder:
    """Replaces ``codec.plan_encode``; once armed, the next call signals ``announced``
    (the early notice is out) and waits for ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from omnirelay.payload import codec

        self.real = codec.plan_encode
        self.armed = False
        self.announced = threading.Event()
        self.release = threading.Event()
        monkeypatch.setattr(codec, "plan_encode", self)

    def __call__(self, obj: Any) -> Any:
        if self.armed:
            self.armed = False
            self.announced.set()
            assert self.release.wait(30)
        return self.real(obj)


def _slot_states(namespace: str) -> list[str]:
    states = []
    for entry in shm_entries(namespace):
        if f"{namespace}-s-" in entry:
            with open(os.path.join("/dev/shm", entry), "rb") as f:
                states.append(slot.STATE_NAMES[slot.read_state(f.read(16))])
    return states


def _teach_edge(prod: Any, cons: Any) -> None:
    """One put and get on the edge: the producer now guesses the size of the next one."""
    assert prod.put(1, 2, "T_1_0", {"v": 0}).ok
    assert list(cons.wait_arrivals(2, timeout=0)) == ["T_1_0"]
    assert cons.get(1, 2, "T_1_0").obj == {"v": 0}
    assert prod.reap_consumed() == 1


@dataclasses.dataclass
class _Held:
    """A put held between its early notice and its publish; the reader has the notice."""

    enc: _HeldEncoder
    prod: Any
    cons: Any
    thread: threading.Thread
    out: list[Any]

    def finish(self) -> Any:
        """Let the put complete; its result."""
        self.enc.release.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.out[0]

    def close(self) -> None:
        self.prod.reap_consumed()
        assert self.prod.pending_keys() == []
        self.prod.close()
        self.cons.close()


def _held_put(namespace: str, monkeypatch: pytest.MonkeyPatch, key: str, obj: Any) -> _Held:
    enc = _HeldEncoder(monkeypatch)
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    _teach_edge(prod, cons)
    enc.armed = True
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(prod.put(1, 2, key, obj)))
    thread.start()
    assert enc.announced.wait(30)
    assert list(cons.wait_arrivals(2, timeout=30)) == [key]  # announced, not written yet
    return _Held(enc, prod, cons, thread, out)


def test_a_reader_ahead_of_the_writer_waits_for_a_second_notice(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = _held_put(namespace, monkeypatch, "E_1_0", {"v": 1})
    assert _slot_states(namespace) == ["writing"]
    assert h.cons.get(1, 2, "E_1_0").status is GetStatus.NOT_YET  # waited, then asked again
    assert _slot_states(namespace) == ["writing (a reader waits)"]
    assert h.cons.get(1, 2, "E_1_0").status is GetStatus.NOT_YET  # still writing: no second wait
    assert h.finish().ok
    assert list(h.cons.wait_arrivals(2, timeout=30)) == ["E_1_0"]  # the second notice
    assert h.cons.get(1, 2, "E_1_0").obj == {"v": 1}
    assert h.prod.health().num_notices_sent == 3  # T once, E twice
    h.close()


def test_a_publish_during_the_readers_wait_is_claimed_without_a_second_notice(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = _held_put(namespace, monkeypatch, "E_1_0", {"v": 1})
    real_yield = os.sched_yield
    results: list[Any] = []

    def writer_finishes() -> None:  # the reader's first pause: the producer publishes
        results.append(h.finish())
        monkeypatch.setattr(os, "sched_yield", real_yield)

    from omnirelay.connectors.shm import reader as reader_module

    monkeypatch.setattr(reader_module, "_PUBLISH_WAIT_NS", 30 * 10**9)  # only the hook ends the wait
    monkeypatch.setattr(os, "sched_yield", writer_finishes)
    assert h.cons.get(1, 2, "E_1_0").obj == {"v": 1}
    assert results[0].ok
    assert h.prod.health().num_notices_sent == 2  # one notice per put
    assert list(h.cons.wait_arrivals(2, timeout=0)) == []
    h.close()


def test_a_publish_between_the_failed_claim_and_the_wait_is_not_lost(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stamp turns PUBLISHED after the reader's claim failed but before it looks
    again, and the key's name is not linked yet: the reader must claim through the stamp
    (no second notice will come), not fall back to the name."""
    h = _held_put(namespace, monkeypatch, "E_1_0", {"v": 1})
    real_link = os.link
    linking, link_go = threading.Event(), threading.Event()

    def held_link(src: str, dst: str) -> None:
        linking.set()
        assert link_go.wait(30)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", held_link)  # the put is held before its link
    reader = h.cons._reader
    real_claim = reader._claim
    calls = []

    def claim_then_publish(*args: Any) -> Any:
        res = real_claim(*args)
        if not calls:  # the first claim fails (WRITING); now the producer publishes
            assert res is None
            h.enc.release.set()
            assert linking.wait(30)  # published; the key's name is not there yet
        calls.append(res)
        return res

    monkeypatch.setattr(reader, "_claim", claim_then_publish)
    assert h.cons.get(1, 2, "E_1_0").obj == {"v": 1}
    link_go.set()
    assert h.finish().ok and len(calls) == 2
    h.close()


# ---------------------------------------------------------------- output stocks
# A get announced by a notice decodes into the tensors its slot's stream will likely need,
# made while the reader was idle (codec.OutputStock).


def _chunk(start: int, n: int = 800) -> Any:
    return {"codes": {"audio": torch.arange(start, start + n)}, "meta": {"left_context_size": 25}}


def _equal_chunk(a: Any, b: Any) -> bool:
    return (
        a["meta"] == b["meta"]
        and a["codes"]["audio"].dtype == b["codes"]["audio"].dtype
        and torch.equal(a["codes"]["audio"], b["codes"]["audio"])
    )


def _stock_of(cons: Any) -> Any:
    """The one output stock of the reader that has recorded a header."""
    (stock,) = [s for s in cons._reader._stocks.values() if s._entry is not None]
    return stock


def test_a_reader_waiting_for_the_publish_makes_its_outputs_ahead(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a reader waits for an announced object, it makes the tensors of the header
    its slot carried last; the get copies the bytes into them. A different header next
    leaves them unused and still decodes right."""
    h = _held_put(namespace, monkeypatch, "E_1_0", _chunk(0))
    assert h.finish().ok  # the first chunk of this stream: nothing to make ahead yet
    assert _equal_chunk(h.cons.get(1, 2, "E_1_0").obj, _chunk(0))
    assert h.prod.reap_consumed() == 1
    stock = _stock_of(h.cons)
    assert stock.num_made == 0
    got, seen = _held_put_got_while_waiting(h, stock, monkeypatch, "E_1_1", _chunk(800))
    assert _equal_chunk(got, _chunk(800))
    assert seen == 1  # the one tensor was made while the object was being written
    assert stock.num_made == 0  # and used
    got, seen = _held_put_got_while_waiting(h, stock, monkeypatch, "E_1_2", _chunk(0, 10))
    assert _equal_chunk(got, _chunk(0, 10))
    assert seen == 1 and stock.num_made == 0  # made for the old header: dropped
    h.close()


def _held_put_got_while_waiting(
    h: _Held, stock: Any, monkeypatch: pytest.MonkeyPatch, key: str, obj: Any
) -> tuple[Any, int]:
    """Put ``obj`` held after its notice; the reader gets it, and at its first pause the
    put is let go. The object got, and how many outputs were made ahead at that pause."""
    h.enc.armed = True
    h.enc.announced.clear()
    h.enc.release.clear()
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(h.prod.put(1, 2, key, obj)))
    thread.start()
    assert h.enc.announced.wait(30)
    assert list(h.cons.wait_arrivals(2, timeout=30)) == [key]
    real_yield = os.sched_yield
    seen: list[int] = []

    def writer_finishes() -> None:
        seen.append(stock.num_made)
        h.enc.release.set()
        thread.join(30)
        monkeypatch.setattr(os, "sched_yield", real_yield)

    from omnirelay.connectors.shm import reader as reader_module

    monkeypatch.setattr(reader_module, "_PUBLISH_WAIT_NS", 30 * 10**9)  # only the hook ends the wait
    monkeypatch.setattr(os, "sched_yield", writer_finishes)
    got = h.cons.get(1, 2, key).obj
    assert out[0].ok and len(seen) == 1
    assert h.prod.reap_consumed() == 1
    return got, seen[0]


def test_a_reader_about_to_sleep_makes_the_next_outputs_of_its_streams(namespace: str) -> None:
    """After a get, the stream's next outputs are made when the reader's wait_arrivals
    finds nothing and is about to sleep; the next get of the same header uses them, and
    its tensor is not the one an earlier get returned."""
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    got = []
    for i in range(2):  # the first caches the header, the second records it on the slot's stock
        assert prod.put(1, 2, f"C_1_{i}", _chunk(i)).ok
        assert list(cons.wait_arrivals(2, timeout=0)) == [f"C_1_{i}"]
        got.append(cons.get(1, 2, f"C_1_{i}").obj)
        assert _equal_chunk(got[-1], _chunk(i))
        assert prod.reap_consumed() == 1
    stock = _stock_of(cons)
    assert stock.num_made == 0
    assert list(cons.wait_arrivals(2, timeout=0)) == []  # not sleeping: nothing made
    assert stock.num_made == 0
    assert list(cons.wait_arrivals(2, timeout=0.001)) == []  # would sleep: made first
    assert stock.num_made == 1
    assert prod.put(1, 2, "C_1_2", _chunk(2)).ok
    assert list(cons.wait_arrivals(2, timeout=0)) == ["C_1_2"]
    last = cons.get(1, 2, "C_1_2").obj
    assert stock.num_made == 0  # used
    assert _equal_chunk(last, _chunk(2))
    assert all(_equal_chunk(g, _chunk(i)) for i, g in enumerate(got))  # earlier results untouched
    assert all(last["codes"]["audio"].data_ptr() != g["codes"]["audio"].data_ptr() for g in got)
    assert prod.reap_consumed() == 1
    assert prod.pending_keys() == []
    prod.close()
    cons.close()
    assert shm_entries(namespace) == []


def test_an_announced_slot_the_object_outgrows_is_withdrawn(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = torch.arange(25_000, dtype=torch.int32)  # 100 KB: more than the guessed slot
    h = _held_put(namespace, monkeypatch, "B_1_0", {"x": big})
    assert h.cons.get(1, 2, "B_1_0").status is GetStatus.NOT_YET  # the reader asks again
    assert h.finish().ok
    assert list(h.cons.wait_arrivals(2, timeout=30)) == ["B_1_0"]  # announced in its new slot
    assert torch.equal(h.cons.get(1, 2, "B_1_0").obj["x"], big)
    assert sorted(_slot_states(namespace)) == ["free", "free"]  # the withdrawn one is pooled
    h.prod.reap_consumed()
    assert h.prod.health().pool_slots == 2
    h.close()


def test_an_announced_object_that_fails_to_encode_leaves_nothing(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    _teach_edge(prod, cons)
    res = prod.put(1, 2, "X_1_0", {"v": object()})
    assert not res.ok and "unsupported type object" in (res.error or "")
    assert list(cons.wait_arrivals(2, timeout=0)) == ["X_1_0"]  # the early notice went out
    assert cons.get(1, 2, "X_1_0").status is GetStatus.NOT_YET  # nothing to wait for
    assert _slot_states(namespace) == ["free"] and prod.health().pool_slots == 1
    assert prod.pending_keys() == []
    prod.close()
    cons.close()


def test_arrivals_say_which_objects_are_small(namespace: str) -> None:
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    big = torch.zeros(512 * 1024, dtype=torch.uint8)  # 512 KiB: past SMALL_OBJECT_BYTES
    assert prod.put(1, 2, "S_1_0", {"v": torch.arange(8)}).ok
    assert prod.put(1, 2, "B_1_0", {"v": big}).ok
    got = cons.wait_arrivals(2, timeout=30)
    while len(got) < 2:
        got += cons.wait_arrivals(2, timeout=30)
    assert set(got) == {"S_1_0", "B_1_0"} and set(got.small) == {"S_1_0"}
    assert torch.equal(cons.get(1, 2, "S_1_0").obj["v"], torch.arange(8))
    assert torch.equal(cons.get(1, 2, "B_1_0").obj["v"], big)
    prod.reap_consumed()
    assert prod.pending_keys() == []
    prod.close()
    cons.close()


def test_a_small_notices_get_leaves_a_large_object_and_announces_it_again(namespace: str) -> None:
    """A small notice's get is bounded (Arrivals.small): when what it announced is gone and
    the key's name leads to a large object, that object is left in place and the key is
    announced again, not small, so the receiver fetches it like any large object."""
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    assert prod.put(1, 2, "K_1_0", {"v": 1}).ok
    first = cons.wait_arrivals(2, timeout=30)
    assert list(first) == ["K_1_0"] and set(first.small) == {"K_1_0"}  # its hint: a small slot
    assert prod.cleanup("K_1_0")  # retracted before the reader came...
    big = torch.ones(512 * 1024, dtype=torch.uint8)
    assert prod.put(1, 2, "K_1_0", {"v": big}).ok  # ...and the key published again, large
    # The get follows the small hint (the newer notice is not drained yet): bounded.
    assert cons.get(1, 2, "K_1_0").status is GetStatus.NOT_YET
    # All queued by now: the large put's early notice (small: it guessed from the last
    # object) and its notice from its real slot, then the one the get sent. The newest
    # decides: not small.
    again = cons.wait_arrivals(2, timeout=0)
    assert list(again) == ["K_1_0"] * 3 and set(again.small) == set()
    assert torch.equal(cons.get(1, 2, "K_1_0").obj["v"], big)
    prod.reap_consumed()
    assert prod.pending_keys() == []
    prod.close()
    cons.close()


@pytest.mark.parametrize(
    ("send_ext", "drain_ext"),
    [(True, True), (False, False), (True, False), (False, True)],
    ids=["c-c", "py-py", "c-py", "py-c"],
)
def test_notices_round_trip_between_both_implementations(
    namespace: str, send_ext: bool, drain_ext: bool
) -> None:
    import select

    from omnirelay.connectors.shm import notices

    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    addr = notices.address(namespace, 9)
    rx.bind(addr)
    rx.setblocking(False)
    poller = select.poll()
    poller.register(rx, select.POLLIN)
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.setblocking(False)
    try:
        key = "r/é\udcff/" + "x" * 5000  # a lone surrogate and a long key survive
        sent = [
            (notices.TAG_SMALL, 7, b"slot-a", key),
            (notices.TAG_NORMAL, 2**64 - 1, b"slot-b", "K_1_0"),
            (notices.TAG_NORMAL, 0, b"", "by-name"),  # names no slot: look it up by name
        ]
        for tag, seq, name, k in sent:
            kb = k.encode("utf-8", "surrogatepass")
            assert notices.send(tx, addr, tag, seq, name, kb, use_extension=send_ext) == 0
        assert notices.send(tx, addr, 0, 0, b"", b"", use_extension=send_ext) == 0  # the marker
        tx.sendto(b"\x4e" + b"\0" * 8 + b"\x40\x00" + b"short", addr)  # name longer than the datagram
        tx.sendto(b"Z" * 20, addr)  # unknown tag
        tx.sendto(b"\x4e" + b"\0" * 10 + b"k" * (notices.BUFSIZE + 10), addr)  # too long to be ours
        assert notices.drain(rx, poller, 1, use_extension=drain_ext) == [sent[0]]  # just the first
        assert notices.drain(rx, poller, use_extension=drain_ext) == [*sent[1:], None, None, None, None]
        assert notices.drain(rx, poller, use_extension=drain_ext) == []  # empty: no error
        missing = notices.address(namespace, 10)  # nobody listens there
        assert notices.send(tx, missing, notices.TAG_NORMAL, 1, b"s", b"k", use_extension=send_ext) != 0
    finally:
        tx.close()
        rx.close()
    assert notices.drain(rx, poller, use_extension=drain_ext) == []  # closed: nothing, no raise
    assert notices.send(tx, addr, notices.TAG_NORMAL, 1, b"s", b"k", use_extension=send_ext) != 0


@pytest.mark.parametrize("backend_index", [0, 1], ids=["c-claim", "python-claim-on-libatomic"])
def test_a_claim_takes_only_its_publish_of_its_key_and_records_the_claimer(backend_index: int) -> None:
    """The C extension's one-call claim and slot.claim's Python steps (what a connector on
    libatomic runs) behave alike."""
    import mmap

    from omnirelay.connectors.shm.atomics import Word

    backend = _backends()[backend_index]
    assert backend is not None, "the C extension is not built (pip install -e . compiles it)"
    mm = mmap.mmap(-1, 1 << 16)
    key = b"R_1_0"
    slot.write_publish_header(
        mm, key=key, payload_len=1000, owner_pid=1, owner_start=2, created_ns=3, from_stage=1, to_stage=2
    )
    word = Word(mm, slot.STAMP_OFFSET, backend)
    claim_word = Word(mm, slot.CLAIM_SEQ_OFFSET, backend)

    def claim(seq: int, k: bytes, size: int = len(mm)) -> tuple[int, int] | None:
        if backend.claim is not None:
            return backend.claim(word.addr, size, seq, k, 4242, 99)
        return slot.claim(mm, size, word, claim_word, seq, k, 4242, 99)

    word.store(slot.stamp(slot.PUBLISHED, 7))
    assert claim(6, key) is None  # an older notice never takes the slot's next object
    assert claim(7, b"R_1_1") is None  # another key: put back untouched
    assert claim(7, key, size=slot.payload_offset(len(key)) + 999) is None  # would not fit
    assert word.load() == slot.stamp(slot.PUBLISHED, 7) and claim_word.load() == 0
    assert claim(7, key) == (slot.payload_offset(len(key)), 1000)
    assert claim(7, key) is None  # exactly once
    hdr = slot.read_header(mm, len(mm))
    assert not isinstance(hdr, str)
    assert (hdr.state, hdr.seq, hdr.claimer_pid, hdr.claimer_start, hdr.claim_seq) == (
        slot.CLAIMED,
        7,
        4242,
        99,
        7,
    )
    word.release()
    claim_word.release()
    mm.close()


def test_a_connector_on_libatomic_serves_hinted_and_by_name_gets(namespace: str) -> None:
    """Where the C extension is not built, the connector's atomic words go through
    libatomic; both kinds act on one slot stamp."""
    from omnirelay.connectors.shm import atomics

    assert atomics.LIBATOMIC is not None
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = ShmConnector(namespace, 2, atomic_ops=atomics.LIBATOMIC)
    assert prod.put(1, 2, "H_1_0", {"v": torch.arange(4)}).ok
    assert list(cons.wait_arrivals(2, timeout=30)) == ["H_1_0"]  # a hint: the notice's slot
    assert torch.equal(cons.get(1, 2, "H_1_0").obj["v"], torch.arange(4))
    assert prod.put(1, 2, "H_1_1", {"v": 5}).ok  # its notice is never read: by name
    assert cons.get(1, 2, "H_1_1").obj == {"v": 5}
    assert cons.get(1, 2, "H_1_1").status is GetStatus.NOT_YET  # consumed once
    cons.wait_arrivals(2, timeout=0)
    prod.reap_consumed()
    assert prod.pending_keys() == []
    prod.close()
    cons.close()

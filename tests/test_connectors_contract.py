"""The connector contract (docs/protocol.md §3.1), run against every backend.

``nixl`` runs twice: on one host (abstract UNIX notice sockets, UCX's choice of transport)
and over TCP (``UCX_TLS=tcp``, notice and claim endpoints on the loopback). A key becomes
gettable when its arrival notice has come (at once on ``shm`` and ``inproc``, after the
notice's trip on ``nixl``): tests that get right after a put first wait for the
announcement, as every receiver does (:func:`announced`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from omnirelay.connectors import Connector, GetStatus, create_connector, reclaim_namespace
from tests.conftest import shm_entries

BACKENDS = ["shm", "inproc", "nixl", "nixl-tcp"]
#: Why the ``nixl`` runs skip where NIXL is absent (the README's first command installs it).
NIXL_MISSING = "NIXL is not installed: pip install --no-deps 'nixl-cu12>=1.5,<2'"


def make_pair(backend: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Connector, Connector]:
    """A producer connector of stage 1 and a consumer connector of stage 2."""
    if backend.startswith("nixl"):
        pytest.importorskip("nixl_cu12", reason=NIXL_MISSING)
    if backend != "nixl-tcp":
        return (
            create_connector(backend, namespace=namespace, stage_id=1),
            create_connector(backend, namespace=namespace, stage_id=2),
        )
    monkeypatch.setenv("UCX_TLS", "tcp")
    # The consumer binds a port the system picks; the producer is told where it is.
    cons = create_connector("nixl", namespace=namespace, stage_id=2, endpoints={2: "tcp://127.0.0.1:0"})
    at = cons.listening_at  # type: ignore[attr-defined]
    prod = create_connector(
        "nixl", namespace=namespace, stage_id=1, endpoints={1: "tcp://127.0.0.1:0", 2: at}
    )
    return prod, cons


@pytest.fixture(params=BACKENDS)
def pair(
    request: pytest.FixtureRequest, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Connector, Connector]]:
    prod, cons = make_pair(request.param, namespace, monkeypatch)
    yield prod, cons
    prod.close()
    cons.close()
    assert prod.pending_keys() == []
    if prod.backend == "nixl":
        for c in (prod, cons):
            assert c.num_registered() == 0 and c.num_notices() == 0  # type: ignore[attr-defined]


def announced(cons: Connector, *keys: str, to_stage: int = 2) -> None:
    """Wait until every key in ``keys`` has been announced to ``to_stage`` (once each), or
    the backend says notices overflowed (a receiver then polls every key it waits for)."""
    if cons.backend in ("shm", "inproc"):
        return  # a put is gettable by name at once
    want = list(keys)
    deadline = time.monotonic() + 10
    while want and time.monotonic() < deadline:
        arrivals = cons.wait_arrivals(to_stage, timeout=1)
        if arrivals.overflowed:
            return
        for key in arrivals:
            if key in want:
                want.remove(key)
    assert not want, f"never announced: {want}"


def test_reclaim_leaves_a_live_owners_objects_alone(
    pair: tuple[Connector, Connector], namespace: str
) -> None:
    """The contract's one reclaim call: objects of live owners are listed, never removed."""
    prod, _ = pair
    assert prod.put(1, 2, "L_1_0", {"x": torch.arange(8)}).ok
    report = reclaim_namespace(namespace)
    assert report.reclaimed == []
    if prod.backend == "shm":  # the only backend whose objects outlive their process
        assert [o.key for o in report.transfer_objects] == ["L_1_0"]
        assert all(o.owner_alive for o in report.objects)
    else:
        assert report.objects == []
    assert prod.cleanup("L_1_0")


def test_put_get_round_trip_consumes(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    obj = {"codes": torch.arange(16 * 50).reshape(16, 50), "meta": {"finished": True}, "t": (1, "a")}
    res = prod.put(1, 2, "R_1_0", obj)
    assert res.ok and res.nbytes > 0 and res.error is None
    announced(cons, "R_1_0")
    got = cons.get(1, 2, "R_1_0")
    assert got.status is GetStatus.READY and got.nbytes == res.nbytes
    assert torch.equal(got.obj["codes"], obj["codes"]) and got.obj["t"] == (1, "a")
    assert got.obj["meta"] == {"finished": True}
    again = cons.get(1, 2, "R_1_0")
    assert again.status is GetStatus.NOT_YET and again.obj is None


def test_get_missing_is_not_yet(pair: tuple[Connector, Connector]) -> None:
    _, cons = pair
    assert cons.get(1, 2, "nothing_1_0").status is GetStatus.NOT_YET


def test_wait_arrivals_names_the_key(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    assert cons.wait_arrivals(2, timeout=0) == []
    assert prod.put(1, 2, "A_1_0", {"x": 1}).ok
    assert prod.put(1, 2, "B_1_0", {"x": 2}).ok
    seen: list[str] = []
    while len(seen) < 2:
        seen += cons.wait_arrivals(2, timeout=5)
    assert sorted(seen) == ["A_1_0", "B_1_0"]
    for k in seen:
        assert cons.get(1, 2, k).is_ready


def test_wait_arrivals_wakes_a_blocked_receiver(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    cons.wait_arrivals(2, timeout=0)  # make sure it listens
    got: list[str] = []
    started = threading.Event()

    def receiver() -> None:
        started.set()
        while not got:
            got.extend(cons.wait_arrivals(2, timeout=10))

    t = threading.Thread(target=receiver)
    t.start()
    started.wait()
    assert prod.put(1, 2, "W_1_0", b"hello").ok
    t.join(timeout=10)
    assert got == ["W_1_0"]
    assert cons.get(1, 2, "W_1_0").obj == b"hello"


def test_cleanup_exact_and_idempotent(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    assert prod.put(1, 2, "R_1_0", {"a": 1}).ok
    assert prod.put(1, 2, "R_1_1", {"a": 2}).ok
    assert prod.cleanup("R_1_0") is True
    assert prod.cleanup("R_1_0") is False
    assert prod.cleanup("R_1") is False  # never a prefix
    announced(cons, "R_1_1")
    assert cons.get(1, 2, "R_1_0").status is GetStatus.NOT_YET
    assert cons.get(1, 2, "R_1_1").obj == {"a": 2}
    assert prod.cleanup("R_1_1") is False  # consumed already
    prod.reap_consumed()
    assert prod.pending_keys() == []


def test_cleanup_prefix_never_touches_a_sibling(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    for k in ("task_1_0", "task_1_1", "task_1_1_0", "task_1_1_1", "task_10_0"):
        assert prod.put(1, 2, k, {"k": k}).ok
    assert prod.cleanup_prefix("task_1_") == 2  # task_1_0, task_1_1 (ids "task")
    announced(cons, "task_1_1_0", "task_10_0")
    assert cons.get(1, 2, "task_1_1_0").obj == {"k": "task_1_1_0"}  # sibling id "task_1" intact
    assert prod.cleanup_prefix("task_1_1_") == 1  # id "task_1": only its remaining key
    assert cons.get(1, 2, "task_10_0").obj == {"k": "task_10_0"}
    assert prod.cleanup_prefix("task_1_") == 0  # idempotent
    prod.reap_consumed()
    assert prod.pending_keys() == []


def test_reap_rotation_drops_consumed_behind_unread(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    unread = [f"U{i}_1_0" for i in range(200)]
    consumed = [f"C{i}_1_0" for i in range(50)]
    for k in unread + consumed:
        assert prod.put(1, 2, k, i := {"v": 1}).ok, i
    announced(cons, *consumed)
    for k in consumed:
        assert cons.get(1, 2, k).is_ready
    passes = 0
    while len(prod.pending_keys()) > len(unread):
        prod.reap_consumed()
        passes += 1
        assert passes <= 10, "consumed keys starve behind unread ones"
    assert sorted(prod.pending_keys()) == sorted(unread)
    assert prod.cleanup_prefix("U") == 0  # "U" + int only: no key matches without the separator
    for k in unread:
        assert prod.cleanup(k)


def test_close_is_idempotent_and_releases_everything(
    pair: tuple[Connector, Connector], namespace: str
) -> None:
    prod, cons = pair
    for i in range(5):
        assert prod.put(1, 2, f"R_1_{i}", torch.zeros(1000)).ok
    prod.close()
    prod.close()
    assert prod.pending_keys() == []
    assert cons.get(1, 2, "R_1_0").status is GetStatus.NOT_YET
    assert prod.put(1, 2, "R_1_9", 1).ok is False
    assert shm_entries(namespace) == [] or prod.backend == "inproc"


def test_health_counts(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    assert prod.put(1, 2, "H_1_0", torch.zeros(256, dtype=torch.float32)).ok
    assert prod.put(1, 2, "H_1_1", torch.zeros(256, dtype=torch.float32)).ok
    h = prod.health()
    assert h.num_puts == 2 and h.num_pending_keys == 2 and h.num_live_objects == 2
    assert h.live_bytes >= 2 * 1024 and h.bytes_put == h.live_bytes and h.status == "healthy"
    announced(cons, "H_1_0")
    assert cons.get(1, 2, "H_1_0").is_ready
    assert cons.health().num_gets == 1 and cons.health().bytes_got > 1024
    prod.reap_consumed()
    h = prod.health()
    assert h.num_pending_keys == 1 and h.num_reaped == 1
    assert prod.cleanup("H_1_1")
    assert prod.health().live_bytes == 0
    assert prod.health().to_dict()["num_cleaned"] == 1


def test_same_key_is_not_clobbered_while_unread(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    assert prod.put(1, 2, "D_1_0", {"gen": 1}).ok
    second = prod.put(1, 2, "D_1_0", {"gen": 2})
    assert not second.ok and "already published" in (second.error or "")
    announced(cons, "D_1_0")
    assert cons.get(1, 2, "D_1_0").obj == {"gen": 1}
    assert prod.put(1, 2, "D_1_0", {"gen": 3}).ok  # consumed: the key may be reused
    announced(cons, "D_1_0")
    assert cons.get(1, 2, "D_1_0").obj == {"gen": 3}


@pytest.mark.parametrize(
    "key",
    [
        "ünïcødé-请求-🎵_1_0",
        "a/b/../../etc/passwd_1_0",
        "..",
        "nul\x00byte_1_0",
        "x" * 1000,
        "語" * 1000,
        " spaces and\nnewlines ",
    ],
)
def test_untrusted_keys_are_safe(pair: tuple[Connector, Connector], namespace: str, key: str) -> None:
    prod, cons = pair
    res = prod.put(1, 2, key, {"k": key})
    assert res.ok, res.error
    for name in shm_entries(namespace):
        assert name.startswith(f"omnirelay-{namespace}-") and "/" not in name and len(name) < 255
    announced(cons, key)
    got = cons.get(1, 2, key)
    assert got.is_ready and got.obj == {"k": key}


def test_bad_input_is_refused_with_a_reason(pair: tuple[Connector, Connector], namespace: str) -> None:
    prod, cons = pair
    before = shm_entries(namespace)
    for key, obj, words in [
        ("", {"a": 1}, "empty"),
        ("x" * 100_000, {"a": 1}, "limit"),
        ("S_1_0", {1, 2, 3}, "set"),
        ("S_1_1", {"nested": [object()]}, "object"),
        ("S_1_2", np.array([object()], dtype=object), "object"),
        (123, {"a": 1}, "str"),
    ]:
        res = prod.put(1, 2, key, obj)  # type: ignore[arg-type]
        assert not res.ok and res.error and words in res.error, (key, res.error)
    assert shm_entries(namespace) == before  # nothing half-written
    assert prod.pending_keys() == []
    assert prod.health().num_put_failures == 6
    got = cons.get(1, 2, "")
    assert got.status is GetStatus.FAILED and "empty" in (got.error or "")


def test_concurrent_readers_exactly_one_wins(pair: tuple[Connector, Connector]) -> None:
    prod, cons = pair
    n_keys, n_threads = 50, 4
    for i in range(n_keys):
        assert prod.put(1, 2, f"K{i}_1_0", i).ok
    announced(cons, *(f"K{i}_1_0" for i in range(n_keys)))
    barrier = threading.Barrier(n_threads)
    wins: list[list[int]] = [[] for _ in range(n_threads)]

    def reader(slot_: int) -> None:
        barrier.wait()
        for i in range(n_keys):
            got = cons.get(1, 2, f"K{i}_1_0")
            assert got.status in (GetStatus.READY, GetStatus.NOT_YET)
            if got.is_ready:
                wins[slot_].append(got.obj)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v for w in wins for v in w) == list(range(n_keys))
    prod.reap_consumed()
    assert prod.pending_keys() == []

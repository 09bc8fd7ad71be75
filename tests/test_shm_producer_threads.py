"""The shm producer used from several threads at once, as a stage's send lanes use it:
one lane reaps while another puts. Each interleaving is forced with gates."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import pytest

from omnirelay.connectors import PutResult, create_connector
from omnirelay.connectors.shm import producer as producer_module


class _WaitAwareLock:
    """The producer's lock, telling when ``thread`` has to wait for it (another holds it)."""

    def __init__(self, lock: Any, thread: threading.Thread, waits: threading.Event) -> None:
        self._lock, self._thread, self._waits = lock, thread, waits

    def __enter__(self) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if threading.current_thread() is self._thread:
            self._waits.set()
        return bool(self._lock.acquire())

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()


def test_a_put_of_a_key_whose_consumed_object_another_thread_reaps_succeeds(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reap takes the consumed object off the books and removes its name; a put of the
    same key (a reused request id) on another thread must never see the object gone from
    the books while its name is still linked: its link would fail as if another producer
    held the key. Here the reap is held inside that name's removal while the put runs."""
    prod = create_connector("shm", namespace=namespace, stage_id=1)
    cons = create_connector("shm", namespace=namespace, stage_id=2)
    try:
        assert prod.put(1, 2, "R_1_0", {"v": 0}).ok
        assert cons.get(1, 2, "R_1_0").obj == {"v": 0}  # consumed; its name stays until a reap
        in_unlink, go_on = threading.Event(), threading.Event()
        putter_waits_or_done = threading.Event()
        real_unlink = producer_module._unlink_quiet

        def held_unlink(path: str) -> None:
            if threading.current_thread() is reaper and not in_unlink.is_set():
                in_unlink.set()
                assert go_on.wait(30)
            real_unlink(path)

        results: list[PutResult] = []

        def put_again() -> None:
            try:
                results.append(prod.put(1, 2, "R_1_0", {"v": 1}))
            finally:
                putter_waits_or_done.set()

        reaper = threading.Thread(target=prod.reap_consumed)
        putter = threading.Thread(target=put_again)
        inner = prod._producer  # type: ignore[attr-defined]
        monkeypatch.setattr(producer_module, "_unlink_quiet", held_unlink)
        monkeypatch.setattr(inner, "_lock", _WaitAwareLock(inner._lock, putter, putter_waits_or_done))
        reaper.start()
        assert in_unlink.wait(30)  # the reap is removing the consumed object's name
        putter.start()
        assert putter_waits_or_done.wait(30)  # the put is held behind the reap, or it ended
        go_on.set()
        for t in (reaper, putter):
            t.join(30)
            assert not t.is_alive()
        monkeypatch.undo()
        assert len(results) == 1 and results[0].ok, results[0].error
        cons.wait_arrivals(2, timeout=0)
        assert cons.get(1, 2, "R_1_0").obj == {"v": 1}
        prod.reap_consumed()
        assert prod.pending_keys() == []
    finally:
        monkeypatch.undo()
        prod.close()
        cons.close()

"""Test doubles for the transfer adapter: a scriptable fake connector, gates, a fake clock.

* :class:`FakeStore` — one namespace shared by several :class:`FakeConnector` instances
  (one per stage, standing in for processes): published objects, per-stage arrival
  notices and an ordered event log for interleaving assertions.
* :class:`FakeConnector` — the connector contract, plus hooks: gates that block inside
  ``put`` / ``get`` / ``cleanup`` until released, puts that fail or raise *after* creating
  the object, chunks that read back as FAILED (corrupt), lost notices, and
  :meth:`FakeConnector.consume_external` (another process consumed the key).
* :class:`Gate` — ``started`` is set when a thread arrives; it blocks until ``release()``.
* :class:`FakeClock` — an injectable clock that moves only when told.
* :func:`collect` — drain ``poll_events`` until a predicate holds (condition waits).
* :func:`assert_only_retired` — the next ``poll_events`` reports these retired senders
  and nothing else.
* :func:`assert_no_leaks` — the leak audit every transfer test ends with.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from omnirelay.connectors.base import (
    REAP_BATCH,
    Arrivals,
    Connector,
    ConnectorHealth,
    GetResult,
    GetStatus,
    PutResult,
    is_prefix_match,
)
from omnirelay.transfer import (
    BuildRequest,
    ChunkInput,
    ChunkProcessor,
    ReleaseScope,
    StatelessProcessor,
    TransferAdapter,
    TransferConfig,
    TransferFailure,
)

GATE_TIMEOUT_S = 10.0


class Gate:
    """A point a fake blocks at until the test releases it."""

    def __init__(self, name: str = "gate") -> None:
        self.name = name
        self.started = threading.Event()
        self._released = threading.Event()
        self.num_entered = 0

    def enter(self) -> None:
        self.num_entered += 1
        self.started.set()
        if not self._released.wait(GATE_TIMEOUT_S):
            raise AssertionError(f"{self.name} was never released")

    def release(self) -> None:
        self._released.set()

    def wait_started(self, timeout: float = GATE_TIMEOUT_S) -> None:
        assert self.started.wait(timeout), f"{self.name} was never reached"

    @property
    def is_released(self) -> bool:
        return self._released.is_set()


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._now = start

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def payload_nbytes(obj: Any) -> int:
    """A stand-in for the encoded size."""
    if isinstance(obj, bytes | bytearray | str):
        return len(obj)
    if isinstance(obj, msgspec.Struct):  # the adapter's ChunkEnvelope, a typed payload
        return 8 + sum(payload_nbytes(getattr(obj, f)) for f in obj.__struct_fields__)
    if isinstance(obj, dict):
        return 8 + sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return 8 + sum(payload_nbytes(v) for v in obj)
    numel = getattr(obj, "numel", None)
    if callable(numel):
        return int(numel()) * int(obj.element_size())
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    return 8


class FakeStore:
    """One namespace: objects, arrival notices, and the event log."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.objects: dict[str, tuple[Any, int]] = {}
        self.arrivals: dict[int, deque[str]] = {}
        self.log: list[str] = []

    def note(self, event: str) -> None:
        with self.cond:
            self.log.append(event)

    def live_keys(self) -> list[str]:
        with self.cond:
            return sorted(self.objects)

    def index(self, event: str) -> int:
        with self.cond:
            return self.log.index(event)


class FakeConnector(Connector):
    backend = "fake"

    def __init__(self, store: FakeStore, stage_id: int) -> None:
        self.store = store
        self.stage_id = stage_id
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, int] = OrderedDict()
        self.closed = False
        self.put_gates: dict[str, Gate] = {}
        self.get_gates: dict[str, Gate] = {}
        self.cleanup_gates: dict[str, Gate] = {}
        self.fail_after_create: set[str] = set()  # put creates the object, then returns ok=False
        self.raise_after_create: set[str] = set()  # put creates the object, then raises
        self.corrupt: set[str] = set()  # get consumes it and returns FAILED
        self.lose_notices = False
        self.num_gets: dict[str, int] = {}
        #: Keys announced as small (Arrivals.small), and which thread took / consumed each.
        self.small_keys: set[str] = set()
        self.noticed_by: dict[str, int] = {}
        self.got_by: dict[str, int] = {}
        self.found_nothing: dict[str, threading.Event] = {}  # set when a get saw NOT_YET
        self.num_reap_passes = 0
        self.num_closes = 0
        self.reaped = threading.Condition(self._lock)  # notified after every reap pass

    # --- contract
    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        self.store.note(f"put_start:{key}")
        gate = self.put_gates.get(key)
        if gate is not None:
            gate.enter()
        if self.closed:
            return PutResult(ok=False, error="closed")
        nbytes = payload_nbytes(obj)
        with self.store.cond:
            if key in self.store.objects:
                return PutResult(ok=False, error=f"key {key!r} exists")
            self.store.objects[key] = (obj, nbytes)
            if not self.lose_notices:
                self.store.arrivals.setdefault(to_stage, deque()).append(key)
            self.store.cond.notify_all()
        with self._lock:
            self._pending[key] = nbytes
        if key in self.raise_after_create:
            self.store.note(f"put_raised:{key}")
            raise RuntimeError(f"backend exploded after creating {key!r}")
        if key in self.fail_after_create:
            self.store.note(f"put_failed:{key}")
            return PutResult(ok=False, error=f"backend lost {key!r} half-way")
        self.store.note(f"put_done:{key}")
        return PutResult(ok=True, nbytes=nbytes, handle=key)

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        with self._lock:
            self.num_gets[key] = self.num_gets.get(key, 0) + 1
        gate = self.get_gates.get(key)
        if gate is not None:
            gate.enter()
        with self.store.cond:
            item = self.store.objects.pop(key, None)
        if item is None:
            with self._lock:
                event = self.found_nothing.setdefault(key, threading.Event())
            event.set()
            return GetResult(GetStatus.NOT_YET)
        with self._lock:
            self.got_by[key] = threading.get_ident()
        with self._lock:
            self._pending.pop(key, None)
        self.store.note(f"get:{key}")
        if key in self.corrupt:
            return GetResult(GetStatus.FAILED, error=f"corrupt payload under {key!r}")
        return GetResult(GetStatus.READY, obj=item[0], nbytes=item[1])

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        with self.store.cond:
            q = self.store.arrivals.setdefault(to_stage, deque())
            if not q and timeout != 0:
                self.store.cond.wait_for(lambda: bool(q) or self.closed, timeout)
            keys = Arrivals(q)
            q.clear()
        keys.small = {k for k in keys if k in self.small_keys}
        with self._lock:
            for k in keys:
                self.noticed_by[k] = threading.get_ident()
        return keys

    def wait_found_nothing(self, key: str, timeout: float = GATE_TIMEOUT_S) -> None:
        """Until a get of ``key`` has come back NOT_YET."""
        with self._lock:
            event = self.found_nothing.setdefault(key, threading.Event())
        assert event.wait(timeout), f"no get of {key!r} came back NOT_YET"

    def cleanup(self, key: str) -> bool:
        gate = self.cleanup_gates.get(key)
        if gate is not None:
            gate.enter()
        with self._lock:
            self._pending.pop(key, None)
        with self.store.cond:
            removed = self.store.objects.pop(key, None) is not None
            self.store.log.append(f"cleanup:{key}")
        return removed

    def cleanup_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in self._pending if is_prefix_match(k, prefix)]
        return sum(1 for k in keys if self.cleanup(k))

    def reap_consumed(self) -> int:
        dropped = 0
        with self._lock, self.store.cond:
            self.num_reap_passes += 1
            for _ in range(min(REAP_BATCH, len(self._pending))):
                key, nbytes = self._pending.popitem(last=False)
                if key in self.store.objects:
                    self._pending[key] = nbytes
                else:
                    dropped += 1
            self.reaped.notify_all()
        return dropped

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def close(self) -> None:
        with self._lock:
            self.num_closes += 1
            if self.closed:
                return
            self.closed = True
            keys = list(self._pending)
            self._pending.clear()
        with self.store.cond:
            for k in keys:
                self.store.objects.pop(k, None)
            self.store.cond.notify_all()

    def health(self) -> ConnectorHealth:
        with self._lock:
            return ConnectorHealth(
                backend=self.backend,
                namespace="fake",
                stage_id=self.stage_id,
                num_pending_keys=len(self._pending),
                live_bytes=sum(self._pending.values()),
            )

    # --- test helpers
    def wait_pending(self, predicate: Callable[[list[str]], bool], timeout: float = GATE_TIMEOUT_S) -> None:
        """Wait (on the reap condition) until ``predicate(pending keys)`` holds."""
        with self.reaped:
            ok = self.reaped.wait_for(lambda: predicate(list(self._pending)), timeout)
        assert ok, f"pending keys never satisfied the predicate: {self.pending_keys()[:10]}"

    def consume_external(self, key: str) -> None:
        """Another process read ``key``: the object goes, this instance's bookkeeping stays."""
        with self.store.cond:
            del self.store.objects[key]
            self.store.log.append(f"external_get:{key}")


def make_config(stage_id: int, **kw: Any) -> TransferConfig:
    """Test defaults: short arrival waits, a fallback pass that never fires on a fake clock."""
    kw.setdefault("arrival_wait_s", 0.02)
    kw.setdefault("reap_interval_s", 0.02)
    kw.setdefault("shutdown_join_s", 5.0)
    return TransferConfig(stage_id=stage_id, **kw)


@dataclasses.dataclass
class Pipeline:
    """A sender stage 0 and a receiver stage 1 over one fake namespace."""

    store: FakeStore
    send_conn: FakeConnector
    recv_conn: FakeConnector
    sender: TransferAdapter
    receiver: TransferAdapter
    clock: FakeClock

    @property
    def adapters(self) -> list[TransferAdapter]:
        return [self.sender, self.receiver]

    @property
    def connectors(self) -> list[FakeConnector]:
        return [self.send_conn, self.recv_conn]

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def audit(self) -> None:
        assert_no_leaks(self.adapters, self.connectors, self.store.live_keys)

    def close(self) -> None:
        for a in self.adapters:
            a.shutdown()


class RecordingProcessor:
    """A :class:`ChunkProcessor` whose body is the step's output, recording each release
    as ``(external_id, scope)``."""

    def __init__(self) -> None:
        self.released: list[tuple[str, ReleaseScope]] = []

    def build(self, request: BuildRequest) -> Any:
        return request.output

    def release(self, external_id: str, scope: ReleaseScope) -> None:
        self.released.append((external_id, scope))


def make_pipeline(
    *,
    sender_kw: dict[str, Any] | None = None,
    receiver_kw: dict[str, Any] | None = None,
    processor: ChunkProcessor | Callable[..., Any] | None = None,
    clock: FakeClock | None = None,
    first_stage: int = 0,
) -> Pipeline:
    """A sender and a receiver adapter over one :class:`FakeStore`. ``processor``: a
    :class:`ChunkProcessor`, or a build function (a :class:`StatelessProcessor`)."""
    if processor is not None and not isinstance(processor, ChunkProcessor):
        processor = StatelessProcessor(processor)
    store = FakeStore()
    clock = clock or FakeClock()
    a, b = first_stage, first_stage + 1
    send_conn, recv_conn = FakeConnector(store, a), FakeConnector(store, b)
    sender = TransferAdapter(
        send_conn,
        make_config(a, send_to_stage=b, **(sender_kw or {})),
        processor=processor,
        clock=clock,
    )
    receiver = TransferAdapter(
        recv_conn, make_config(b, receive_from_stage=a, **(receiver_kw or {})), clock=clock
    )
    return Pipeline(store, send_conn, recv_conn, sender, receiver, clock)


@dataclasses.dataclass
class Collected:
    ready: list[ChunkInput] = dataclasses.field(default_factory=list)
    failed: list[TransferFailure] = dataclasses.field(default_factory=list)
    timed_out: list[TransferFailure] = dataclasses.field(default_factory=list)

    def ready_ids(self) -> list[str]:
        return [c.internal_id for c in self.ready]


def collect(
    adapter: TransferAdapter,
    until: Callable[[Collected], bool],
    *,
    into: Collected | None = None,
    timeout: float = GATE_TIMEOUT_S,
) -> Collected:
    """Drain ``poll_events`` until ``until(acc)`` holds; waits on the event condition."""
    acc = into if into is not None else Collected()
    deadline = time.monotonic() + timeout
    while True:
        ev = adapter.poll_events()
        acc.ready.extend(ev.ready)
        acc.failed.extend(ev.failed)
        acc.timed_out.extend(ev.timed_out)
        if until(acc):
            return acc
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"condition not reached in {timeout} s; collected {acc}")
        adapter.wait_events(min(left, 0.5))


def ready_for(*internal_ids: str) -> Callable[[Collected], bool]:
    want = set(internal_ids)
    return lambda acc: want <= set(acc.ready_ids())


def failed_for(*internal_ids: str) -> Callable[[Collected], bool]:
    want = set(internal_ids)
    return lambda acc: want <= {f.internal_id for f in acc.failed}


def assert_only_retired(adapter: TransferAdapter, *external_ids: str) -> None:
    """The next drain holds no chunk and no failure, and reports exactly these external
    ids (in any order) as retired senders whose keys are reclaimed."""
    ev = adapter.poll_events()
    assert not (ev.ready or ev.failed or ev.timed_out), ev
    assert sorted(ev.retired_senders) == sorted(external_ids), ev.retired_senders


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = GATE_TIMEOUT_S) -> None:
    """For state with no condition to wait on (a thread parked in a timed wait): re-check
    the predicate until it holds. Never used to wait for something to *not* happen."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, f"never reached: {what}"
        pause.wait(0.001)


def assert_no_leaks(
    adapters: Iterable[TransferAdapter], connectors: Iterable[Connector], live_keys: Callable[[], list[str]]
) -> None:
    """The leak audit: nothing queued, no objects, no pending keys, no per-request state."""
    adapters, connectors = list(adapters), list(connectors)
    for a in adapters:
        assert a.flush(GATE_TIMEOUT_S), "send/receive queues did not drain"
    for c in connectors:
        while c.reap_consumed():
            pass
    for a in adapters:
        assert a.flush(GATE_TIMEOUT_S)
    assert live_keys() == [], f"objects left in the namespace: {live_keys()[:10]}"
    for c in connectors:
        assert c.pending_keys() == [], f"pending keys left: {c.pending_keys()[:10]}"
    for a in adapters:
        # What a scheduler drains at its next tick: retirement reports may wait there (they
        # are data for the scheduler, not request state); a chunk or failure may not.
        ev = a.poll_events()
        assert not (ev.ready or ev.failed or ev.timed_out), f"undrained events left: {ev}"
        assert a.leak_state() == {}, f"adapter state left: {a.leak_state()}"

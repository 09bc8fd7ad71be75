"""``inproc``: the connector contract inside one process (single-process mode, tests).

Connectors of the same namespace in one process share an :class:`InprocHub` (pass one
explicitly with ``hub=``, or get the process-wide hub of the namespace). Objects are
stored encoded, exactly as the shm backend would carry them, so the receiver gets
independent tensors and the same typed values, and bad objects fail the same way.

``by_reference=True`` (the edges inside a device group, docs/protocol.md §3.10) stores
the object itself: the reader gets the very object the producer put — device tensors
stay where they are, with no copy and no host round trip. A put hands the object over:
the producer's processor builds each chunk's payload anew and never touches it again.
The books (pending keys, claim by ``get``, cleanup, reap) are the same in both modes.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from typing import Any

from omnirelay.connectors.base import (
    REAP_BATCH,
    Arrivals,
    Connector,
    ConnectorHealth,
    GetResult,
    GetStatus,
    PutResult,
    is_prefix_match,
    validate_key,
    validate_namespace,
)
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

__all__ = ["InprocConnector", "InprocHub", "hub_for"]


class _Held:
    """An object put by reference (``by_reference=True``): no bytes, the object itself."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __len__(self) -> int:
        return 0


class InprocHub:
    """Shared store of one namespace: published objects and per-stage arrival queues."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.objects: dict[str, tuple[Any, int]] = {}  # key -> (encoded or the object, owner id)
        self.arrivals: dict[tuple[int, int], deque[str]] = {}  # (stage, replica) -> announced keys

    def live_keys(self) -> list[str]:
        with self.lock:
            return list(self.objects)


_HUBS: weakref.WeakValueDictionary[str, InprocHub] = weakref.WeakValueDictionary()
_HUBS_LOCK = threading.Lock()


def hub_for(namespace: str) -> InprocHub:
    """The process-wide hub of ``namespace`` (created on first use, freed when unused)."""
    with _HUBS_LOCK:
        hub = _HUBS.get(namespace)
        if hub is None:
            hub = InprocHub(namespace)
            _HUBS[namespace] = hub
        return hub


class InprocConnector(Connector):
    backend = "inproc"

    def __init__(
        self,
        namespace: str,
        stage_id: int | None = None,
        *,
        replica: int = 0,
        hub: InprocHub | None = None,
        by_reference: bool = False,
    ) -> None:
        self.namespace = validate_namespace(namespace)
        self.by_reference = by_reference
        self.stage_id = stage_id
        self.replica = replica
        self.hub = hub if hub is not None else hub_for(namespace)
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, int] = OrderedDict()  # key -> nbytes
        self._closed = False
        self._counts: dict[str, int] = dict.fromkeys(
            ("num_puts", "num_put_failures", "num_gets", "num_get_failures", "bytes_put", "bytes_got",
             "num_reaped", "num_cleaned", "num_notices_sent"),
            0,
        )  # fmt: skip
        self._last_error: str | None = None

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _fail(self, kind: str, reason: str) -> None:
        with self._lock:
            self._counts[kind] += 1
            self._last_error = reason

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        try:
            validate_key(key)
            if self._closed:
                raise ConnectorError("connector is closed")
            self.reap_consumed()
            data = _Held(obj) if self.by_reference else codec.encode(obj)
        except OmniRelayError as exc:
            self._fail("num_put_failures", str(exc))
            return PutResult(ok=False, error=str(exc))
        hub = self.hub
        with hub.cond:
            if key in hub.objects:
                reason = f"key {key!r} is already published and not yet consumed"
                self._fail("num_put_failures", reason)
                return PutResult(ok=False, error=reason)
            hub.objects[key] = (data, id(self))
            hub.arrivals.setdefault((to_stage, to_replica), deque()).append(key)
            hub.cond.notify_all()
        with self._lock:
            self._pending[key] = len(data)
            self._counts["num_puts"] += 1
            self._counts["bytes_put"] += len(data)
            self._counts["num_notices_sent"] += 1
        return PutResult(ok=True, nbytes=len(data), handle=key)

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        try:
            validate_key(key)
        except OmniRelayError as exc:
            self._fail("num_get_failures", str(exc))
            return GetResult(GetStatus.FAILED, error=str(exc))
        with self.hub.lock:
            item = self.hub.objects.pop(key, None)  # Invariant: exactly one reader pops it.
        if item is None:
            return GetResult(GetStatus.NOT_YET)
        data = item[0]
        with self._lock:
            self._pending.pop(key, None)
        if isinstance(data, _Held):
            with self._lock:
                self._counts["num_gets"] += 1
            return GetResult(GetStatus.READY, obj=data.obj, nbytes=0)
        try:
            obj = codec.decode(data, copy=True)
        except OmniRelayError as exc:
            reason = f"corrupt payload for key {key!r}: {exc}"
            self._fail("num_get_failures", reason)
            return GetResult(GetStatus.FAILED, error=reason)
        with self._lock:
            self._counts["num_gets"] += 1
            self._counts["bytes_got"] += len(data)
        return GetResult(GetStatus.READY, obj=obj, nbytes=len(data))

    def inject_raw(self, to_stage: int, key: str, data: bytes) -> None:
        """Publish raw bytes under ``key`` (tests: corrupt objects)."""
        with self.hub.cond:
            self.hub.objects[key] = (data, id(self))
            self.hub.arrivals.setdefault((to_stage, 0), deque()).append(key)
            self.hub.cond.notify_all()

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        if self._closed:
            raise ConnectorError("connector is closed")
        hub = self.hub
        with hub.cond:
            q = hub.arrivals.setdefault((to_stage, self.replica), deque())
            if not q and timeout != 0:
                hub.cond.wait_for(lambda: bool(q) or self._closed, timeout)
            keys = Arrivals(q)
            q.clear()
            return keys

    def cleanup(self, key: str) -> bool:
        with self._lock:
            if key not in self._pending:
                return False
            del self._pending[key]
        with self.hub.lock:
            item = self.hub.objects.get(key)
            removed = item is not None and item[1] == id(self)
            if removed:
                del self.hub.objects[key]
        if removed:
            self._count("num_cleaned")
        return removed

    def cleanup_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in self._pending if is_prefix_match(k, prefix)]
        return sum(1 for k in keys if self.cleanup(k))

    def reap_consumed(self) -> int:
        dropped = 0
        with self._lock, self.hub.lock:
            for _ in range(min(REAP_BATCH, len(self._pending))):
                key, nbytes = self._pending.popitem(last=False)
                if key in self.hub.objects:
                    self._pending[key] = nbytes
                else:
                    dropped += 1
            self._counts["num_reaped"] += dropped
        return dropped

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keys = list(self._pending)
            self._pending.clear()
        with self.hub.cond:
            for key in keys:
                item = self.hub.objects.get(key)
                if item is not None and item[1] == id(self):
                    del self.hub.objects[key]
            self.hub.cond.notify_all()

    def health(self) -> ConnectorHealth:
        with self._lock:
            live = len(self._pending)
            return ConnectorHealth(
                backend=self.backend,
                namespace=self.namespace,
                stage_id=self.stage_id,
                status="closed" if self._closed else "healthy",
                num_pending_keys=live,
                num_live_objects=live,
                live_bytes=sum(self._pending.values()),
                last_error=self._last_error,
                last_device_fallback=None,
                **self._counts,
            )

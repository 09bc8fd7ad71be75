"""A connector wrapper for benchmarks: counts and timestamps what passes through it.

:class:`TracingConnector` implements the connector contract by delegating every call to
an inner connector (the real ``shm`` one) and, on the side:

* calls ``on_put_start(key)`` when a ``put`` begins, ``on_put(key, ok, t_start_ns,
  t_end_ns)`` after every ``put`` and
  ``on_get(key, status, t_start_ns, t_end_ns)`` after every ``get`` (on the calling
  thread: a send or receive worker of the adapter), so a benchmark learns when a chunk
  really left or arrived without polling;
* counts the objects removed by the adapter's exact-key ``cleanup`` separately from those
  removed by :meth:`TracingConnector.release_prefix`, the orchestrator's release by id
  (docs/protocol.md §2.8), so a report can say which path reclaimed what.

It is injected as the adapter's connector (docs/design.md §7); nothing is monkeypatched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from omnirelay.connectors.base import Arrivals, Connector, ConnectorHealth, GetResult, GetStatus, PutResult

__all__ = ["GetHook", "PutHook", "TracingConnector"]

#: ``(key, ok, t_start_ns, t_end_ns)``, called after each put.
PutHook = Callable[[str, bool, int, int], None]
#: ``(key, status, t_start_ns, t_end_ns)``, called after each get.
GetHook = Callable[[str, GetStatus, int, int], None]


class TracingConnector(Connector):
    """Delegates to ``inner``; reports puts and gets, counts removals by entry point."""

    def __init__(
        self,
        inner: Connector,
        *,
        on_put_start: Callable[[str], None] | None = None,
        on_put: PutHook | None = None,
        on_get: GetHook | None = None,
    ):
        self.inner = inner
        self._on_put_start = on_put_start
        self.backend = inner.backend
        self._on_put = on_put
        self._on_get = on_get
        self._lock = threading.Lock()
        self.num_puts_ok = 0
        self.num_put_failures = 0
        self.bytes_put = 0
        #: Objects removed by ``cleanup(key)`` (the adapter's exact-key cleanup).
        self.num_removed_exact = 0
        self.num_cleanup_calls = 0
        #: Objects removed by :meth:`release_prefix` (the orchestrator's release by id).
        self.num_removed_prefix = 0

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        if self._on_put_start is not None:
            self._on_put_start(key)
        t0 = time.perf_counter_ns()
        result = self.inner.put(from_stage, to_stage, key, obj, to_replica)
        t1 = time.perf_counter_ns()
        with self._lock:
            if result.ok:
                self.num_puts_ok += 1
                self.bytes_put += result.nbytes
            else:
                self.num_put_failures += 1
        if self._on_put is not None:
            self._on_put(key, result.ok, t0, t1)
        return result

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        t0 = time.perf_counter_ns()
        result = self.inner.get(from_stage, to_stage, key)
        if self._on_get is not None:
            self._on_get(key, result.status, t0, time.perf_counter_ns())
        return result

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        return self.inner.wait_arrivals(to_stage, timeout)

    def cleanup(self, key: str) -> bool:
        removed = self.inner.cleanup(key)
        with self._lock:
            self.num_cleanup_calls += 1
            self.num_removed_exact += int(removed)
        return removed

    def cleanup_prefix(self, prefix: str) -> int:
        return self.release_prefix(prefix)

    def release_prefix(self, prefix: str) -> int:
        """The orchestrator's release of one request's leftover chunks; returns how many went."""
        n = self.inner.cleanup_prefix(prefix)
        with self._lock:
            self.num_removed_prefix += n
        return n

    def reap_consumed(self) -> int:
        return self.inner.reap_consumed()

    def pending_keys(self) -> list[str]:
        return self.inner.pending_keys()

    def close(self) -> None:
        self.inner.close()

    def health(self) -> ConnectorHealth:
        return self.inner.health()

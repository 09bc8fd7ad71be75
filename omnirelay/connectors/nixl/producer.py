"""The writing side of the ``nixl`` connector: put, the claim server, leases, retracts.

A put encodes the object straight into a registered buffer (pooled, so a steady stream
registers nothing new), books it, and sends the reading stage a :class:`~.wire.Notice`. The
object then waits, registered, for one of:

* a :class:`~.wire.Claim` from a reader (answered by the claim server thread): the object
  becomes the reader's — :meth:`Producer.cleanup` no longer withdraws it — and the reply
  carries the buffer's registration metadata when that reader has not seen it;
* the reader's :class:`~.wire.Ack` after its READ: the buffer returns to the pool;
* a lease that runs out (``lease_s`` after the claim, no ack: the reader died or hung): the
  object is reclaimed. NIXL cannot cancel a READ, so the buffer is quarantined — kept,
  never reused — until the connector closes, and a READ that was still running reads the
  same bytes;
* :meth:`Producer.cleanup` / :meth:`Producer.cleanup_prefix` / :meth:`Producer.close` while
  unclaimed: withdrawn, the reader told with a :class:`~.wire.Retract`.

A claim is a round trip on purpose: it is what makes exactly-once delivery and "cleanup
withdraws what no reader has" hold across hosts without shared atomics.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from omnirelay.connectors.base import REAP_BATCH, PutResult, is_prefix_match, validate_key
from omnirelay.connectors.nixl import wire
from omnirelay.connectors.nixl.agent import Agent, Buffer, BufferPool
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

__all__ = ["Producer"]

_OBJ_IDS = itertools.count(1)
#: how long a notice may wait to be queued for a stage that is not reachable (ms)
_NOTICE_SEND_MS = 1000


@dataclass(eq=False)
class _Object:
    key: str
    obj_id: int
    buf: Buffer
    nbytes: int
    to_stage: int
    to_replica: int
    claimed_at: float | None = None  # monotonic; None while unclaimed
    claimer: str | None = None


class Producer:
    """Puts of one connector and the claim server that hands their objects to readers.

    ``notice_endpoint(to_stage, to_replica)`` names where a stage replica's notices go; ``claim_at`` is the
    endpoint the claim server binds (a ``tcp://host:0`` port is chosen by the system).
    """

    def __init__(
        self,
        *,
        agent: Agent,
        pool: BufferPool,
        ctx: zmq.Context[Any],
        notice_endpoint: Callable[[int, int], str],
        claim_at: str,
        lease_s: float,
        on_error: Callable[[str], None],
    ) -> None:
        self.agent = agent
        self.pool = pool
        self._ctx = ctx
        self._notice_endpoint = notice_endpoint
        self.lease_s = lease_s
        self._on_error = on_error
        self._lock = threading.Lock()
        self._objects: dict[int, _Object] = {}
        self._published: dict[str, int] = {}  # key -> obj_id while unclaimed
        self._pending: OrderedDict[int, _Object] = OrderedDict()  # published, not yet reaped
        self._claimed_unreaped: deque[int] = deque()
        self._quarantine: list[Buffer] = []
        self._pushes: dict[str, zmq.Socket[Any]] = {}
        self._push_lock = threading.Lock()
        self.closed = False
        self.counts = dict.fromkeys(
            ("num_puts", "num_put_failures", "bytes_put", "num_reaped", "num_cleaned", "num_notices_sent",
             "num_notices_lost", "num_leases_expired"),
            0,
        )  # fmt: skip
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(claim_at)
        self.claim_at = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_at = f"inproc://nixl-producer-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_at)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_at)
        self._thread = threading.Thread(target=self._serve, name="nixl-claims", daemon=True)
        self._thread.start()

    # -- put --------------------------------------------------------------------------------

    def _fail(self, reason: str) -> PutResult:
        with self._lock:
            self.counts["num_put_failures"] += 1
        self._on_error(reason)
        return PutResult(ok=False, error=reason)

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        try:
            validate_key(key)
            if self.closed:
                raise ConnectorError("connector is closed")
            plan = codec.plan_encode(obj)
        except OmniRelayError as exc:
            return self._fail(str(exc))
        with self._lock:
            if key in self._published:
                reason = f"key {key!r} is already published and not yet consumed"
                self.counts["num_put_failures"] += 1
                return PutResult(ok=False, error=reason)
        nbytes = plan.nbytes
        try:
            buf = self.pool.take(wire.frame_size(nbytes))
        except Exception as exc:
            return self._fail(f"cannot register {nbytes} bytes with NIXL: {exc!r}")
        item = _Object(key, next(_OBJ_IDS), buf, nbytes, to_stage, to_replica)
        try:
            view = buf.view()
            plan.write_into(view[wire.HEADER : wire.HEADER + nbytes])
            wire.write_frame(view, item.obj_id, nbytes)
        except OmniRelayError as exc:
            self.pool.give(buf)
            return self._fail(str(exc))
        with self._lock:
            if self.closed or key in self._published:
                self.pool.give(buf)
                reason = "connector is closed" if self.closed else f"key {key!r} is already published"
                self.counts["num_put_failures"] += 1
                return PutResult(ok=False, error=reason)
            self._objects[item.obj_id] = item
            self._published[key] = item.obj_id
            self._pending[item.obj_id] = item
        notice = wire.Notice(
            key.encode("utf-8", "surrogatepass"), item.obj_id, nbytes, buf.addr, self.agent.name,
            self.claim_at, from_stage, to_stage,
        )  # fmt: skip
        if not self._send_notice(to_stage, to_replica, wire.encode(notice)):
            self._withdraw(key, tell_reader=False)
            return self._fail(f"the arrival notice to stage {to_stage} could not be queued")
        with self._lock:
            self.counts["num_puts"] += 1
            self.counts["bytes_put"] += nbytes
        return PutResult(ok=True, nbytes=nbytes, handle=f"{self.agent.name}/{item.obj_id}")

    def _send_notice(self, to_stage: int, to_replica: int, data: bytes) -> bool:
        endpoint = self._notice_endpoint(to_stage, to_replica)
        with self._push_lock:
            sock = self._pushes.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.setsockopt(zmq.SNDTIMEO, _NOTICE_SEND_MS)
                sock.setsockopt(zmq.LINGER, 500)
                sock.connect(endpoint)
                self._pushes[endpoint] = sock
            try:
                sock.send(data)
            except zmq.ZMQError:
                with self._lock:
                    self.counts["num_notices_lost"] += 1
                return False
        with self._lock:
            self.counts["num_notices_sent"] += 1
        return True

    # -- withdraw ---------------------------------------------------------------------------

    def _withdraw(self, key: str, *, tell_reader: bool) -> bool:
        with self._lock:
            obj_id = self._published.pop(key, None)
            if obj_id is None:
                return False
            item = self._objects.pop(obj_id)
            self._pending.pop(obj_id, None)
        self.pool.give(item.buf)
        if tell_reader:
            retract = wire.Retract(key.encode("utf-8", "surrogatepass"), obj_id)
            self._send_notice(item.to_stage, item.to_replica, wire.encode(retract))
        return True

    def cleanup(self, key: str) -> bool:
        removed = self._withdraw(key, tell_reader=True)
        if removed:
            with self._lock:
                self.counts["num_cleaned"] += 1
        return removed

    def cleanup_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in self._published if is_prefix_match(k, prefix)]
        return sum(1 for k in keys if self.cleanup(k))

    def reap(self) -> int:
        """Drop the books of up to ``REAP_BATCH`` keys claimed since the last pass."""
        dropped = 0
        with self._lock:
            while self._claimed_unreaped and dropped < REAP_BATCH:
                obj_id = self._claimed_unreaped.popleft()
                if self._pending.pop(obj_id, None) is not None:
                    dropped += 1
            self.counts["num_reaped"] += dropped
        return dropped

    def pending_keys(self) -> list[str]:
        with self._lock:
            return [item.key for item in self._pending.values()]

    def books(self) -> dict[str, int]:
        with self._lock:
            unclaimed = [self._objects[i] for i in self._published.values()]
            books = dict(self.counts)
            books["num_pending_keys"] = len(self._pending)
        free_slots, free_bytes = self.pool.free_stats()
        books.update(
            num_live_objects=len(unclaimed),
            live_bytes=sum(item.nbytes for item in unclaimed),
            pool_slots=free_slots,
            pool_bytes=free_bytes,
        )
        return books

    def num_objects(self) -> int:
        """Objects still holding a buffer (unclaimed, or claimed and not yet acknowledged)."""
        with self._lock:
            return len(self._objects)

    # -- the claim server -------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_lease_check = time.monotonic() + min(1.0, self.lease_s)
        while True:
            ready = dict(poller.poll(timeout=max(10, int(min(1.0, self.lease_s) * 1000))))
            if self._wake_rx in ready:
                return
            if self._router in ready:
                while True:
                    try:
                        peer, data = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:
                        continue  # not [identity, body]: not ours
                    reply = self._handle(data)
                    if reply is not None:
                        self._router.send_multipart([peer, wire.encode(reply)])
            now = time.monotonic()
            if now >= next_lease_check:
                next_lease_check = now + min(1.0, self.lease_s)
                self.expire_leases(now)

    def _handle(self, data: bytes) -> wire.Grant | wire.Gone | None:
        msg = wire.decode_to_producer(data)
        if isinstance(msg, wire.Ack):
            with self._lock:
                item = self._objects.get(msg.obj_id)
                if item is None or item.claimed_at is None:
                    return None
                del self._objects[msg.obj_id]
            self.pool.give(item.buf)
            return None
        if not isinstance(msg, wire.Claim):
            return None
        if msg.producer != self.agent.name:
            # A notice of another incarnation: a producer that died while this process
            # took its claim port. Its object is gone with it; one of ours of the same
            # key and id (a reused request id) is not the one the notice announced.
            return wire.Gone(msg.req, msg.obj_id, f"announced by {msg.producer}, not by this process")
        with self._lock:
            item = self._objects.get(msg.obj_id)
            key = msg.key.decode("utf-8", "surrogatepass")
            if item is None or item.key != key or item.claimed_at is not None:
                return wire.Gone(msg.req, msg.obj_id, "withdrawn or already taken")
            item.claimed_at, item.claimer = time.monotonic(), msg.reader
            del self._published[key]
            self._claimed_unreaped.append(msg.obj_id)
        try:
            metadata = self.agent.metadata_for(item.buf, msg.reader)
        except Exception as exc:  # the object stays the reader's; its lease reclaims it
            self._on_error(f"NIXL metadata for {msg.reader}: {exc!r}")
            return wire.Gone(msg.req, msg.obj_id, f"producer cannot describe its memory: {exc!r}")
        return wire.Grant(msg.req, msg.obj_id, metadata)

    def expire_leases(self, now: float) -> int:
        """Reclaim objects claimed more than ``lease_s`` ago and never acknowledged."""
        with self._lock:
            late = [
                item for item in self._objects.values()
                if item.claimed_at is not None and now - item.claimed_at > self.lease_s
            ]  # fmt: skip
            for item in late:
                del self._objects[item.obj_id]
                self._quarantine.append(item.buf)
            self.counts["num_leases_expired"] += len(late)
        for item in late:
            self._on_error(
                f"reader {item.claimer} never acknowledged {item.key!r}: reclaimed after its lease"
            )
        return len(late)

    # -- close ------------------------------------------------------------------------------

    def close(self) -> list[Buffer]:
        """Withdraw what is unclaimed (readers told), stop the claim server, close sockets.

        Returns the buffers still held (claimed, unacknowledged, quarantined): the caller
        deregisters them and keeps them alive until the agent stops, since a reader's READ
        may still be served from them until then."""
        with self._lock:
            if self.closed:
                return []
            self.closed = True
            keys = list(self._published)
        for key in keys:
            self._withdraw(key, tell_reader=True)
        self._wake_tx.send(b"")
        self._thread.join()
        with self._lock:
            held = [item.buf for item in self._objects.values()] + self._quarantine
            self._objects.clear()
            self._pending.clear()
            self._claimed_unreaped.clear()
            self._quarantine = []
        for sock in (self._router, self._wake_rx, self._wake_tx):
            sock.close(0)
        with self._push_lock:
            for sock in self._pushes.values():
                sock.close()  # LINGER: retracts still go out
            self._pushes.clear()
        return held

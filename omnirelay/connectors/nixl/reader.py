"""The reading side of the ``nixl`` connector: notices, claims, the READ, the ack.

A stage's connector binds the stage's notice endpoint (a PULL socket) and keeps the
notices it drained in a table by key. ``get(key)`` takes the key's notice out of the table
(so one reader of this connector wins it), claims the object from its producer (a round
trip: the producer answers :class:`~.wire.Grant` at most once per object), READs it with
NIXL into a registered landing buffer, checks the frame, decodes a copy, and acknowledges.

A claim names the producer's incarnation (its NIXL agent, as the notice did), and only
that process grants it: a notice of a producer that died never takes the object of a
process that got the same claim port afterwards, whatever key and id they share.

Outcomes: no notice, or the producer says it was withdrawn (or is not the notice's
incarnation) → ``NOT_YET``; the producer does
not answer within ``claim_timeout_s`` (dead), the READ fails or times out, or the bytes do
not decode → ``FAILED`` (the object is the reader's by then, or gone with its producer:
retrying cannot help).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from omnirelay.connectors.base import Arrivals, GetResult, GetStatus, validate_key
from omnirelay.connectors.nixl import wire
from omnirelay.connectors.nixl.agent import Agent, Buffer, BufferPool
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

__all__ = ["Reader"]

_REQ_IDS = itertools.count(1)


class _Peer:
    """The claim channel to one producer (a DEALER, one claim at a time)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.lock = threading.Lock()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 200)
        self.sock.connect(endpoint)


class Reader:
    def __init__(
        self,
        *,
        agent: Agent,
        pool: BufferPool,
        ctx: zmq.Context[Any],
        claim_timeout_s: float,
        read_timeout_s: float,
        on_error: Callable[[str], None],
    ) -> None:
        self.agent = agent
        self.pool = pool
        self._ctx = ctx
        self.claim_timeout_s = claim_timeout_s
        self.read_timeout_s = read_timeout_s
        self._on_error = on_error
        self._pull: zmq.Socket[Any] | None = None
        self._inbox_lock = threading.Lock()
        self._lock = threading.Lock()
        self._table: dict[str, wire.Notice] = {}
        self._unannounced: deque[str] = deque()
        #: objects withdrawn after their notice was taken (a claim in flight checks it)
        self._retracted: deque[int] = deque(maxlen=4096)
        #: claim endpoint -> when a claim to it went unanswered / when a notice last came
        #: from it: a producer silent since gets no second wait (its other objects fail at once)
        self._silent: dict[str, float] = {}
        self._heard: dict[str, float] = {}
        self._peers: dict[str, _Peer] = {}
        self._quarantine: list[Buffer] = []
        self.closed = False
        self.num_gets = self.num_get_failures = self.bytes_got = 0

    def listen(self, endpoint: str) -> str:
        """Bind the notice socket; returns the endpoint bound (a ``:0`` port resolved)."""
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, 100_000)
        try:
            pull.bind(endpoint)
        except zmq.ZMQError as exc:
            pull.close(0)
            raise ConnectorError(f"cannot listen for arrival notices at {endpoint}: {exc}") from exc
        self._pull = pull
        return pull.getsockopt_string(zmq.LAST_ENDPOINT)

    # -- notices ----------------------------------------------------------------------------

    def _drain(self) -> list[str]:
        """Move every queued notice into the table (the inbox lock held); the keys announced."""
        keys: list[str] = []
        pull = self._pull
        if pull is None:
            return keys
        while True:
            try:
                data = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return keys
            msg = wire.decode_notice(data)
            if msg is None:
                continue
            key = msg.key.decode("utf-8", "surrogatepass")
            with self._lock:
                if isinstance(msg, wire.Notice):
                    self._table[key] = msg
                    self._heard[msg.claim_at] = time.monotonic()
                    keys.append(key)
                elif (held := self._table.get(key)) is not None and held.obj_id == msg.obj_id:
                    del self._table[key]
                else:
                    self._retracted.append(msg.obj_id)

    def _drain_if_free(self) -> None:
        if self._inbox_lock.acquire(blocking=False):
            try:
                keys = self._drain()
                with self._lock:
                    self._unannounced.extend(keys)
            finally:
                self._inbox_lock.release()

    def wait(self, timeout: float | None) -> Arrivals:
        with self._inbox_lock:
            with self._lock:
                keys = list(self._unannounced)
                self._unannounced.clear()
            keys += self._drain()
            pull = self._pull
            if not keys and pull is not None and timeout != 0:
                ms = None if timeout is None else max(0, int(timeout * 1000))
                if pull.poll(ms):
                    keys = self._drain()
            return Arrivals(keys)

    # -- get --------------------------------------------------------------------------------

    def _failed(self, reason: str) -> GetResult:
        with self._lock:
            self.num_get_failures += 1
        self._on_error(reason)
        return GetResult(GetStatus.FAILED, error=reason)

    def get(self, key: str) -> GetResult:
        try:
            validate_key(key)
            if self.closed:
                raise ConnectorError("connector is closed")
        except OmniRelayError as exc:
            return self._failed(str(exc))
        self._drain_if_free()
        with self._lock:
            notice = self._table.pop(key, None)
        if notice is None:
            return GetResult(GetStatus.NOT_YET)
        reply = self._claim(notice)
        if isinstance(reply, str):
            return self._failed(f"{key!r}: {reply}")
        if isinstance(reply, wire.Gone):
            return GetResult(GetStatus.NOT_YET)
        return self._read(key, notice, reply)

    def _peer(self, endpoint: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = _Peer(self._ctx, endpoint)
            return peer

    def _claim(self, notice: wire.Notice) -> wire.Grant | wire.Gone | str:
        """The producer's answer, or why there is none."""
        at = notice.claim_at
        with self._lock:
            silent_since = self._silent.get(at)
            if silent_since is not None and self._heard.get(at, 0.0) < silent_since:
                return f"producer {notice.agent} at {at} stopped answering claims (it died, or its host is unreachable)"
        peer = self._peer(at)
        req = next(_REQ_IDS)
        claim = wire.Claim(req, notice.obj_id, notice.key, self.agent.name, notice.agent)
        deadline = time.monotonic() + self.claim_timeout_s
        with peer.lock:
            peer.sock.send(wire.encode(claim))
            while (left := deadline - time.monotonic()) > 0:
                if not peer.sock.poll(min(50, int(left * 1000) + 1)):
                    # A producer that closed answers no more claims; it retracted first.
                    self._drain_if_free()
                    with self._lock:
                        if notice.obj_id in self._retracted:
                            return wire.Gone(req, notice.obj_id, "withdrawn")
                    continue
                reply = wire.decode_claim_reply(peer.sock.recv())
                if reply is not None and reply.req == req:
                    with self._lock:
                        self._silent.pop(at, None)
                    return reply  # replies to claims that timed out before are skipped
        with self._lock:
            self._silent[at] = time.monotonic()
        self.agent.forget(notice.agent)
        return (
            f"producer {notice.agent} at {notice.claim_at} did not answer a claim within "
            f"{self.claim_timeout_s:g} s (it died, or its host is unreachable)"
        )

    def _read(self, key: str, notice: wire.Notice, grant: wire.Grant) -> GetResult:
        size = wire.frame_size(notice.nbytes)
        try:
            if grant.metadata is not None:
                self.agent.learn(grant.metadata)
            dst = self.pool.take(size)
        except Exception as exc:
            self._ack(notice, ok=False)
            return self._failed(f"{key!r}: cannot prepare the READ: {exc!r}")
        error = self.agent.read(notice.agent, notice.addr, dst, size, self.read_timeout_s)
        if error is not None:
            if "did not finish" in error:
                with self._lock:
                    self._quarantine.append(dst)  # the READ may still land in it
            else:
                self.pool.give(dst)
            self._ack(notice, ok=False)
            return self._failed(f"{key!r}: {error}")
        view = dst.view()[:size]
        try:
            problem = wire.check_frame(view, notice.obj_id, notice.nbytes)
            if problem is not None:
                return self._failed(f"corrupt payload for key {key!r}: {problem}")
            obj = codec.decode(view[wire.HEADER : wire.HEADER + notice.nbytes], copy=True)
        except OmniRelayError as exc:
            return self._failed(f"corrupt payload for key {key!r}: {exc}")
        finally:
            view.release()
            self.pool.give(dst)
            self._ack(notice, ok=True)
        with self._lock:
            self.num_gets += 1
            self.bytes_got += notice.nbytes
        return GetResult(GetStatus.READY, obj=obj, nbytes=notice.nbytes)

    def _ack(self, notice: wire.Notice, *, ok: bool) -> None:
        peer = self._peer(notice.claim_at)
        with peer.lock:
            try:
                peer.sock.send(wire.encode(wire.Ack(notice.obj_id, ok)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the producer's lease reclaims it

    # -- books ------------------------------------------------------------------------------

    def forget(self, key: str | None = None, prefix_match: Callable[[str], bool] | None = None) -> int:
        """Drop notices (of ``key``, or whose key ``prefix_match`` accepts) never got,
        those still queued on the socket too (a release forgets what arrived before it)."""
        if not self.closed:
            self._drain_if_free()
        with self._lock:
            keys = [k for k in self._table if k == key or (prefix_match is not None and prefix_match(k))]
            for k in keys:
                del self._table[k]
            return len(keys)

    def num_notices(self) -> int:
        with self._lock:
            return len(self._table)

    def close(self) -> list[Buffer]:
        """Close the sockets; returns landing buffers a timed-out READ may still write."""
        self.closed = True
        # A waiter holds the inbox lock at most its timeout; never hang a close on it.
        has_inbox = self._inbox_lock.acquire(timeout=5.0)
        try:
            return self._close_sockets()
        finally:
            if has_inbox:
                self._inbox_lock.release()

    def _close_sockets(self) -> list[Buffer]:
        with self._lock:
            if self._pull is not None:
                self._pull.close(0)
                self._pull = None
            for peer in self._peers.values():
                with peer.lock:
                    peer.sock.close()
            self._peers.clear()
            self._table.clear()
            self._unannounced.clear()
            held, self._quarantine = self._quarantine, []
        return held

"""``NixlConnector``: the connector contract between hosts, data moved by NIXL's one-sided READ.

The producer keeps each object in a registered buffer and sends the reading stage a small
notice over ZeroMQ; the reader claims it (a round trip), READs it with NIXL, and
acknowledges (``producer.py``, ``reader.py``, ``wire.py`` say how). ZeroMQ rather than
NIXL's own notifications carries the control messages because a stage must *block* on
arrivals at no cost (NIXL notifications can only be polled, and polling them is a busy loop
or a latency floor), because a claim needs a reply with a timeout (a dead producer must
turn into ``FAILED`` in bounded time), and because notices must reach a reader that has
never exchanged NIXL metadata with the producer; NIXL carries only the bytes.

Addressing: every stage worker that reads has a **notice endpoint**, a ZeroMQ address. By
default ``ipc://@omnirelay-<namespace>-nixl-<inbox>`` (abstract UNIX socket: one host; the
inbox is the stage id, or ``<stage>.<replica>`` for a stage's replica other than 0); across
hosts pass ``endpoints={"<inbox>": "tcp://<host>:<port>", ...}`` to every connector of the
pipeline (placement does). A connector's claim endpoint is bound on ``claim_host`` (default:
the host of its own stage's endpoint when that is TCP, else an abstract socket) and travels
in each notice, so nothing else needs configuring.

Guarantees, as for ``shm``: a put is whole or absent; exactly one ``get`` gets an object
(the producer grants it once); ``cleanup`` withdraws only what nobody claimed; a claimed
object stays registered until acknowledged or its lease (``lease_s``) runs out; a dead
producer turns a get into ``FAILED`` after ``claim_timeout_s``; a dead reader's objects are
reclaimed by lease (claimed) or by the orchestrator's cleanup (unclaimed).
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from omnirelay.connectors.base import (
    Arrivals,
    Connector,
    ConnectorHealth,
    GetResult,
    PutResult,
    inbox_name,
    is_prefix_match,
    validate_namespace,
)
from omnirelay.connectors.nixl.agent import Agent, BufferPool
from omnirelay.connectors.nixl.producer import Producer
from omnirelay.connectors.nixl.reader import Reader
from omnirelay.errors import ConnectorError

__all__ = ["NixlConnector", "NixlOptions", "default_endpoint"]


def default_endpoint(namespace: str, stage_id: int, replica: int = 0) -> str:
    """A stage replica's notice endpoint on one host: an abstract UNIX socket (nothing on disk)."""
    return f"ipc://@omnirelay-{namespace}-nixl-{inbox_name(stage_id, replica)}"


def _tcp_host(endpoint: str) -> str | None:
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rsplit(":", 1)[0]


@dataclass
class NixlOptions:
    """Options of the nixl connector (validated at construction)."""

    #: inbox (:func:`~omnirelay.connectors.base.inbox_name`: ``"2"``, ``"2.1"``; an int
    #: stage id names replica 0) -> notice endpoint (``tcp://host:port``); those not named
    #: use the default
    endpoints: dict[str, str] = field(default_factory=dict)
    #: where the claim server binds (a host/IP; empty: see the module docstring)
    claim_host: str = ""
    #: a claimed object never acknowledged is reclaimed after this long (seconds)
    lease_s: float = 30.0
    #: a producer that does not answer a claim this long is taken for dead (seconds)
    claim_timeout_s: float = 2.0
    #: a READ that has not finished by then fails (seconds)
    read_timeout_s: float = 10.0
    #: pause of NIXL's progress thread between polls (µs; 0 spins a core)
    progress_delay_us: int = 100
    pool_max_bytes: int = 1 << 30
    pool_max_slots: int = 256
    listen: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, dict) or not all(
            isinstance(k, int | str) and not isinstance(k, bool) and isinstance(v, str) and "://" in v
            for k, v in self.endpoints.items()
        ):
            raise ConnectorError(
                f"nixl option endpoints must map stage inboxes to 'tcp://host:port', got {self.endpoints!r}"
            )
        self.endpoints = {str(k): v for k, v in self.endpoints.items()}
        for name in ("lease_s", "claim_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConnectorError(f"nixl option {name} must be seconds > 0, got {value!r}")
        for name in ("progress_delay_us", "pool_max_bytes", "pool_max_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConnectorError(f"nixl option {name} must be a non-negative int, got {value!r}")
        if not isinstance(self.claim_host, str) or not isinstance(self.listen, bool):
            raise ConnectorError("nixl options claim_host must be a string and listen true or false")


class NixlConnector(Connector):
    """See the module docstring; ``options`` are :class:`NixlOptions`' fields."""

    backend = "nixl"

    def __init__(
        self, namespace: str, stage_id: int | None = None, *, replica: int = 0, **options: Any
    ) -> None:
        self._closed = True  # until constructed
        self.namespace = validate_namespace(namespace)
        self.stage_id = stage_id
        self.replica = replica
        try:
            self.options = NixlOptions(**options)
        except TypeError as exc:
            raise ConnectorError(f"unknown nixl connector option: {exc}") from exc
        self._last_error: str | None = None
        #: this stage's notice endpoint as bound (None: not listening)
        self.listening_at: str | None = None
        opts = self.options
        opts.endpoints = dict(opts.endpoints)
        name = f"omnirelay-{namespace}-s{stage_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = Agent(name, opts.progress_delay_us)
        self.pool = BufferPool(self.agent, opts.pool_max_slots, opts.pool_max_bytes)
        self._ctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        own = self.endpoint(stage_id, replica) if stage_id is not None else ""
        host = opts.claim_host or _tcp_host(own)
        claim_at = f"tcp://{host}:0" if host else f"ipc://@{name}-claims"
        try:
            self._producer = Producer(
                agent=self.agent, pool=self.pool, ctx=self._ctx, notice_endpoint=self.endpoint,
                claim_at=claim_at, lease_s=opts.lease_s, on_error=self._note_error,
            )  # fmt: skip
            self._reader = Reader(
                agent=self.agent, pool=self.pool, ctx=self._ctx, claim_timeout_s=opts.claim_timeout_s,
                read_timeout_s=opts.read_timeout_s, on_error=self._note_error,
            )  # fmt: skip
            if opts.listen and stage_id is not None:
                # ``tcp://host:0``: the system picks the port; other connectors of the
                # pipeline are then given :attr:`listening_at`.
                self.listening_at = self._reader.listen(own)
                opts.endpoints[inbox_name(stage_id, replica)] = self.listening_at
        except BaseException:
            self._ctx.destroy(linger=0)
            self.agent.close()
            raise
        self._closed = False

    def endpoint(self, stage_id: int, replica: int = 0) -> str:
        """Where the notices of ``stage_id``'s replica ``replica`` go."""
        found = self.options.endpoints.get(inbox_name(stage_id, replica))
        return found or default_endpoint(self.namespace, stage_id, replica)

    def _note_error(self, reason: str) -> None:
        self._last_error = reason

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        return self._producer.put(from_stage, to_stage, key, obj, to_replica)

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        return self._reader.get(key)

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        if self._closed:
            raise ConnectorError("connector is closed")
        return self._reader.wait(timeout)

    def cleanup(self, key: str) -> bool:
        """Withdraw ``key`` if this connector published it and no reader claimed it; also
        forget a notice of it this connector received and never got."""
        self._reader.forget(key)
        return self._producer.cleanup(key)

    def cleanup_prefix(self, prefix: str) -> int:
        self._reader.forget(prefix_match=lambda k: is_prefix_match(k, prefix))
        return self._producer.cleanup_prefix(prefix)

    def reap_consumed(self) -> int:
        return self._producer.reap()

    def pending_keys(self) -> list[str]:
        return self._producer.pending_keys()

    def num_objects(self) -> int:
        """Objects this connector put that still hold a buffer (unclaimed, or claimed and
        not yet acknowledged)."""
        return self._producer.num_objects()

    def num_registered(self) -> int:
        """Buffers registered with NIXL right now (in use or pooled)."""
        return self.pool.num_registered

    def num_notices(self) -> int:
        """Notices received and not yet got (a reader's request state)."""
        return self._reader.num_notices()

    def leak_state(self) -> dict[str, int]:
        """Objects still holding a registered buffer and notices never got; ``{}`` when none."""
        out = {"nixl_objects": self.num_objects(), "nixl_notices": self.num_notices()}
        return {k: v for k, v in out.items() if v}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        held = self._producer.close() + self._reader.close()
        for buf in held:
            self.pool.drop(buf)
        self.pool.clear()
        self._ctx.term()  # after LINGER: the retracts reached the readers' hosts
        self.agent.close()  # no READ is served from here on: the held buffers may go
        held.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    def health(self) -> ConnectorHealth:
        books = self._producer.books()
        books.pop("num_leases_expired", None)
        return ConnectorHealth(
            backend=self.backend,
            namespace=self.namespace,
            stage_id=self.stage_id,
            status="closed" if self._closed else "healthy",
            num_gets=self._reader.num_gets,
            num_get_failures=self._reader.num_get_failures,
            bytes_got=self._reader.bytes_got,
            last_error=self._last_error,
            last_device_fallback=None,
            **books,
        )

"""``ShmConnector``: the default connector, across processes on one Linux host.

The facade over the two sides (docs/design.md §7):

* ``producer.py`` — put, publish, reap, retract: **atomic publish, exclusive consume, no
  lock files**. An object is written into a private pooled slot, published, announced,
  then made findable by key with one ``link()``: readers never see a partial object, and
  an unread object with the same key is never clobbered. A small object is announced
  before it is encoded, so the receiver's wake-up overlaps the encoding.
* ``reader.py`` — get: a reader claims an object with one compare-and-swap of the slot's
  stamp word, ``PUBLISHED(seq) -> CLAIMED(seq)`` (``slot.claim``): exactly one reader
  wins, with no filesystem operation; it copies the object out and marks the slot FREE.
  Only the producer removes a key's name, when it reaps the FREE slot (or retracts it).
* ``notices.py`` — **arrival notices that say where**: the datagram names the slot and
  the publish as well as the key, so a reader that mapped the slot before (``mappings``)
  consumes with no system call beyond the ``recv``. Notices are hints: a stale or forged
  one only fails a compare-and-swap, and the key's name finds an object without one.
  **Waiting costs nothing per request**: ``wait_arrivals`` blocks on the stage's
  abstract UNIX socket.
* ``names.py`` — **fixed-length names**: keys are hashed; the key itself lives in the slot
  header, so audits can recover it. Every name starts ``omnirelay-<namespace>``.
* ``reclaim.py`` — **crash safety**: names carry the owner's pid and start time; ``sweep``
  (at startup and by ``omnirelay doctor --reclaim``) removes objects of dead owners only.
  A slot left CLAIMED by a dead consumer returns to its producer's pool on the next reap.
* GPU-direct edges (``gpu_direct_to`` / ``gpu_direct_in``, set from the pipeline where
  both stages are on CUDA devices of the host; docs/protocol.md §3.9): device tensors of a
  put stay in this stage's device pool and the slot carries their references; a get
  copies them onto ``device`` inside its claim (``omnirelay.connectors.device.edge``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnirelay.connectors.base import (
    Arrivals,
    Connector,
    ConnectorHealth,
    GetResult,
    PutResult,
    validate_namespace,
)
from omnirelay.connectors.shm import atomics, names, notices
from omnirelay.connectors.shm.mappings import MappingCache
from omnirelay.connectors.shm.producer import Allocator, Producer, default_allocator
from omnirelay.connectors.shm.reader import Reader
from omnirelay.errors import ConnectorError

if TYPE_CHECKING:
    from omnirelay.connectors.device.edge import DeviceBackend, DeviceReceiver, DeviceSender

__all__ = ["ShmConnector", "ShmOptions", "default_allocator", "notice_address"]

#: Abstract-namespace socket address of a stage's arrival notices (nothing on disk).
notice_address = notices.address


@dataclass
class ShmOptions:
    """Options of the shm connector (validated at construction)."""

    pool_max_bytes: int = 1 << 30  # free slots kept for reuse, in bytes
    pool_max_slots: int = 256
    map_cache_bytes: int = 1 << 30  # consumer-side cache of slot mappings
    map_cache_entries: int = 128
    #: how often housekeeping forgets cached mappings of dead producers' slots (seconds)
    dead_owner_scan_s: float = 1.0
    listen: bool = True  # bind this stage's notice socket at construction
    sweep_on_start: bool = True
    shm_dir: str = names.SHM_DIR
    #: GPU-direct edges (docs/protocol.md §3.9): the stages this one sends device tensors
    #: to through its device pool, whether it receives them, its own torch device (where
    #: received tensors go, and the pool lives), the pool's size, and the smallest tensor
    #: placed (None: the measured default; smaller ones cross faster through the host).
    gpu_direct_to: tuple[int, ...] = ()
    gpu_direct_in: bool = False
    device: str | None = None
    device_pool_bytes: int = 256 << 20
    device_min_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("pool_max_bytes", "pool_max_slots", "map_cache_bytes", "map_cache_entries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConnectorError(f"shm option {name} must be a non-negative int, got {value!r}")
        scan = self.dead_owner_scan_s
        if isinstance(scan, bool) or not isinstance(scan, int | float) or not math.isfinite(scan) or scan < 0:
            raise ConnectorError(f"shm option dead_owner_scan_s must be seconds >= 0, got {scan!r}")
        for name in ("listen", "sweep_on_start", "gpu_direct_in"):
            if not isinstance(getattr(self, name), bool):
                raise ConnectorError(f"shm option {name} must be true or false, got {getattr(self, name)!r}")
        to = self.gpu_direct_to
        if not isinstance(to, tuple | list | frozenset | set) or not all(
            type(i) is int and i >= 0 for i in to
        ):
            raise ConnectorError(f"shm option gpu_direct_to must be stage ids, got {to!r}")
        self.gpu_direct_to = tuple(to)
        if self.device is not None and not isinstance(self.device, str):
            raise ConnectorError(
                f"shm option device must be a device name such as cuda:0, got {self.device!r}"
            )
        for name in ("device_pool_bytes", "device_min_bytes"):
            value = getattr(self, name)
            if value is None and name == "device_min_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConnectorError(f"shm option {name} must be a non-negative int, got {value!r}")


class ShmConnector(Connector):
    """See the module docstring. ``options`` are :class:`ShmOptions`' fields. Injected
    backends: ``allocator`` creates and maps slot files; ``atomic_ops`` is the
    implementation of the atomic word operations (default :data:`atomics.DEFAULT`: the C
    extension where it is built, else libatomic); ``device_backend`` is that of the GPU-direct
    edges (default CUDA; only made when the options name such an edge)."""

    backend = "shm"

    def __init__(
        self,
        namespace: str,
        stage_id: int | None = None,
        *,
        replica: int = 0,
        allocator: Allocator = default_allocator,
        atomic_ops: atomics.Backend | None = None,
        device_backend: DeviceBackend | None = None,
        **options: Any,
    ) -> None:
        self._closed = True  # until constructed: __del__ must not touch half-built state
        self.namespace = validate_namespace(namespace)
        self.stage_id = stage_id
        if type(replica) is not int or replica < 0:
            raise ConnectorError(f"shm connector replica must be an int >= 0, got {replica!r}")
        #: the replica of ``stage_id`` this connector listens for
        self.replica = replica
        try:
            self.options = ShmOptions(**options)
        except TypeError as exc:
            raise ConnectorError(f"unknown shm connector option: {exc}") from exc
        if atomic_ops is None:
            atomic_ops = atomics.DEFAULT
            if atomic_ops is None:
                raise ConnectorError(atomics.unavailable_reason() or "libatomic is not available")
        shm_dir = self.options.shm_dir
        self._last_error: str | None = None
        self._outbox = notices.Outbox(self.namespace)
        self._inbox = notices.Inbox(self.namespace)
        self._device_sender, self._device_receiver = self._device_ends(device_backend)
        self._producer = Producer(
            namespace=self.namespace,
            shm_dir=shm_dir,
            allocator=allocator,
            atomic_ops=atomic_ops,
            outbox=self._outbox,
            pool_max_slots=self.options.pool_max_slots,
            pool_max_bytes=self.options.pool_max_bytes,
            on_error=self._note_error,
            device=self._device_sender,
            device_to=frozenset(self.options.gpu_direct_to),
        )
        self._maps = MappingCache(
            shm_dir,
            f"{names.PREFIX}{self.namespace}-s-".encode(),
            self.options.map_cache_bytes,
            self.options.map_cache_entries,
            atomic_ops,
        )
        self._reader = Reader(
            namespace=self.namespace,
            shm_dir=shm_dir,
            maps=self._maps,
            inbox=self._inbox,
            outbox=self._outbox,
            on_consumed=self._producer.take_back,
            on_error=self._note_error,
            device=self._device_receiver.take if self._device_receiver is not None else None,
            replica=replica,
        )
        self._next_dead_scan = 0.0
        self.num_dead_mappings_dropped = 0
        self._closed = False
        if self.options.sweep_on_start:
            from omnirelay.connectors.shm.reclaim import sweep

            sweep(namespace=self.namespace, reclaim=True, shm_dir=shm_dir)
        if self.options.listen and stage_id is not None:
            try:
                self._inbox.listen(stage_id, replica)
            except ConnectorError:
                pass  # another connector of this namespace listens for the stage

    def _device_ends(
        self, backend: DeviceBackend | None
    ) -> tuple[DeviceSender | None, DeviceReceiver | None]:
        """The sender and receiver of the GPU-direct edges the options name (torch and the
        device modules are imported only then: a host-only connector never loads them)."""
        opts = self.options
        if not opts.gpu_direct_to and not opts.gpu_direct_in:
            return None, None
        from omnirelay.connectors.device.channel import MIN_BYTES
        from omnirelay.connectors.device.edge import CudaBackend, DeviceReceiver, DeviceSender

        backend = backend if backend is not None else CudaBackend()
        sender = receiver = None
        if opts.gpu_direct_to:
            min_bytes = opts.device_min_bytes if opts.device_min_bytes is not None else MIN_BYTES
            sender = DeviceSender(
                backend, device=opts.device, capacity=opts.device_pool_bytes, min_bytes=min_bytes
            )
        if opts.gpu_direct_in:
            receiver = DeviceReceiver(backend, device=opts.device)
        return sender, receiver

    def _note_error(self, reason: str) -> None:
        self._last_error = reason

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        return self._producer.put(from_stage, to_stage, key, obj, to_replica)

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        return self._reader.get(to_stage, key)

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        if self._closed:
            raise ConnectorError("connector is closed")
        return self._inbox.wait(to_stage, timeout, self._reader.restock, self.replica)

    def cleanup(self, key: str) -> bool:
        """Retract ``key`` if this connector published it and nobody claimed it yet (a reader
        that won keeps its object). Idempotent; True if an object was removed."""
        return self._producer.cleanup(key)

    def cleanup_prefix(self, prefix: str) -> int:
        return self._producer.cleanup_prefix(prefix)

    def reap_consumed(self) -> int:
        """One bounded rotating pass over pending keys (docs/protocol.md §3.5), syscall-free;
        now and then (``dead_owner_scan_s``) also forget cached mappings of dead producers'
        slots, whose memory lives on while mapped."""
        now = time.monotonic()
        if now >= self._next_dead_scan:
            self._next_dead_scan = now + self.options.dead_owner_scan_s
            self.num_dead_mappings_dropped += self._maps.drop_dead_owners(names.owner_alive)
            if self._device_receiver is not None:
                self._device_receiver.forget_dead()  # arenas of dead producers
        return self._producer.reap()

    def pending_keys(self) -> list[str]:
        return self._producer.pending_keys()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.is_closed = True
        self._producer.close()
        self._maps.clear()  # each mapping goes with its last reference
        if self._device_receiver is not None:
            self._device_receiver.close()
        self._inbox.close()
        self._outbox.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    def health(self) -> ConnectorHealth:
        books = self._producer.books()
        return ConnectorHealth(
            backend=self.backend,
            namespace=self.namespace,
            stage_id=self.stage_id,
            status="closed" if self._closed else "healthy",
            num_gets=self._reader.num_gets,
            num_get_failures=self._reader.num_get_failures,
            bytes_got=self._reader.bytes_got,
            num_notices_sent=self._outbox.num_sent,
            num_notices_lost=self._outbox.num_lost,
            last_error=self._last_error,
            num_device_gets=self._device_receiver.num_gets if self._device_receiver is not None else 0,
            last_device_fallback=self._device_sender.last_fallback
            if self._device_sender is not None
            else None,
            **books,
        )

"""The connector contract: move one keyed object between stage processes.

A connector knows keys and bytes, never requests, chunks or models. Every backend
implements :class:`Connector`:

* ``put(from_stage, to_stage, key, obj, to_replica=0) -> PutResult`` — encode ``obj`` and
  publish it under ``key``, announced to replica ``to_replica`` of ``to_stage``. Never
  raises for transport trouble: a failure is ``PutResult(ok=False, error=...)`` and
  nothing half-written stays behind. Called on the sender thread, once per chunk.
* ``get(from_stage, to_stage, key) -> GetResult`` — non-blocking and tri-state:
  ``READY`` (the object, now consumed: no other reader will get it), ``NOT_YET`` (nothing
  published under the key yet, try again on the next arrival), ``FAILED`` (the object
  existed but is unusable — corrupt, wrong schema — it has been consumed and its
  resources removed; retrying will not help).
* ``wait_arrivals(to_stage, timeout) -> Arrivals`` — block up to ``timeout`` seconds
  for arrival notices addressed to ``to_stage`` (the replica this connector was made for)
  and return the announced keys (may be empty) and what the backend knows about them
  (:class:`Arrivals`). A notice is a hint: the receiver still calls ``get``.

A stage may run several worker processes (replicas, docs/design.md §11). Keys stay the
stage's (any replica's reader may get any key); only notices are addressed to one replica:
each connector is made with the ``replica`` it listens for, and a producer names the
replica that reads a key (``to_replica``; :func:`inbox_name` names an inbox).
* ``cleanup(key)`` — remove the exact key if still published (idempotent).
* ``cleanup_prefix(prefix)`` — remove tracked keys ``prefix + <decimal int>`` (docs/protocol.md §2.8).
* ``reap_consumed() -> int`` — one bounded, rotating pass dropping bookkeeping of keys
  another process consumed (docs/protocol.md §3.5); returns how many were dropped.
* ``close()`` — release everything still owned; idempotent, synchronous.
* ``health() -> ConnectorHealth`` — real counters.

One more operation needs no connector, because the process that owned the objects may be
gone: each backend package's ``reclaim_namespace(namespace, *, reclaim) ->
ReclaimReport`` (a :class:`Reclaimer`) lists the objects of a namespace that outlive
their process (``None``: every namespace) and, with ``reclaim``, removes those whose
owner is dead. :func:`omnirelay.connectors.reclaim_namespace` asks every backend; it is
the only reclaim the orchestrator, the supervisor, the server's audit and ``omnirelay
doctor`` call.
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import msgspec

from omnirelay.errors import InvalidKeyError

__all__ = [
    "MAX_KEY_BYTES",
    "REAP_BATCH",
    "SMALL_OBJECT_BYTES",
    "Arrivals",
    "Connector",
    "ConnectorHealth",
    "GetResult",
    "GetStatus",
    "NamespaceObject",
    "PutResult",
    "ReclaimReport",
    "Reclaimer",
    "inbox_name",
    "is_prefix_match",
    "validate_key",
    "validate_namespace",
]

#: Keys longer than this (UTF-8 bytes) are refused with a reason. 1,000 characters of
#: any script (≤ 4,000 bytes) always fit.
MAX_KEY_BYTES = 8192

#: The most a ``get`` of a key in :attr:`Arrivals.small` copies and decodes.
SMALL_OBJECT_BYTES = 256 << 10

#: Keys looked at per ``reap_consumed`` pass (docs/protocol.md §3.5).
REAP_BATCH = 64

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,47}$")


class Arrivals(list[str]):
    """Keys announced to a stage: a list of keys (in arrival order, a key possibly more
    than once), with two declared facts about them:

    * ``overflowed``: True when some notices could not be delivered (the receiver's queue
      was full) — the receiver should then poll every key it waits for, not only the
      announced ones;
    * ``small``: announced keys whose ``get`` is bounded — it copies and decodes at most
      :data:`SMALL_OBJECT_BYTES` (the notice names a slot no larger; if the object does not
      fit it is announced again from its real place). A receiver may run such a get on
      the thread that took the notice without holding up other arrivals for long.
      Empty when the backend cannot tell.
    """

    __slots__ = ("overflowed", "small")

    def __init__(
        self,
        keys: Iterable[str] = (),
        *,
        overflowed: bool = False,
        small: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        super().__init__(keys)
        self.overflowed = overflowed
        self.small = small


class GetStatus(enum.Enum):
    READY = "ready"
    NOT_YET = "not_yet"
    FAILED = "failed"


class PutResult(msgspec.Struct, frozen=True):
    """Outcome of a put. ``handle`` names the transport resource (for audits)."""

    ok: bool
    nbytes: int = 0
    handle: str | None = None
    error: str | None = None


class GetResult(msgspec.Struct, frozen=True):
    """Outcome of a get. ``obj`` is set only when ``status`` is READY."""

    status: GetStatus
    obj: Any = None
    nbytes: int = 0
    error: str | None = None

    @property
    def is_ready(self) -> bool:
        return self.status is GetStatus.READY


class ConnectorHealth(msgspec.Struct):
    """Counters of one connector instance (this process)."""

    backend: str
    namespace: str
    stage_id: int | None
    status: str = "healthy"
    num_puts: int = 0
    num_put_failures: int = 0
    num_gets: int = 0
    num_get_failures: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    num_pending_keys: int = 0
    num_live_objects: int = 0
    live_bytes: int = 0
    num_reaped: int = 0
    num_cleaned: int = 0
    num_notices_sent: int = 0
    num_notices_lost: int = 0
    pool_slots: int = 0
    pool_bytes: int = 0
    last_error: str | None = None
    #: GPU-direct edges (docs/protocol.md §3.9): tensors placed in the device pool, their
    #: bytes, tensors that took the host path because the pool was full or the device
    #: failed (and the last reason), blocks and bytes held now, tensors copied out.
    num_device_puts: int = 0
    device_bytes_put: int = 0
    num_device_fallbacks: int = 0
    last_device_fallback: str | None = None
    device_blocks: int = 0
    device_pool_bytes: int = 0
    num_device_gets: int = 0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


@dataclass
class NamespaceObject:
    """One object a backend found in a namespace, its owner, and whether it was reclaimed."""

    name: str
    namespace: str
    #: ``slot`` (a pooled buffer: lives as long as its owner), ``object`` (a published
    #: transfer object), ``claim`` (a read in progress) or ``unknown``
    kind: str
    owner_pid: int | None
    owner_alive: bool | None
    age_s: float
    size: int
    state: str | None = None
    key: str | None = None
    reclaimed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReclaimReport:
    """What one reclaim found: every object, those reclaimed among them."""

    objects: list[NamespaceObject] = field(default_factory=list)

    @property
    def reclaimed(self) -> list[NamespaceObject]:
        return [o for o in self.objects if o.reclaimed]

    @property
    def transfer_objects(self) -> list[NamespaceObject]:
        """The objects that are not pooled buffers: what a request that ended must not
        leave behind."""
        return [o for o in self.objects if o.kind != "slot"]

    def extend(self, other: ReclaimReport) -> None:
        self.objects.extend(other.objects)

    def to_dict(self) -> dict[str, Any]:
        return {
            "objects": [o.to_dict() for o in self.objects],
            "num_objects": len(self.objects),
            "num_reclaimed": len(self.reclaimed),
            "bytes_reclaimed": sum(o.size for o in self.reclaimed),
        }


class Reclaimer(Protocol):
    """A backend's reclaim of a namespace (see the module docstring)."""

    def __call__(self, namespace: str | None, *, reclaim: bool) -> ReclaimReport: ...


def inbox_name(stage: int, replica: int = 0) -> str:
    """The name of one stage worker's inbox of arrival notices: ``"2"`` for stage 2 (its
    replica 0, the only one of a stage that is not replicated), ``"2.1"`` for replica 1."""
    return str(stage) if replica == 0 else f"{stage}.{replica}"


def validate_key(key: object) -> str:
    """Return ``key`` if usable as a transfer key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"transfer key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidKeyError("transfer key is empty")
    try:
        n = len(key.encode("utf-8", "surrogatepass"))
    except UnicodeError as exc:  # pragma: no cover - surrogatepass accepts every str
        raise InvalidKeyError(f"transfer key is not encodable: {exc}") from exc
    if n > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"transfer key is {n} bytes in UTF-8; the limit is {MAX_KEY_BYTES} "
            "(shorten the external request id)"
        )
    return key


def validate_namespace(namespace: object) -> str:
    """A namespace becomes part of every /dev/shm name: keep it short and plain."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise InvalidKeyError(
            f"namespace {namespace!r} is invalid: use 1-48 characters of letters, digits, "
            "'_' or '.', starting with a letter or digit"
        )
    return namespace


def is_prefix_match(key: str, prefix: str) -> bool:
    """docs/protocol.md §2.8: ``key`` is ``prefix`` followed by a decimal integer (and nothing else).

    ``prefix`` is normally ``f"{external_id}_{source_stage}_"``; callers may also pass it
    without the trailing underscore, in which case the underscore is required in the key.
    """
    if not key.startswith(prefix):
        return False
    rest = key[len(prefix) :]
    if not prefix.endswith("_"):
        if not rest.startswith("_"):
            return False
        rest = rest[1:]
    return rest.isascii() and rest.isdigit()


class Connector(ABC):
    """Abstract connector; see the module docstring for the contract."""

    backend: str = "abstract"

    @abstractmethod
    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult: ...

    @abstractmethod
    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult: ...

    @abstractmethod
    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        """Keys announced for ``to_stage``, waiting up to ``timeout``."""

    @abstractmethod
    def cleanup(self, key: str) -> bool:
        """Remove the exact key if this connector still tracks or published it. Returns
        True if an object was removed."""

    @abstractmethod
    def cleanup_prefix(self, prefix: str) -> int:
        """Remove tracked keys ``prefix + <int>``; returns how many objects were removed."""

    @abstractmethod
    def reap_consumed(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def health(self) -> ConnectorHealth: ...

    def pending_keys(self) -> list[str]:
        """Keys this connector put that it still tracks (unconsumed as far as it knows)."""
        return []

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

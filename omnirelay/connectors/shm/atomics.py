"""Atomic operations on 8-byte words in shared memory, for the slot state machine.

A slot's *stamp* word (``state | seq << 8``) is the only thing two processes ever race
on: readers claim an object with one compare-and-swap ``PUBLISHED(seq) -> CLAIMED(seq)``,
so exactly one reader wins without any filesystem operation, and a stamp names one
publish of one slot (no ABA: ``seq`` grows with every publish).

Python has no atomics on shared memory, and plain Python cannot make one: writes
through an ``mmap`` or ``struct.pack_into`` are copies with no atomicity or ordering
guarantee, so two readers could both see PUBLISHED and both take the object. Whatever
runs the claim's steps, its compare-and-swap must be the CPU's. Two implementations
(:class:`Backend`) of the three operations it needs (acquire load, release store,
sequentially consistent CAS), the first that works picked at import (:data:`DEFAULT`):

* :data:`EXTENSION`: ``omnirelay.connectors.shm._atomic_ops``, a small C extension built
  at install time (GCC/Clang ``__atomic`` builtins): tens of nanoseconds a call. It also
  makes a reader's whole claim (``slot.claim``'s steps) one call, which matters most on
  a CPU just woken, where every Python call is slow;
* :data:`LIBATOMIC`: GCC's runtime ``libatomic`` (``__atomic_compare_exchange_8`` and
  friends) through ``ctypes``, without releasing the GIL: most of a microsecond a call,
  as ctypes converts every argument. It is what keeps the connector correct where the
  extension could not be built (no compiler at install time), and it is part of every
  GCC installation (Debian/Ubuntu ``libatomic1``).

Both are lock-free for aligned 8-byte words on x86-64 and aarch64, hence safe between
processes. With neither, the shm connector cannot start and says so
(``omnirelay doctor`` reports which one is in use). What the extension saves on the
connector's path is in docs/performance.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from omnirelay.connectors.shm import slot
from omnirelay.errors import ConnectorError

__all__ = [
    "DEFAULT",
    "EXTENSION",
    "LIBATOMIC",
    "Backend",
    "Word",
    "available",
    "backend",
    "unavailable_reason",
]

_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_ACQUIRE = 2
_RELEASE = 3


class Backend(NamedTuple):
    """One implementation of the operations on the word at address ``addr``."""

    name: str
    #: ``load(addr) -> int``: acquire load; later reads see what the storer wrote before.
    load: Callable[[int], int]
    #: ``store(addr, value)``: release store; what was written before is visible first.
    store: Callable[[int, int], None]
    #: ``cas(addr, expected, desired) -> bool``: set ``desired`` if the word holds
    #: ``expected``; True if this call did it.
    cas: Callable[[int, int, int], bool]
    #: ``claim(stamp_addr, size, seq, key, pid, start) -> (offset, length) | None``: a
    #: reader's whole claim (``slot.claim``'s steps) in one call; None: ``slot.claim``.
    claim: Callable[[int, int, int, bytes, int, int], tuple[int, int] | None] | None = None


def _extension() -> Backend | None:
    try:
        from omnirelay.connectors.shm import _atomic_ops
    except ImportError:
        return None
    # A build for another slot layout (a stale extension) is not used at all.
    if not _atomic_ops.lock_free() or tuple(_atomic_ops.layout()) != slot.CLAIM_LAYOUT:
        return None
    return Backend(
        "C extension (omnirelay.connectors.shm._atomic_ops)",
        _atomic_ops.load,
        _atomic_ops.store,
        _atomic_ops.cas,
        _atomic_ops.claim,
    )


def _libatomic_backend(c_load: Any, c_store: Any, c_cas: Any) -> Backend:
    def load(addr: int) -> int:
        return int(c_load(addr, _ACQUIRE))

    def store(addr: int, value: int) -> None:
        c_store(addr, value, _RELEASE)

    def cas(addr: int, expected: int, desired: int) -> bool:
        # A fresh cell per call: the builtin writes the word's value into it on failure.
        cell = ctypes.c_uint64(expected)
        return bool(c_cas(addr, ctypes.addressof(cell), desired, _SEQ_CST, _SEQ_CST))

    return Backend("libatomic through ctypes (the C extension is not built: slower claims)", load, store, cas)


def _libatomic() -> tuple[Backend | None, str]:
    names = ["libatomic.so.1"]
    found = ctypes.util.find_library("atomic")
    if found and found not in names:
        names.append(found)
    last = "not found"
    for name in names:
        try:
            lib = ctypes.PyDLL(name)  # PyDLL: the GIL stays held; these calls take nanoseconds
        except OSError as exc:
            last = str(exc)
            continue
        try:
            c_cas = lib.__atomic_compare_exchange_8
            c_load = lib.__atomic_load_8
            c_store = lib.__atomic_store_8
            lock_free = lib.__atomic_is_lock_free
        except AttributeError as exc:
            last = f"{name}: {exc}"
            continue
        c_cas.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
        c_cas.restype = ctypes.c_bool
        c_load.argtypes = [ctypes.c_void_p, ctypes.c_int]
        c_load.restype = ctypes.c_uint64
        c_store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
        c_store.restype = None
        lock_free.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
        lock_free.restype = ctypes.c_bool
        probe = ctypes.c_uint64(0)
        if not lock_free(8, ctypes.addressof(probe)):
            last = f"{name}: 8-byte atomics are not lock-free on this CPU (not safe across processes)"
            continue
        return _libatomic_backend(c_load, c_store, c_cas), ""
    return None, (
        f"libatomic is not available ({last}); the shm connector needs it for cross-process "
        "claims (install the libatomic1 package)"
    )


EXTENSION = _extension()
LIBATOMIC, _LIBATOMIC_PROBLEM = _libatomic()
#: The implementation connectors use unless given another (None: neither works here).
DEFAULT = EXTENSION or LIBATOMIC


def available() -> bool:
    return DEFAULT is not None


def unavailable_reason() -> str | None:
    return None if DEFAULT is not None else _LIBATOMIC_PROBLEM


def backend() -> str:
    """Which implementation is in use (for ``omnirelay doctor``)."""
    return DEFAULT.name if DEFAULT is not None else "none"


class Word:
    """An aligned 8-byte word at ``offset`` of a writable buffer (an ``mmap``), with the
    operations of ``backend`` (default :data:`DEFAULT`) bound to its address.

    Holds an export of the buffer while alive, so the buffer cannot be closed (an
    ``mmap.close()`` raises ``BufferError``) and the word's memory stays mapped for as long
    as anyone holds the word: drop the references and the mapping goes with the last one.
    :meth:`release` drops the export early; only for a word no other thread can reach.
    """

    __slots__ = ("_addr", "_cell", "cas", "load", "store")

    def __init__(self, buf: Any, offset: int, backend: Backend | None = None) -> None:
        if backend is None:
            backend = DEFAULT
            if backend is None:
                raise ConnectorError(unavailable_reason() or "libatomic is not available")
        if offset % 8:
            raise ValueError(f"atomic word offset {offset} is not 8-byte aligned")
        self._cell: Any = ctypes.c_uint64.from_buffer(buf, offset)
        self._addr = addr = ctypes.addressof(self._cell)
        if addr % 8:
            raise ValueError("atomic word is not 8-byte aligned in memory")
        # Bound per word: the hot path pays one call, not two.
        self.load: Callable[[], int] = functools.partial(backend.load, addr)
        self.store: Callable[[int], None] = functools.partial(backend.store, addr)
        self.cas: Callable[[int, int], bool] = functools.partial(backend.cas, addr)

    @property
    def addr(self) -> int:
        """The word's address; valid while this word is alive."""
        return self._addr

    def release(self) -> None:
        """Drop the buffer export (idempotent)."""
        self._cell = None

"""Atomic operations on 8-byte words in shared memory, for the slot state machine.

A slot's *stamp* word (``state | seq << 8``) is the only thing two processes ever race
on: readers claim an object with one compare-and-swap ``PUBLISHED(seq) -> CLAIMED(seq)``,
so exactly one reader wins without any filesystem operation, and a stamp names one
publish of one slot (no ABA: ``seq`` grows with every publish).

Python has no atomics on shared memory. Two implementations of the same three
operations (acquire load, release store, sequentially consistent CAS), picked at import:

* ``omnirelay.connectors.shm._atomic_ops``, a small C extension built at install time
  (GCC/Clang ``__atomic`` builtins): tens of nanoseconds a call;
* otherwise GCC's runtime ``libatomic`` (``__atomic_compare_exchange_8`` and friends)
  through ``ctypes``, without releasing the GIL: most of a microsecond a call, as ctypes
  converts every argument. Part of every GCC installation (Debian/Ubuntu ``libatomic1``).

Both are lock-free for aligned 8-byte words on x86-64 and aarch64, hence safe between
processes. With neither, the shm connector cannot start and says so
(``omnirelay doctor`` reports which one is in use).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

from omnirelay.errors import ConnectorError

__all__ = ["Word", "available", "backend", "claim_op", "unavailable_reason"]

_SEQ_CST = 5  # __ATOMIC_SEQ_CST
_ACQUIRE = 2
_RELEASE = 3


def _load() -> tuple[Any, str | None]:
    names = ["libatomic.so.1"]
    found = ctypes.util.find_library("atomic")
    if found and found not in names:
        names.append(found)
    last = "not found"
    for name in names:
        try:
            # PyDLL: the GIL stays held; these calls take nanoseconds.
            lib = ctypes.PyDLL(name)
        except OSError as exc:
            last = str(exc)
            continue
        try:
            cas = lib.__atomic_compare_exchange_8
            load = lib.__atomic_load_8
            store = lib.__atomic_store_8
            lock_free = lib.__atomic_is_lock_free
        except AttributeError as exc:
            last = f"{name}: {exc}"
            continue
        cas.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
        cas.restype = ctypes.c_bool
        load.argtypes = [ctypes.c_void_p, ctypes.c_int]
        load.restype = ctypes.c_uint64
        store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
        store.restype = None
        lock_free.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
        lock_free.restype = ctypes.c_bool
        probe = ctypes.c_uint64(0)
        if not lock_free(8, ctypes.addressof(probe)):
            last = f"{name}: 8-byte atomics are not lock-free on this CPU (not safe across processes)"
            continue
        return (cas, load, store), None
    return None, (
        f"libatomic is not available ({last}); the shm connector needs it for cross-process "
        "claims (install the libatomic1 package)"
    )


def _load_extension() -> Any:
    try:
        from omnirelay.connectors.shm import _atomic_ops
    except ImportError:
        return None
    return _atomic_ops if _atomic_ops.lock_free() else None


_EXT = _load_extension()
_FUNCS, _REASON = _load()


def available() -> bool:
    return _EXT is not None or _FUNCS is not None


def unavailable_reason() -> str | None:
    return None if available() else _REASON


def claim_op(layout: tuple[int, ...]) -> Callable[..., tuple[int, int] | None] | None:
    """The C extension's whole-claim operation (see ``_atomic_ops.c``), if it is built and
    was compiled for this slot ``layout``; None: claim with the Python steps."""
    if _EXT is None or tuple(_EXT.layout()) != tuple(layout):
        return None
    op: Callable[..., tuple[int, int] | None] = _EXT.claim
    return op


def backend() -> str:
    """Which implementation is in use (for ``omnirelay doctor``)."""
    if _EXT is not None:
        return "C extension (omnirelay.connectors.shm._atomic_ops)"
    if _FUNCS is not None:
        return "libatomic through ctypes (the C extension is not built: slower claims)"
    return "none"


class Word:
    """An aligned 8-byte word at ``offset`` of a writable buffer (an ``mmap``).

    Holds an export of the buffer while alive, so the buffer cannot be closed (an
    ``mmap.close()`` raises ``BufferError``) and the word's memory stays mapped for as long
    as anyone holds the word: drop the references and the mapping goes with the last one.
    :meth:`release` drops the export early; only for a word no other thread can reach.
    """

    __slots__ = ("_addr", "_cell", "_exp", "_pexp", "cas", "load", "store")

    @property
    def addr(self) -> int:
        """The word's address (for ``claim_op``); valid while this word is alive."""
        return self._addr

    def __init__(self, buf: Any, offset: int, *, use_extension: bool = True) -> None:
        if not (_EXT is not None and use_extension) and _FUNCS is None:
            raise ConnectorError(_REASON or "libatomic is not available")
        if offset % 8:
            raise ValueError(f"atomic word offset {offset} is not 8-byte aligned")
        self._cell: Any = ctypes.c_uint64.from_buffer(buf, offset)
        self._addr = ctypes.addressof(self._cell)
        if self._addr % 8:
            raise ValueError("atomic word is not 8-byte aligned in memory")
        self._exp = ctypes.c_uint64(0)
        self._pexp = ctypes.addressof(self._exp)
        # The operations are bound per word: the hot path pays one call, not two.
        if _EXT is not None and use_extension:
            addr, ext = self._addr, _EXT
            self.load: Callable[[], int] = functools.partial(ext.load, addr)
            self.store: Callable[[int], None] = functools.partial(ext.store, addr)
            self.cas: Callable[[int, int], bool] = functools.partial(ext.cas, addr)
        else:
            self.load = self._ctypes_load
            self.store = self._ctypes_store
            self.cas = self._ctypes_cas

    def _ctypes_load(self) -> int:
        """Acquire load: later reads of the buffer see what the last storer wrote before."""
        funcs = _FUNCS
        assert funcs is not None
        return int(funcs[1](self._addr, _ACQUIRE))

    def _ctypes_store(self, value: int) -> None:
        """Release store: everything written before is visible to whoever loads ``value``."""
        funcs = _FUNCS
        assert funcs is not None
        funcs[2](self._addr, value, _RELEASE)

    def _ctypes_cas(self, expected: int, desired: int) -> bool:
        """Set the word to ``desired`` if it holds ``expected``; True if this call did it."""
        funcs = _FUNCS
        assert funcs is not None
        self._exp.value = expected
        return bool(funcs[0](self._addr, self._pexp, desired, _SEQ_CST, _SEQ_CST))

    def release(self) -> None:
        """Drop the buffer export (idempotent)."""
        self._cell = None

"""Atomic operations on 8-byte words in shared memory, for the slot state machine.

A slot's *stamp* word (``state | seq << 8``) is the only thing two processes ever race
on: readers claim an object with one compare-and-swap ``PUBLISHED(seq) -> CLAIMED(seq)``,
so exactly one reader wins without any filesystem operation, and a stamp names one
publish of one slot (no ABA: ``seq`` grows with every publish).

Python has no atomics on shared memory, so this module calls the GCC runtime's
``libatomic`` (``__atomic_compare_exchange_8`` and friends; lock-free for aligned 8-byte
words on x86-64 and aarch64) through ``ctypes`` without releasing the GIL (a call costs
well under a microsecond). The library is part of every GCC installation
(Debian/Ubuntu package ``libatomic1``); without it the shm connector cannot start and
says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from omnirelay.errors import ConnectorError

__all__ = ["Word", "available", "unavailable_reason"]

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


_FUNCS, _REASON = _load()


def available() -> bool:
    return _FUNCS is not None


def unavailable_reason() -> str | None:
    return _REASON


class Word:
    """An aligned 8-byte word at ``offset`` of a writable buffer (an ``mmap``).

    Holds an export of the buffer while alive, so the buffer cannot be closed (an
    ``mmap.close()`` raises ``BufferError``) and the word's memory stays mapped for as long
    as anyone holds the word: drop the references and the mapping goes with the last one.
    :meth:`release` drops the export early; only for a word no other thread can reach.
    """

    __slots__ = ("_addr", "_cell", "_exp", "_pexp")

    def __init__(self, buf: Any, offset: int) -> None:
        if _FUNCS is None:
            raise ConnectorError(_REASON or "libatomic is not available")
        if offset % 8:
            raise ValueError(f"atomic word offset {offset} is not 8-byte aligned")
        self._cell: Any = ctypes.c_uint64.from_buffer(buf, offset)
        self._addr = ctypes.addressof(self._cell)
        if self._addr % 8:
            raise ValueError("atomic word is not 8-byte aligned in memory")
        self._exp = ctypes.c_uint64(0)
        self._pexp = ctypes.addressof(self._exp)

    def load(self) -> int:
        """Acquire load: later reads of the buffer see what the last storer wrote before."""
        assert _FUNCS is not None
        return int(_FUNCS[1](self._addr, _ACQUIRE))

    def store(self, value: int) -> None:
        """Release store: everything written before is visible to whoever loads ``value``."""
        assert _FUNCS is not None
        _FUNCS[2](self._addr, value, _RELEASE)

    def cas(self, expected: int, desired: int) -> bool:
        """Set the word to ``desired`` if it holds ``expected``; True if this call did it."""
        assert _FUNCS is not None
        self._exp.value = expected
        return bool(_FUNCS[0](self._addr, self._pexp, desired, _SEQ_CST, _SEQ_CST))

    def release(self) -> None:
        """Drop the buffer export (idempotent)."""
        self._cell = None

"""The shm consumer's cache of slot mappings.

Slots are pooled by their producer, so a consumer sees the same few slot files again and
again; it maps each once and keeps it (an LRU bounded in entries and bytes), so a get
announced by a notice costs no system call at all. Two indexes: by file identity (device,
inode) for gets that found the object by the key's name, and by slot name (as notices
carry it) for the hot path, which reads :attr:`MappingCache.by_name` without the lock.

A mapping handed out is *pinned* (``users``) until :meth:`MappingCache.unpin`. One that
is forgotten (evicted, retired, replaced) is never unmapped explicitly: its atomic words
and views export the buffer, so the memory goes with the last reference, and a thread
still holding the mapping never touches unmapped memory.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from omnirelay.connectors.shm import atomics, names, slot
from omnirelay.errors import ConnectorError

__all__ = ["Mapping", "MappingCache"]


@dataclass(eq=False)
class Mapping:
    mm: mmap.mmap
    word: atomics.Word
    claim_word: atomics.Word
    view: memoryview
    size: int
    ident: tuple[int, int]
    #: ``claim(seq, key, pid, start) -> (offset, length) | None``: ``slot.claim`` on this
    #: mapping, in one C call where the extension is in use.
    claim: Callable[[int, bytes, int, int], tuple[int, int] | None]
    slot_name: bytes | None = None  # as notices name it (ASCII bytes)
    users: int = 0
    retired: bool = False


class MappingCache:
    """See the module docstring. ``shm_dir``/``slot_prefix``: where slots live and how
    their names start (a notice naming anything else is ignored); ``atomic_ops``: the
    implementation of the mappings' atomic words."""

    def __init__(
        self,
        shm_dir: str,
        slot_prefix: bytes,
        max_bytes: int,
        max_entries: int,
        atomic_ops: atomics.Backend | None = None,
    ) -> None:
        self._dir = shm_dir
        self._atomic_ops = atomic_ops or atomics.DEFAULT
        self._slot_prefix = slot_prefix
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[int, int], Mapping] = OrderedDict()
        #: slot name -> mapping; read without the lock on the hot path (one dict lookup).
        self.by_name: dict[bytes, Mapping] = {}
        self._bytes = 0
        self._misses = 0

    def pin_by_slot_name(self, name: bytes) -> Mapping | None:
        """A pinned mapping of the slot a notice named, or None if it cannot be used."""
        with self._lock:
            mp = self.by_name.get(name)
            if mp is not None and not mp.retired:
                self._maps.move_to_end(mp.ident)
                mp.users += 1
                return mp
        if not name.startswith(self._slot_prefix) or b"/" in name or b"\0" in name or not name.isascii():
            return None  # a notice from elsewhere: ignore its hint
        try:
            fd = os.open(os.path.join(self._dir, name.decode("ascii")), os.O_RDWR)
        except OSError:
            return None  # retired since: find the object by its key's name
        try:
            st = os.fstat(fd)
            mp = self.pin_cached(st)
            if mp is None:
                mp = self.map(fd, st, name)
            else:
                with self._lock:
                    mp.slot_name = name
                    self.by_name[name] = mp
            return mp
        except (OSError, ValueError, ConnectorError):
            return None
        finally:
            os.close(fd)

    def pin_cached(self, st: os.stat_result) -> Mapping | None:
        """A pinned cached mapping of the file ``st`` describes, or None. The cache holds
        the mapping, so the inode (and its number) cannot be reused while cached."""
        with self._lock:
            mp = self._maps.get((st.st_dev, st.st_ino))
            if mp is None or mp.size != st.st_size or mp.retired:
                return None
            self._maps.move_to_end((st.st_dev, st.st_ino))
            mp.users += 1
            return mp

    def map(self, fd: int, st: os.stat_result, name: bytes | None) -> Mapping:
        """Map the slot file ``fd`` (pinned) and cache it if it fits the budget."""
        ident = (st.st_dev, st.st_ino)
        size = st.st_size
        if size < slot.HEADER_SIZE:
            raise ValueError(f"object is {size} bytes, smaller than the {slot.HEADER_SIZE}-byte slot header")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        try:
            word = atomics.Word(mm, slot.STAMP_OFFSET, self._atomic_ops)
            claim_word = atomics.Word(mm, slot.CLAIM_SEQ_OFFSET, self._atomic_ops)
        except BaseException:
            mm.close()
            raise
        ops = self._atomic_ops
        if ops is not None and ops.claim is not None:
            claim = functools.partial(ops.claim, word.addr, size)
        else:
            claim = functools.partial(slot.claim, mm, size, word, claim_word)
        mp = Mapping(
            mm=mm,
            word=word,
            claim_word=claim_word,
            view=memoryview(mm),
            size=size,
            ident=ident,
            claim=claim,
            slot_name=name,
            users=1,
        )
        with self._lock:
            old = self._maps.pop(ident, None)
            if old is not None:
                self._drop_locked(old)
            if self._max_entries and size <= self._max_bytes:
                self._maps[ident] = mp
                if name is not None:
                    self.by_name[name] = mp
                self._bytes += size
                self._trim_locked()
            else:
                mp.retired = True  # not cached: dropped with its last reference
        return mp

    def retire(self, mp: Mapping) -> None:
        """Never hand ``mp`` out again (its slot turned out corrupt)."""
        with self._lock:
            mp.retired = True

    def unpin(self, mp: Mapping) -> None:
        with self._lock:
            mp.users -= 1
            if mp.retired and mp.users == 0 and self._maps.get(mp.ident) is mp:
                del self._maps[mp.ident]
                self._drop_locked(mp)

    def drop_dead_owners(self, is_alive: Callable[[names.OwnerId], bool]) -> int:
        """Forget the mappings of slots whose producer is dead; returns how many.

        A dead producer's slot files are unlinked by the sweep (docs/protocol.md §3.5), but
        a file's memory lives on while any process maps it: the cache would hold up to its
        byte budget of a dead process's memory until LRU eviction. The owner is read from
        each slot's own header (no system call); ``is_alive`` is asked once per owner."""
        with self._lock:
            owners = {ident: slot.owner_of(mp.mm) for ident, mp in self._maps.items()}
        verdicts = {owner: is_alive(owner) for owner in set(owners.values()) if owner is not None}
        dead = [ident for ident, owner in owners.items() if owner is not None and not verdicts[owner]]
        num = 0
        with self._lock:
            for ident in dead:
                mp = self._maps.pop(ident, None)
                if mp is not None:
                    self._drop_locked(mp)  # a pinned one goes with its last reference
                    num += 1
        return num

    def clear(self) -> None:
        """Forget every mapping (each goes with its last reference)."""
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self.by_name.clear()
            self._bytes = 0
        for mp in maps:
            mp.retired = True

    def __len__(self) -> int:
        return len(self._maps)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _drop_locked(self, mp: Mapping) -> None:
        self._bytes -= mp.size
        mp.retired = True
        if mp.slot_name is not None and self.by_name.get(mp.slot_name) is mp:
            del self.by_name[mp.slot_name]

    def _trim_locked(self) -> None:
        """Evict least recently used mappings over the budget; every 64 misses also drop
        mappings of slots their producer retired (their memory is freed with them)."""
        self._misses += 1
        scan_retired = self._misses % 64 == 0
        for ident, mp in list(self._maps.items()):
            over = len(self._maps) > self._max_entries or self._bytes > self._max_bytes
            if not over and not scan_retired:
                break
            if not over and mp.word.load() & 0xFF != slot.RETIRED:
                continue
            del self._maps[ident]
            self._drop_locked(mp)

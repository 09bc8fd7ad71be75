"""``shm``: the default connector, across processes on one Linux host.

Beyond the reference (DESIGN.md §7):

* **Atomic publish, exclusive consume, no lock files.** The producer writes an object
  into a private slot file, marks it PUBLISHED, sends the arrival notice, then makes it
  findable by key with one ``link()`` to the key's name — readers never see a partial
  object, and an unread object with the same key is never clobbered (``link`` fails with
  EEXIST; the put is then retracted, unless a reader already took it through the notice,
  which makes it delivered). A reader claims an object with one compare-and-swap of the
  slot's stamp word, ``PUBLISHED(seq) -> CLAIMED(seq)`` (``atomics``): exactly one reader
  wins, with no filesystem operation, and marks the slot FREE when it has copied it out.
  Only the producer removes the key's name, when it reaps the FREE slot (or retracts it),
  so a name always points at the slot its producer linked.
* **Arrival notices that say where.** The notice datagram carries the slot's name and the
  publish sequence as well as the key, so a receiver that has mapped the slot before
  (slots are pooled) consumes with no system call beyond the ``recv``. Notices are hints:
  a stale or forged one only fails a compare-and-swap, and the key's name is the way to
  find an object without one. A small object is announced *before* it is encoded, so
  the receiver's wake-up overlaps the encoding; a reader that arrives while it is still
  being written waits briefly, then asks for a second notice (``slot``'s WAITING state).
* **Fixed-length names.** Keys are hashed (``names.key_name``); the key itself lives in
  the slot header, so audits can recover it. Every name starts ``omnirelay-<namespace>``.
* **Reuse.** Slots are pooled, pre-faulted and stay mapped in the producer; consumers
  cache their mappings of recently seen slots. A put is one encode straight into shared
  memory; a get is one copy out (into huge-page backed memory via numpy).
* **Waiting costs nothing per request.** ``wait_arrivals`` blocks on the target stage's
  abstract UNIX socket.
* **Crash safety.** Names carry the owner's pid and start time; ``sweep`` (run at startup
  and by ``omnirelay doctor --reclaim``) removes objects of dead owners only. A slot left
  CLAIMED by a dead consumer returns to its producer's pool on the next reap.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirelay.connectors.base import (
    MAX_KEY_BYTES,
    REAP_BATCH,
    SMALL_OBJECT_BYTES,
    Arrivals,
    Connector,
    ConnectorHealth,
    GetResult,
    GetStatus,
    PutResult,
    is_prefix_match,
    validate_key,
    validate_namespace,
)
from omnirelay.connectors.shm import atomics, names, notices, slot
from omnirelay.connectors.shm.mappings import Mapping, MappingCache
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

__all__ = ["ShmConnector", "ShmOptions", "default_allocator", "notice_address"]

_MIN_SLOT = 16 << 10
_INSTANCES = itertools.count(1)
_MAX_HINTS = 8192
#: A CLAIMED slot whose claimer never wrote its record is abandoned after this long.
_UNRECORDED_CLAIM_S = 30.0
_MiB = 1 << 20
_FREE = slot.FREE
_PUBLISHED = slot.PUBLISHED
_CLAIMED = slot.CLAIMED
_WRITING = slot.WRITING
_WAITING = slot.WAITING
#: Objects up to this size (slot bytes) are announced before they are encoded.
_EARLY_NOTICE_MAX = SMALL_OBJECT_BYTES
#: Streams whose next decode outputs wait to be made at the reader's next idle moment.
_MAX_REPREPARE = 16
#: How long a reader that finds an announced object still being written waits for it
#: before it goes back to sleep (the producer then announces the object again).
_PUBLISH_WAIT_NS = 50_000


#: Abstract-namespace socket address of a stage's arrival notices (nothing on disk).
notice_address = notices.address


def _slot_size(need: int) -> int:
    if need <= _MiB:
        size = _MIN_SLOT
        while size < need:
            size <<= 1
        return size
    return (need + _MiB - 1) & ~(_MiB - 1)


def default_allocator(path: str, size: int) -> mmap.mmap:
    """Create a slot file of ``size`` bytes, allocate its pages and map it.

    ``posix_fallocate`` allocates tmpfs pages now, so a full /dev/shm is an ENOSPC here
    and never a SIGBUS on a later write. Raises OSError; leaves no file behind on error.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


@dataclass
class ShmOptions:
    """Options of the shm connector (validated at construction)."""

    pool_max_bytes: int = 1 << 30  # free slots kept for reuse, in bytes
    pool_max_slots: int = 256
    map_cache_bytes: int = 1 << 30  # consumer-side cache of slot mappings
    map_cache_entries: int = 128
    listen: bool = True  # bind this stage's notice socket at construction
    sweep_on_start: bool = True
    shm_dir: str = names.SHM_DIR

    def __post_init__(self) -> None:
        for name in ("pool_max_bytes", "pool_max_slots", "map_cache_bytes", "map_cache_entries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConnectorError(f"shm option {name} must be a non-negative int, got {value!r}")
        for name in ("listen", "sweep_on_start"):
            if not isinstance(getattr(self, name), bool):
                raise ConnectorError(f"shm option {name} must be true or false, got {getattr(self, name)!r}")


@dataclass(eq=False)
class _Slot:
    name: str
    path: str
    size: int
    mm: mmap.mmap
    word: atomics.Word
    claim_word: atomics.Word
    ino: int = 0
    seq: int = 0  # of the current (or last) publish
    payload_len: int = 0
    key: str | None = None
    khash: str | None = None  # of the key whose name links to this slot
    notice_head: bytes = b""  # slot name part of its notices
    view: memoryview | None = None  # of the whole mapping, for writes
    unrecorded_since: float | None = None  # CLAIMED without a record of this claim, since
    pooled: bool = False  # in the free pool (a second release would hand it out twice)

    def state(self) -> int:
        return self.word.load() & 0xFF

    def mm_view(self) -> memoryview:
        if self.view is None:
            self.view = memoryview(self.mm)
        return self.view


@dataclass
class _Counters:
    num_puts: int = 0
    num_put_failures: int = 0
    num_gets: int = 0
    num_get_failures: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    num_reaped: int = 0
    num_cleaned: int = 0
    num_notices_sent: int = 0
    num_notices_lost: int = 0
    last_error: str | None = None
    extra: dict[str, int] = field(default_factory=dict)


class ShmConnector(Connector):
    backend = "shm"

    def __init__(
        self,
        namespace: str,
        stage_id: int | None = None,
        *,
        allocator: Callable[[str, int], mmap.mmap] = default_allocator,
        use_claim_op: bool = True,
        **options: Any,
    ) -> None:
        self._closed = True  # until constructed: __del__ must not touch half-built state
        self.namespace = validate_namespace(namespace)
        self.stage_id = stage_id
        try:
            self.options = ShmOptions(**options)
        except TypeError as exc:
            raise ConnectorError(f"unknown shm connector option: {exc}") from exc
        if not atomics.available():
            raise ConnectorError(atomics.unavailable_reason() or "libatomic is not available")
        self._dir = self.options.shm_dir
        self._kprefix = os.path.join(self._dir, f"{names.PREFIX}{self.namespace}-k-")
        self._slot_prefix_b = f"{names.PREFIX}{self.namespace}-s-".encode()
        self._notice_addrs: dict[int, bytes] = {}
        self._allocator = allocator
        self._owner = names.self_owner()
        self._claimer_rec = slot.claimer_record(self._owner.pid, self._owner.start)
        self._claimer = (self._owner.pid, self._owner.start)
        #: A reader's whole claim in one C call (None: the Python steps, e.g. no extension).
        self._claim_op = atomics.claim_op(slot.CLAIM_LAYOUT) if use_claim_op else None
        self._instance = next(_INSTANCES)  # several connectors of one namespace in one process
        self._overflow: set[int] = set()  # stages whose notice queue overflowed; marker owed
        self._edge_need: dict[int, int] = {}  # to_stage -> payload bytes of its last put
        #: to_stage -> the small slot its last put used, taken again when free: a stream
        #: keeps its slot, so the reader's per-slot DecodeHint follows the stream.
        self._edge_slot: dict[int, _Slot] = {}
        self._lock = threading.Lock()  # producer books: pending, free pool, counters
        self._pending: OrderedDict[str, _Slot] = OrderedDict()
        self._free: list[_Slot] = []
        self._busy: set[_Slot] = set()  # acquired for a put in progress
        self._slot_seq = 0
        self._publish_seq = 0
        self._claim_seq = 0
        self._c = _Counters()
        self._maps = MappingCache(
            self._dir, self._slot_prefix_b, self.options.map_cache_bytes, self.options.map_cache_entries
        )
        self._hints_lock = threading.Lock()  # serializes evictions of old hints only
        #: key -> (slot name, seq, is the slot small), oldest first: the newest notice of each key.
        self._hints: dict[str, tuple[bytes, int, bool]] = {}
        #: Mappings whose stream just decoded: their next outputs are made when a
        #: wait_arrivals is about to sleep (idle time). Plain dict operations (GIL-atomic).
        self._reprepare: dict[Mapping, None] = {}
        self._send_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._send_sock.setblocking(False)
        self._listen: dict[int, tuple[socket.socket, Any]] = {}  # stage -> (socket, its poll object)
        self._listen_lock = threading.Lock()
        self._closed = False
        if self.options.sweep_on_start:
            from omnirelay.connectors.shm.reclaim import sweep

            sweep(namespace=self.namespace, reclaim=True, shm_dir=self._dir)
        if self.options.listen and stage_id is not None:
            try:
                self._bind(stage_id)
            except ConnectorError:
                pass  # another connector of this namespace listens for the stage

    # ------------------------------------------------------------------ producer side
    def put(self, from_stage: int, to_stage: int, key: str, obj: Any) -> PutResult:
        try:
            key_bytes = _key_bytes(key)
            if self._closed:
                raise ConnectorError("connector is closed")
        except OmniRelayError as exc:
            return self._put_failed(key, str(exc))
        off = slot.payload_offset(len(key_bytes))
        seq = 0
        # A small object announces itself before it is encoded: the receiver's wake-up
        # (tens of µs) then overlaps the encoding. Its size is guessed from the last
        # object on this edge; a pooled slot of that size is taken now.
        guess = self._edge_need.get(to_stage)
        early = guess is not None and off + guess <= _EARLY_NOTICE_MAX
        with self._lock:
            stale = self._pending.get(key)
            if stale is not None:
                if stale.word.load() != slot.stamp(_FREE, stale.seq):
                    self._c.num_put_failures += 1
                    return PutResult(ok=False, error=f"key {key!r} is already published and not yet consumed")
                del self._pending[key]  # consumed, not reaped yet: the key is free again
            sl = (
                self._take_free_locked(off + guess, self._edge_slot.get(to_stage))
                if early and guess
                else None
            )
            if sl is not None:
                self._publish_seq += 1
                seq = self._publish_seq
        if stale is not None:
            self._reclaim(stale)
        if sl is not None:
            sl.word.store(slot.stamp(_WRITING, seq))
            self._announce(to_stage, sl, seq, key_bytes)
        try:
            plan = codec.plan_encode(obj)
        except OmniRelayError as exc:
            if sl is not None:
                self._withdraw(sl, seq)
            return self._put_failed(key, str(exc))
        need = off + plan.nbytes
        self._edge_need[to_stage] = plan.nbytes
        if sl is not None and need > sl.size:
            # The guess was short: give the announced slot back (a reader that waits on it
            # sees its seq end FREE and looks the key up by name) and announce again below.
            self._withdraw(sl, seq)
            sl = None
        announced = sl is not None
        if sl is None:
            with self._lock:
                sl = self._take_free_locked(need, self._edge_slot.get(to_stage))
                self._publish_seq += 1
                seq = self._publish_seq
            if sl is None:
                try:
                    sl = self._allocate(need)
                except OSError as exc:
                    reason = (
                        "no space left in /dev/shm"
                        if exc.errno == errno.ENOSPC
                        else f"cannot allocate: {exc}"
                    )
                    return self._put_failed(key, f"{reason} (needed {need} bytes)")
                except (ValueError, ConnectorError) as exc:
                    return self._put_failed(key, f"cannot allocate: {exc}")
            sl.word.store(slot.stamp(_WRITING, seq))
        try:
            slot.write_publish_header(
                sl.mm,
                key=key_bytes,
                payload_len=plan.nbytes,
                owner_pid=self._owner.pid,
                owner_start=self._owner.start,
                created_ns=time.time_ns(),
                from_stage=from_stage,
                to_stage=to_stage,
            )
            plan.write_into(sl.mm_view()[off : off + plan.nbytes])
        except BaseException as exc:
            self._withdraw(sl, seq)
            if not isinstance(exc, Exception):
                raise
            return self._put_failed(key, f"{type(exc).__name__}: {exc}")
        sl.seq, sl.key, sl.payload_len, sl.khash = seq, key, plan.nbytes, None
        # Publish (release: the bytes above are visible first). An announced object whose
        # reader gave up waiting (WAITING) is announced again.
        if not announced or not sl.word.cas(slot.stamp(_WRITING, seq), slot.stamp(_PUBLISHED, seq)):
            sl.word.store(slot.stamp(_PUBLISHED, seq))
            # The notice goes out before the key's name exists: the receiver wakes while we link.
            self._announce(to_stage, sl, seq, key_bytes)
        khash = names.key_hash_bytes(key_bytes)
        try:
            os.link(sl.path, self._kprefix + khash)
            sl.khash = khash
        except OSError as exc:
            # Retract unless a reader already took it through the notice (then it is delivered).
            if sl.word.cas(slot.stamp(_PUBLISHED, seq), slot.stamp(_CLAIMED, seq)):
                self._record_claim(sl.mm, sl.claim_word, seq)
                sl.word.store(slot.stamp(_FREE, seq))
                self._release(sl)
                if isinstance(exc, FileExistsError):
                    return self._put_failed(
                        key,
                        f"key {key!r} is already published by another producer (a consumed object's "
                        "name is released by its producer's next reap)",
                    )
                return self._put_failed(key, f"cannot publish {key!r}: {exc}")
        with self._lock:
            self._busy.discard(sl)
            closed = self._closed
            if not closed:
                self._pending[key] = sl
                self._c.num_puts += 1
                self._c.bytes_put += plan.nbytes
                if sl.size <= _EARLY_NOTICE_MAX:
                    self._edge_slot[to_stage] = sl
        if closed:
            return self._end_put_after_close(sl, key, seq)
        self.reap_consumed()  # after the notice: off the consumer's critical path
        return PutResult(ok=True, nbytes=plan.nbytes, handle=f"{names.PREFIX}{self.namespace}-k-{khash}")

    def _end_put_after_close(self, sl: _Slot, key: str, seq: int) -> PutResult:
        """``close`` ran while this put was in flight. It released what its tables held,
        and this object was in none of them, so the put releases it itself: no name and no
        file is left. Withdrawn if no reader has claimed it (a failed put), delivered
        otherwise (the reader keeps its mapping until it is done)."""
        if sl.khash is not None:
            _unlink_quiet(self._kprefix + sl.khash)
        if sl.word.cas(slot.stamp(_PUBLISHED, seq), slot.stamp(_CLAIMED, seq)):
            self._retire(sl)
            return self._put_failed(key, "the connector was closed during the put; the object was withdrawn")
        self._retire(sl, mark=False)  # a reader claimed it first: it was delivered
        return PutResult(ok=True, nbytes=sl.payload_len)

    def _withdraw(self, sl: _Slot, seq: int) -> None:
        """Give back a slot taken for publish ``seq`` that will not be published: its
        stamp ends FREE(seq), so a reader holding its notice stops waiting, and it is
        pooled again."""
        sl.word.store(slot.stamp(_FREE, seq))
        sl.seq = seq
        self._release(sl)

    def _put_failed(self, key: object, reason: str) -> PutResult:
        with self._lock:
            self._c.num_put_failures += 1
            self._c.last_error = reason
        return PutResult(ok=False, error=reason)

    def _take_free_locked(self, need: int, prefer: _Slot | None = None) -> _Slot | None:
        """The smallest pooled slot that fits ``need`` without wasting much (lock held);
        ``prefer`` if it is pooled and fits."""
        most = max(4 * need, need + 2 * _MiB, _MIN_SLOT)
        if prefer is not None and prefer.pooled and need <= prefer.size <= most:
            best: _Slot | None = prefer
        else:
            best = None
            for sl in self._free:
                if need <= sl.size <= most and (best is None or sl.size < best.size):
                    best = sl
        if best is not None:
            self._free.remove(best)
            best.pooled = False
            self._busy.add(best)
        return best

    def _allocate(self, need: int) -> _Slot:
        """A new slot file (raises OSError, e.g. ENOSPC; leaves nothing behind on error)."""
        with self._lock:
            self._slot_seq += 1
            name = names.slot_name(self.namespace, self._owner, f"{self._instance}.{self._slot_seq}")
        size = _slot_size(need)
        path = os.path.join(self._dir, name)
        mm = self._allocator(path, size)
        try:
            ino = os.stat(path).st_ino
            word = atomics.Word(mm, slot.STAMP_OFFSET)
            claim_word = atomics.Word(mm, slot.CLAIM_SEQ_OFFSET)
        except BaseException:
            mm.close()
            _unlink_quiet(path)
            raise
        sl = _Slot(
            name=name,
            path=path,
            size=size,
            mm=mm,
            word=word,
            claim_word=claim_word,
            ino=ino,
            notice_head=name.encode(),
        )
        with self._lock:
            self._busy.add(sl)
        return sl

    def _reclaim(self, sl: _Slot) -> None:
        """A consumed (FREE) or retracted slot of ours: remove the key's name, then pool it.
        Only its producer removes a published object's name, so the name is still ours."""
        if sl.khash is not None:
            _unlink_quiet(self._kprefix + sl.khash)
        self._release(sl)

    def _release(self, sl: _Slot) -> None:
        """Return a slot to the free pool, or retire it if the pool is full or closed."""
        sl.key = sl.khash = None
        sl.payload_len = 0
        with self._lock:
            if sl.pooled:
                return  # Invariant: a slot is pooled once; never hand it to two puts
            self._busy.discard(sl)
            pool_bytes = sum(s.size for s in self._free)
            keep = (
                not self._closed
                and len(self._free) < self.options.pool_max_slots
                and pool_bytes + sl.size <= self.options.pool_max_bytes
            )
            if keep:
                sl.pooled = True
                self._free.append(sl)
        if not keep:
            self._retire(sl)

    def _retire(self, sl: _Slot, *, mark: bool = True) -> None:
        if mark:
            try:
                sl.word.store(slot.stamp(slot.RETIRED, sl.seq))
            except (ValueError, TypeError):
                pass  # already released
        # The mapping is not closed here: the atomic word and the view export it, and a
        # thread may still hold them. It is unmapped when the last reference goes (the
        # slot is in no table any more), so no access can ever touch unmapped memory.
        _unlink_quiet(sl.path)

    def _announce(self, to_stage: int, sl: _Slot, seq: int, key_bytes: bytes) -> None:
        """Tell the target stage that publish ``seq`` of slot ``sl`` holds the key."""
        tag = notices.TAG_SMALL if sl.size <= SMALL_OBJECT_BYTES else notices.TAG_NORMAL
        self._notify(to_stage, tag, seq, sl.notice_head, key_bytes)

    def _notify(self, to_stage: int, tag: int, seq: int, name: bytes, key_bytes: bytes) -> None:
        """Announce a key to the target stage. A full receiver queue (Linux queues only
        ``net.unix.max_dgram_qlen`` datagrams, 10 by default) is remembered, and an overflow
        marker is sent as soon as there is room, so the receiver polls everything once."""
        addr = self._notice_addrs.get(to_stage)
        if addr is None:
            addr = self._notice_addrs[to_stage] = notices.address(self.namespace, to_stage)
        if self._overflow and to_stage in self._overflow:
            self._send_overflow_marker(to_stage)
        ext_send = notices.EXT_SEND
        if ext_send is not None:  # notices.send, inlined: on the way to every notice
            fd = self._send_sock.fileno()
            err = int(ext_send(fd, addr, tag, seq, name, key_bytes)) if fd >= 0 else errno.EBADF
        else:
            err = notices.send(self._send_sock, addr, tag, seq, name, key_bytes)
        if err == errno.EAGAIN:
            with self._lock:
                self._overflow.add(to_stage)
        # Any other error: nobody listens yet (a new receiver polls on registration).
        with self._lock:
            if err:
                self._c.num_notices_lost += 1
            else:
                self._c.num_notices_sent += 1

    def _send_overflow_marker(self, to_stage: int) -> None:
        addr = self._notice_addrs.get(to_stage) or notices.address(self.namespace, to_stage)
        if notices.send(self._send_sock, addr, 0, 0, b"", b"") == errno.EAGAIN:
            return  # still full: try again on the next put or reap
        with self._lock:  # sent, or the receiver is gone: nothing more to tell
            self._overflow.discard(to_stage)

    def reap_consumed(self) -> int:
        """One bounded rotating pass over pending keys (SPEC §3.5), syscall-free: a consumed
        object's slot reads FREE in our own mapping."""
        if self._overflow:
            for stage in list(self._overflow):
                self._send_overflow_marker(stage)
        reclaimed: list[_Slot] = []
        orphaned: list[_Slot] = []
        with self._lock:
            for _ in range(min(REAP_BATCH, len(self._pending))):
                key, sl = self._pending.popitem(last=False)
                word = sl.word.load()
                if word == slot.stamp(_FREE, sl.seq):
                    reclaimed.append(sl)
                elif word == slot.stamp(_CLAIMED, sl.seq) and self._claim_abandoned(sl):
                    orphaned.append(sl)  # the consumer died mid-read
                else:
                    self._pending[key] = sl
            self._c.num_reaped += len(reclaimed) + len(orphaned)
        for sl in orphaned:
            sl.word.store(slot.stamp(_FREE, sl.seq))  # the dead claimer's claim ends here
            reclaimed.append(sl)
        for sl in reclaimed:
            sl.unrecorded_since = None
            self._reclaim(sl)
        return len(reclaimed)

    def _record_claim(self, mm: mmap.mmap, claim_word: atomics.Word, seq: int) -> None:
        """Our claim record for publish ``seq``: who, then (release) which claim it is."""
        slot.write_claimer_record(mm, self._claimer_rec)
        claim_word.store(seq)

    @staticmethod
    def _claim_abandoned(sl: _Slot) -> bool:
        """True if the claim of ``sl``'s current publish belongs to a dead process: from its
        claimer's record, or — a claimer killed between its CAS and its record, a window of
        a few instructions — from the record still missing after ``_UNRECORDED_CLAIM_S``."""
        if sl.claim_word.load() != sl.seq:
            now = time.monotonic()
            if sl.unrecorded_since is None:
                sl.unrecorded_since = now
            return now - sl.unrecorded_since > _UNRECORDED_CLAIM_S
        sl.unrecorded_since = None
        hdr = slot.read_header(sl.mm, sl.size)
        if isinstance(hdr, str):
            return False
        return not names.owner_alive(names.OwnerId(hdr.claimer_pid, hdr.claimer_start))

    def cleanup(self, key: str) -> bool:
        """Retract ``key`` if this connector published it and nobody claimed it yet.

        The producer claims its own object exactly like a reader (the stamp CAS of that
        publish), so a reader that won keeps its object, and a slot recycled for another
        key in the meantime (a newer ``seq``) is never touched. Idempotent; returns True
        if an object was removed.
        """
        with self._lock:
            sl = self._pending.get(key)
            if sl is None:
                return False
            seq = sl.seq
        if not sl.word.cas(slot.stamp(_PUBLISHED, seq), slot.stamp(_CLAIMED, seq)):
            return False  # a reader claimed it first: it frees the slot, reap picks it up
        self._record_claim(sl.mm, sl.claim_word, seq)
        with self._lock:
            if self._pending.get(key) is sl:
                del self._pending[key]
            self._c.num_cleaned += 1
        sl.word.store(slot.stamp(_FREE, seq))
        self._reclaim(sl)
        return True

    def cleanup_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in self._pending if is_prefix_match(k, prefix)]
        return sum(1 for k in keys if self.cleanup(k))

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    # ------------------------------------------------------------------ consumer side
    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        key_bytes = key.encode("utf-8", "surrogatepass") if type(key) is str else b""
        if not key_bytes or len(key_bytes) > MAX_KEY_BYTES:  # _key_bytes, inlined: hot path
            try:
                key_bytes = _key_bytes(key)
            except OmniRelayError as exc:
                return self._get_failed(str(exc))
        if self._closed:
            return self._get_failed("connector is closed")
        hint = self._hints.pop(key, None) if self._hints else None  # one dict op: GIL-atomic
        if hint is not None:
            name, seq, is_small = hint
            # Hot path: the notice named the slot and the publish; a slot mapped before is
            # used without a system call or a lock (the reference keeps the mapping alive).
            mp = self._maps.by_name.get(name)
            pinned = mp is None or mp.retired
            if pinned:
                mp = self._maps.pin_by_slot_name(name)  # pinned until unpin (None: unusable hint)
            if mp is not None:
                try:
                    if is_small and mp.size > SMALL_OBJECT_BYTES:
                        res = None  # not what a small notice may name: look it up by name
                    else:
                        res = self._claim(mp, key, key_bytes, seq)
                        if res is None:
                            res = self._await_publish(mp, key, key_bytes, seq)
                finally:
                    if pinned:
                        self._maps.unpin(mp)
                if res is not None:
                    return res
            if is_small:
                # A small notice's get stays bounded (Arrivals.small), also when what it
                # announced is gone and the key is looked up by name.
                return self._get_by_name(key, key_bytes, names.key_hash_bytes(key_bytes), to_stage=to_stage)
        return self._get_by_name(key, key_bytes, names.key_hash_bytes(key_bytes))

    def _await_publish(self, mp: Mapping, key: str, key_bytes: bytes, seq: int) -> GetResult | None:
        """The claim of publish ``seq`` failed; if its notice came before the object was
        written (small objects are announced early), wait up to ``_PUBLISH_WAIT_NS`` for
        the publish and claim it. If it does not come, mark the slot WAITING, so its
        producer announces it again once published, and report NOT_YET. None: there is
        nothing of this publish to wait for (look the key up by name)."""
        stamp = seq << 8  # slot.stamp(state, seq) is stamp | state
        writing, waiting, published = stamp | _WRITING, stamp | _WAITING, stamp | _PUBLISHED
        deadline = 0
        word = mp.word.load()
        while True:
            if word == published:  # published since the failed claim: claim it now
                return self._claim(mp, key, key_bytes, seq)
            if word == waiting:
                return GetResult(GetStatus.NOT_YET)  # the producer announces it again
            if word != writing:
                return None  # consumed, withdrawn or recycled: the key's name tells
            if not deadline:
                # Idle time until the publish: make the decode's outputs now, if this
                # slot's stream is likely to repeat its last header (not counted as waiting).
                mp.hint.prepare()
                deadline = time.perf_counter_ns() + _PUBLISH_WAIT_NS
            elif time.perf_counter_ns() > deadline:
                if mp.word.cas(writing, waiting):
                    return GetResult(GetStatus.NOT_YET)  # the producer announces it again
            else:
                os.sched_yield()  # a producer sharing this CPU gets to finish
            word = mp.word.load()

    def _get_by_name(
        self, key: str, key_bytes: bytes, khash: str, *, to_stage: int | None = None
    ) -> GetResult:
        """Find the object through the key's name (no notice, or a stale one).

        ``to_stage`` set: the get of a small notice, bounded by SMALL_OBJECT_BYTES. A larger
        object is left in place and announced again to ``to_stage`` (ourselves) by a notice
        that is not small, so the receiver gets it the way it gets any large object.
        """
        path = self._kprefix + khash
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return GetResult(GetStatus.NOT_YET)
        except OSError as exc:
            return self._get_failed(f"cannot open {key!r}: {exc}")
        try:
            st = os.fstat(fd)
            if to_stage is not None and st.st_size > SMALL_OBJECT_BYTES:
                os.close(fd)
                self._notify(to_stage, notices.TAG_NORMAL, 0, b"", key_bytes)  # "look it up by name"
                return GetResult(GetStatus.NOT_YET)
            mp = self._maps.pin_cached(st)
            if mp is None:
                mp = self._maps.map(fd, st, None)
        except (OSError, ValueError, ConnectorError) as exc:
            os.close(fd)
            self._remove_name_if(path, None)
            return self._get_failed(f"corrupt object for key {key!r}: cannot map it: {exc}")
        os.close(fd)
        try:
            hdr = slot.read_header(mp.mm, mp.size)
            if isinstance(hdr, str):
                self._maps.retire(mp)
                self._remove_name_if(path, st.st_ino)
                return self._get_failed(f"corrupt object for key {key!r}: {hdr}")
            if hdr.key != key_bytes:
                # The name may have been reaped and the slot recycled for another key since we
                # opened it (consumed objects keep their name until their producer's reap):
                # then the object we looked for is gone, which is not a corruption.
                if not _names_inode(path, st.st_ino):
                    return GetResult(GetStatus.NOT_YET)
                self._remove_name_if(path, st.st_ino)
                return self._get_failed(f"corrupt object for key {key!r}: header names a different key")
            if hdr.state != _PUBLISHED:
                return GetResult(GetStatus.NOT_YET)  # another reader holds it (or it is going away)
            res = self._claim(mp, key, key_bytes, hdr.seq)
            return res if res is not None else GetResult(GetStatus.NOT_YET)
        finally:
            self._maps.unpin(mp)

    def _claim(self, mp: Mapping, key: str, key_bytes: bytes, seq: int) -> GetResult | None:
        """Claim publish ``seq`` of the mapped slot and consume it; None if it is not there
        (claimed by another reader, already recycled, or a notice that named the wrong slot)."""
        stamp = seq << 8  # slot.stamp(state, seq) is stamp | state
        if self._claim_op is not None:  # the same steps, in one call
            span = self._claim_op(mp.word.addr, mp.size, seq, key_bytes, *self._claimer)
            if span is None:
                return None
            off, nbytes = span
        else:
            if not mp.word.cas(stamp | _PUBLISHED, stamp | _CLAIMED):
                return None
            found = slot.read_payload_span(mp.mm, mp.size, key_bytes)
            if found is None:
                mp.word.store(stamp | _PUBLISHED)  # not ours to take: put it back untouched
                return None
            off, nbytes = found
            self._record_claim(mp.mm, mp.claim_word, seq)
        try:
            try:
                obj = codec.decode(mp.view[off : off + nbytes], copy=True, hint=mp.hint)
                if mp.hint.can_prepare and len(self._reprepare) < _MAX_REPREPARE:
                    self._reprepare[mp] = None  # bounded: a reader that never waits holds few
            except OmniRelayError as exc:
                return self._get_failed(f"corrupt payload for key {key!r}: {exc}")
        finally:
            mp.word.store(stamp | _FREE)  # Invariant: written after the last read.
        sl = None
        with self._lock:
            self._c.num_gets += 1
            self._c.bytes_got += nbytes
            if self._pending:
                # An in-process consumer of our own object: drop it from pending right away.
                sl = self._pending.get(key)
                if sl is not None and sl.word.load() == slot.stamp(_FREE, sl.seq):
                    del self._pending[key]
                    self._c.num_reaped += 1
                else:
                    sl = None
        if sl is not None:
            self._reclaim(sl)
        return GetResult(GetStatus.READY, obj=obj, nbytes=nbytes)

    def _remove_name_if(self, path: str, ino: int | None) -> None:
        """Remove a bad object's name, but only if it still names inode ``ino`` (claim it
        with a rename, compare, then drop or give back). ``ino`` None: any non-slot file."""
        with self._lock:
            self._claim_seq += 1
            seq = self._claim_seq
        claim = os.path.join(
            self._dir, names.claim_name(self.namespace, self._owner, os.path.basename(path)[-40:], seq)
        )
        try:
            os.rename(path, claim)
        except OSError:
            return
        try:
            st = os.stat(claim)
            if ino is not None and st.st_ino != ino:
                try:
                    os.link(claim, path)  # not the object we judged: give the name back
                except FileExistsError:
                    pass
        except OSError:
            pass
        finally:
            _unlink_quiet(claim)

    def _get_failed(self, reason: str) -> GetResult:
        with self._lock:
            self._c.num_get_failures += 1
            self._c.last_error = reason
        return GetResult(GetStatus.FAILED, error=reason)

    # ------------------------------------------------------------------ notices
    def _bind(self, stage: int) -> socket.socket:
        with self._listen_lock:
            listener = self._listen.get(stage)
            if listener is not None:
                return listener[0]
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(notice_address(self.namespace, stage))
            except OSError as exc:
                sock.close()
                raise ConnectorError(
                    f"cannot listen for arrivals of stage {stage} in namespace {self.namespace!r}: {exc} "
                    "(another receiver of this stage is running in this namespace)"
                ) from exc
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            except OSError:
                pass
            sock.setblocking(False)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            self._listen[stage] = (sock, poller)
            return sock

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        if self._closed:
            raise ConnectorError("connector is closed")
        listener = self._listen.get(to_stage)
        if listener is None:
            self._bind(to_stage)
            listener = self._listen[to_stage]
        keys = self._drain(listener)
        if keys or keys.overflowed or timeout == 0:
            return keys
        if self._reprepare:
            # The GIL goes first to any thread waiting for it (a scheduler woken by the
            # chunk just handed over): making outputs ahead is idle work, and holding the
            # GIL for it would stand between that thread and the chunk.
            os.sched_yield()
            self._prepare_idle()
        try:
            ready = listener[1].poll(-1 if timeout is None else timeout * 1000.0)
        except (OSError, ValueError):
            return keys  # closed under us
        return self._drain(listener, ready=True) if ready else keys

    def _prepare_idle(self, limit: int = 8) -> None:
        """About to sleep: make the next outputs of streams that decoded since (a few)."""
        for _ in range(limit):
            try:
                mp = self._reprepare.popitem()[0]
            except KeyError:
                return
            if not mp.retired:
                mp.hint.prepare()

    def _drain(self, listener: tuple[socket.socket, Any], *, ready: bool = False) -> Arrivals:
        """Take queued notices (no blocking): announced keys, and their hints.

        ``ready``: a blocking poll just said a notice is queued. Then only that one is
        taken: the first arrival after an idle wait costs one ``recv`` and no second
        system call; any others are taken by the next call, whose drain comes first.
        """
        keys = Arrivals()
        small: set[str] = set()
        keys.small = small
        hints = self._hints
        ext_drain = notices.EXT_DRAIN
        if ext_drain is not None:  # notices.drain, inlined: first thing after a wake-up
            fd = listener[0].fileno()
            try:
                got = ext_drain(fd, notices.BUFSIZE, 1 if ready else 0) if fd >= 0 else []
            except OSError:  # closed under us
                got = []
        else:
            got = notices.drain(listener[0], listener[1], 1 if ready else 0)
        for notice in got:
            if notice is None:
                keys.overflowed = True  # lost notices, or a datagram we do not understand
                continue
            tag, seq, name, key = notice
            keys.append(key)
            # The newest notice of a key is its hint, so it alone says whether it is small.
            # Hints are plain dict operations (atomic under the GIL; get() pops them
            # without a lock). Re-inserted last: the newest hint is kept longest. A notice
            # naming no slot says "look it up by name".
            hints.pop(key, None)
            if tag == notices.TAG_SMALL and name:
                small.add(key)
                hints[key] = (name, seq, True)
            else:
                small.discard(key)
                if name:
                    hints[key] = (name, seq, False)
        if len(hints) > _MAX_HINTS:
            with self._hints_lock:
                while len(hints) > _MAX_HINTS:
                    try:  # get() pops hints without the lock: the oldest may change under us
                        hints.pop(next(iter(hints)), None)
                    except (RuntimeError, StopIteration):
                        continue
        return keys

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
            free, self._free = self._free, []
            self._edge_slot.clear()
            self._reprepare.clear()
        for sl in pending:
            # Names are ours to remove. A reader mid-copy keeps its mapping (and its claim).
            if sl.khash is not None:
                _unlink_quiet(self._kprefix + sl.khash)
            claimed = sl.word.load() & 0xFF == _CLAIMED
            self._retire(sl, mark=not claimed)
        for sl in free:
            self._retire(sl)
        self._maps.clear()  # each mapping goes with its last reference
        with self._hints_lock:
            self._hints.clear()
        with self._listen_lock:
            socks = list(self._listen.values())
            self._listen.clear()
        for sock, _ in socks:
            sock.close()
        self._send_sock.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    def health(self) -> ConnectorHealth:
        with self._lock:
            c = self._c
            live_bytes = sum(s.payload_len for s in self._pending.values())
            return ConnectorHealth(
                backend=self.backend,
                namespace=self.namespace,
                stage_id=self.stage_id,
                status="closed" if self._closed else "healthy",
                num_puts=c.num_puts,
                num_put_failures=c.num_put_failures,
                num_gets=c.num_gets,
                num_get_failures=c.num_get_failures,
                bytes_put=c.bytes_put,
                bytes_got=c.bytes_got,
                num_pending_keys=len(self._pending),
                num_live_objects=len(self._pending),
                live_bytes=live_bytes,
                num_reaped=c.num_reaped,
                num_cleaned=c.num_cleaned,
                num_notices_sent=c.num_notices_sent,
                num_notices_lost=c.num_notices_lost,
                pool_slots=len(self._free) + len(self._pending) + len(self._busy),
                pool_bytes=sum(s.size for s in self._free)
                + sum(s.size for s in self._pending.values())
                + sum(s.size for s in self._busy),
                last_error=c.last_error,
            )


def _key_bytes(key: object) -> bytes:
    """The UTF-8 bytes of a valid transfer key (``validate_key``'s rules, one encode)."""
    if type(key) is str and key:
        data = key.encode("utf-8", "surrogatepass")
        if len(data) <= MAX_KEY_BYTES:
            return data
    validate_key(key)  # raises with the precise reason
    raise AssertionError("unreachable")  # pragma: no cover


def _names_inode(path: str, ino: int) -> bool:
    """Whether ``path`` still names inode ``ino``."""
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

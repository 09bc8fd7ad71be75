"""The writing side of the shm connector: put, publish, reap, retract.

A put takes a slot from the pool (or allocates one), encodes the object straight into
it (one copy per tensor), publishes it (stamp PUBLISHED), sends the arrival notice, and
then makes it findable by key with one ``link()`` to the key's name. A small object (its
edge's last one fit in ``EARLY_NOTICE_MAX``) is announced *before* it is encoded, so the
receiver's wake-up overlaps the encoding (``slot``'s WRITING and WAITING states say how
a reader that arrives early waits; docs/performance.md has what it saves). Readers never see a
partial object, and an unread object with the same key is never clobbered: ``link``
fails with EEXIST and the put is retracted — unless a reader already took it through
the notice, which makes it delivered.

The producer keeps every object it published in ``pending`` until a reader consumed it:
a consumed slot reads FREE in the producer's own mapping, so :meth:`Producer.reap` needs
no system call to find it. Only the producer removes a key's name (when it reaps or
retracts the object), so a name always points at the slot its producer linked. A slot
left CLAIMED by a reader that died returns to the pool on a later reap.

Slots are pooled (best fit, bounded in count and bytes), pre-faulted, and stay mapped.

On a GPU-direct edge (``device``, docs/protocol.md §3.9) the codec offers each device
tensor to the connector's device pool; the keys of the blocks a put took stay with its
slot, and whatever returns the slot to the pool or retires it releases them — so a block
lives exactly as long as the object that refers to it.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omnirelay.connectors.base import REAP_BATCH, SMALL_OBJECT_BYTES, PutResult, is_prefix_match
from omnirelay.connectors.shm import atomics, names, notices, slot
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

if TYPE_CHECKING:
    from omnirelay.connectors.device.edge import DeviceSender

__all__ = ["Allocator", "Producer", "default_allocator"]

#: ``allocator(path, size) -> mmap``: create, allocate and map a slot file.
Allocator = Callable[[str, int], mmap.mmap]

_MIN_SLOT = 16 << 10
_MiB = 1 << 20
_INSTANCES = itertools.count(1)
#: A CLAIMED slot whose claimer never wrote its record is abandoned after this long.
_UNRECORDED_CLAIM_S = 30.0
#: Objects up to this size (slot bytes) are announced before they are encoded.
EARLY_NOTICE_MAX = SMALL_OBJECT_BYTES


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
        _unlink_quiet(path)
        raise
    finally:
        os.close(fd)


def _slot_size(need: int) -> int:
    if need <= _MiB:
        size = _MIN_SLOT
        while size < need:
            size <<= 1
        return size
    return (need + _MiB - 1) & ~(_MiB - 1)


@dataclass(eq=False)
class _Slot:
    """One slot file of this producer, mapped for as long as it exists."""

    name: str
    path: str
    size: int
    mm: mmap.mmap
    word: atomics.Word
    claim_word: atomics.Word
    seq: int = 0  # of the current (or last) publish
    payload_len: int = 0
    khash: str | None = None  # of the key whose name links to this slot
    notice_head: bytes = b""  # slot name part of its notices
    view: memoryview | None = None  # of the whole mapping, for writes
    unrecorded_since: float | None = None  # CLAIMED without a record of this claim, since
    pooled: bool = False  # in the free pool (a second release would hand it out twice)
    device_keys: list[str] | None = None  # device blocks its object refers to (GPU-direct)

    def mm_view(self) -> memoryview:
        if self.view is None:
            self.view = memoryview(self.mm)
        return self.view


class Producer:
    """Puts of one connector (any thread) and the books of what they published.

    ``pool_max_slots`` / ``pool_max_bytes`` bound the free slots kept for reuse;
    ``on_error(reason)`` is told of every failed put. ``device``: the device pool of the
    GPU-direct edges, to the stages in ``device_to``.
    """

    def __init__(
        self,
        *,
        namespace: str,
        shm_dir: str,
        allocator: Allocator,
        atomic_ops: atomics.Backend,
        outbox: notices.Outbox,
        pool_max_slots: int,
        pool_max_bytes: int,
        on_error: Callable[[str], None],
        device: DeviceSender | None = None,
        device_to: frozenset[int] = frozenset(),
    ) -> None:
        self._namespace = namespace
        self._device = device
        self._device_to = device_to if device is not None else frozenset()
        self._dir = shm_dir
        self._kprefix = os.path.join(shm_dir, f"{names.PREFIX}{namespace}-k-")
        self._owner = names.self_owner()
        self._allocator = allocator
        self._atomic_ops = atomic_ops
        self._outbox = outbox
        self._pool_max_slots = pool_max_slots
        self._pool_max_bytes = pool_max_bytes
        self._on_error = on_error
        self._instance = next(_INSTANCES)  # several connectors of one namespace in one process
        self._edge_need: dict[int, int] = {}  # to_stage -> payload bytes of its last put
        self._lock = threading.Lock()  # everything below
        self._pending: OrderedDict[str, _Slot] = OrderedDict()  # published, not known consumed
        self._free: list[_Slot] = []
        self._busy: set[_Slot] = set()  # taken for a put in progress
        self._slot_seq = 0
        self._publish_seq = 0
        self.is_closed = False
        self.num_puts = 0
        self.num_put_failures = 0
        self.bytes_put = 0
        self.num_reaped = 0
        self.num_cleaned = 0

    # ------------------------------------------------------------------ put
    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> PutResult:
        try:
            key_bytes = names.key_bytes(key)
            if self.is_closed:
                raise ConnectorError("connector is closed")
        except OmniRelayError as exc:
            return self._failed(str(exc))
        refused = self._free_key(key)
        if refused is not None:
            return refused
        off = slot.payload_offset(len(key_bytes))
        taken = self._announce_early(to_stage, to_replica, off, key_bytes)
        placed: list[str] | None = None
        try:
            if self._device_to and to_stage in self._device_to:
                assert self._device is not None
                placed = []
                plan = codec.plan_encode(obj, self._device.placer(placed))
            else:
                plan = codec.plan_encode(obj)
        except OmniRelayError as exc:
            if taken is not None:
                self._withdraw(*taken)
            self._drop_blocks(placed)
            return self._failed(str(exc))
        need = off + plan.nbytes
        self._edge_need[to_stage] = plan.nbytes
        if taken is not None and need > taken[0].size:
            # The guess was short: give the announced slot back (a reader that waits on it
            # sees its seq end FREE and looks the key up by name) and announce again later.
            self._withdraw(*taken)
            taken = None
        announced = taken is not None
        if taken is None:
            got = self._take_slot(need)
            if isinstance(got, str):
                self._drop_blocks(placed)
                return self._failed(got)
            taken = got
        sl, seq = taken
        if placed:
            sl.device_keys = placed  # released with the slot, whichever way it goes
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
            return self._failed(f"{type(exc).__name__}: {exc}")
        sl.seq, sl.payload_len, sl.khash = seq, plan.nbytes, None
        return self._publish(sl, seq, (to_stage, to_replica), key, key_bytes, announced=announced)

    def _free_key(self, key: str) -> PutResult | None:
        """Refuse a key we published that is not consumed yet; reclaim one that is (not
        reaped yet), so the key is free again."""
        with self._lock:
            stale = self._pending.get(key)
            if stale is None:
                return None
            if stale.word.load() != slot.stamp(slot.FREE, stale.seq):
                self.num_put_failures += 1
                return PutResult(ok=False, error=f"key {key!r} is already published and not yet consumed")
            self._unpend_locked(key, stale)
        self._release(stale)
        return None

    def _announce_early(
        self, to_stage: int, to_replica: int, off: int, key_bytes: bytes
    ) -> tuple[_Slot, int] | None:
        """Announce a small object before it is encoded, so the receiver's wake-up overlaps
        the encoding: take a pooled slot of the size of the edge's last object, stamp it
        WRITING for a new publish and send its notice. None: no such guess or slot (the
        object is announced once it is published)."""
        guess = self._edge_need.get(to_stage)
        if not guess or off + guess > EARLY_NOTICE_MAX:
            return None
        with self._lock:
            sl = self._take_free_locked(off + guess)
            if sl is None:
                return None
            self._publish_seq += 1
            seq = self._publish_seq
        sl.word.store(slot.stamp(slot.WRITING, seq))
        self._outbox.announce_slot(to_stage, seq, sl.notice_head, sl.size, key_bytes, to_replica)
        return sl, seq

    def _take_slot(self, need: int) -> tuple[_Slot, int] | str:
        """A slot of at least ``need`` bytes, stamped WRITING for a new publish seq; or why
        none could be had."""
        with self._lock:
            sl = self._take_free_locked(need)
            self._publish_seq += 1
            seq = self._publish_seq
        if sl is None:
            try:
                sl = self._allocate(need)
            except OSError as exc:
                reason = (
                    "no space left in /dev/shm" if exc.errno == errno.ENOSPC else f"cannot allocate: {exc}"
                )
                return f"{reason} (needed {need} bytes)"
            except (ValueError, ConnectorError) as exc:
                return f"cannot allocate: {exc}"
        sl.word.store(slot.stamp(slot.WRITING, seq))
        return sl, seq

    def _publish(
        self, sl: _Slot, seq: int, to: tuple[int, int], key: str, key_bytes: bytes, *, announced: bool
    ) -> PutResult:
        """Publish the written slot, announce it (again, if a reader that had its early
        notice gave up waiting: the stamp reads WAITING), link the key's name; book it."""
        # From the notice on, a reader may consume the object and a reap (ours below, or
        # the in-process reader's take_back) recycle the slot: read what the result
        # reports now.
        nbytes = sl.payload_len
        # Release order: the bytes written before are visible to whoever sees PUBLISHED.
        if not announced or not sl.word.cas(slot.stamp(slot.WRITING, seq), slot.stamp(slot.PUBLISHED, seq)):
            sl.word.store(slot.stamp(slot.PUBLISHED, seq))
            # The notice goes out before the key's name exists: the receiver wakes while we link.
            self._outbox.announce_slot(to[0], seq, sl.notice_head, sl.size, key_bytes, to[1])
        khash = names.key_hash_bytes(key_bytes)
        try:
            os.link(sl.path, self._kprefix + khash)
            sl.khash = khash
        except OSError as exc:
            # Retract unless a reader already took it through the notice (then it is delivered).
            if self._claim_own(sl, seq):
                sl.word.store(slot.stamp(slot.FREE, seq))
                self._release(sl)
                if isinstance(exc, FileExistsError):
                    return self._failed(
                        f"key {key!r} is already published by another producer (a consumed object's "
                        "name is released by its producer's next reap)"
                    )
                return self._failed(f"cannot publish {key!r}: {exc}")
        with self._lock:
            self._busy.discard(sl)
            closed = self.is_closed
            if not closed:
                self._pending[key] = sl
                self.num_puts += 1
                self.bytes_put += nbytes
        if closed:
            return self._end_put_after_close(sl, key, seq, nbytes)
        self.reap()  # after the notice: off the consumer's critical path
        return PutResult(ok=True, nbytes=nbytes, handle=f"{names.PREFIX}{self._namespace}-k-{khash}")

    def _end_put_after_close(self, sl: _Slot, key: str, seq: int, nbytes: int) -> PutResult:
        """``close`` ran while this put was in flight. It released what its tables held,
        and this object was in none of them, so the put releases it itself: no name and no
        file is left. Withdrawn if no reader has claimed it (a failed put), delivered
        otherwise (the reader keeps its mapping until it is done)."""
        if sl.khash is not None:
            _unlink_quiet(self._kprefix + sl.khash)
        if sl.word.cas(slot.stamp(slot.PUBLISHED, seq), slot.stamp(slot.CLAIMED, seq)):
            self._retire(sl)
            return self._failed("the connector was closed during the put; the object was withdrawn")
        self._retire(sl, mark=False)  # a reader claimed it first: it was delivered
        return PutResult(ok=True, nbytes=nbytes)

    def _withdraw(self, sl: _Slot, seq: int) -> None:
        """Give back a slot taken for publish ``seq`` that will not be published: its stamp
        ends FREE(seq), so a reader holding its early notice stops waiting, and it is
        pooled again."""
        sl.word.store(slot.stamp(slot.FREE, seq))
        sl.seq = seq
        self._release(sl)

    def _failed(self, reason: str) -> PutResult:
        with self._lock:
            self.num_put_failures += 1
        self._on_error(reason)
        return PutResult(ok=False, error=reason)

    # ------------------------------------------------------------------ the pool
    def _take_free_locked(self, need: int) -> _Slot | None:
        """The smallest pooled slot that fits ``need`` without wasting much (lock held)."""
        most = max(4 * need, need + 2 * _MiB, _MIN_SLOT)
        best: _Slot | None = None
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
            name = names.slot_name(self._namespace, self._owner, f"{self._instance}.{self._slot_seq}")
        size = _slot_size(need)
        path = os.path.join(self._dir, name)
        mm = self._allocator(path, size)
        try:
            word = atomics.Word(mm, slot.STAMP_OFFSET, self._atomic_ops)
            claim_word = atomics.Word(mm, slot.CLAIM_SEQ_OFFSET, self._atomic_ops)
        except BaseException:
            mm.close()
            _unlink_quiet(path)
            raise
        sl = _Slot(name, path, size, mm, word, claim_word, notice_head=name.encode())
        with self._lock:
            self._busy.add(sl)
        return sl

    def _unpend_locked(self, key: str, sl: _Slot) -> None:
        """Forget ``key``'s object (the caller holds the lock) and remove its name in the
        same critical section. A put of the key on another thread (another send lane)
        then finds the object either still pending — and reclaims it itself — or gone
        together with its name; never gone from ``pending`` with the name still linked,
        where its ``link`` would fail as if another producer held the key."""
        del self._pending[key]
        self._unlink_name(sl)

    def _unlink_name(self, sl: _Slot) -> None:
        if sl.khash is not None:
            _unlink_quiet(self._kprefix + sl.khash)
            sl.khash = None

    def _reclaim(self, sl: _Slot) -> None:
        """A consumed (FREE) or retracted slot of ours: remove the key's name, then pool it.
        Only its producer removes a published object's name, so the name is still ours."""
        self._unlink_name(sl)
        self._release(sl)

    def _drop_blocks(self, keys: list[str] | None) -> None:
        if keys and self._device is not None:
            self._device.release(keys)

    def _release(self, sl: _Slot) -> None:
        """Return a slot to the free pool, or retire it if the pool is full or closed."""
        if sl.device_keys is not None:
            keys, sl.device_keys = sl.device_keys, None
            self._drop_blocks(keys)
        sl.khash = None
        sl.payload_len = 0
        with self._lock:
            if sl.pooled:
                return  # Invariant: a slot is pooled once; never hand it to two puts
            self._busy.discard(sl)
            keep = (
                not self.is_closed
                and len(self._free) < self._pool_max_slots
                and sum(s.size for s in self._free) + sl.size <= self._pool_max_bytes
            )
            if keep:
                sl.pooled = True
                self._free.append(sl)
        if not keep:
            self._retire(sl)

    def _retire(self, sl: _Slot, *, mark: bool = True) -> None:
        if sl.device_keys is not None:
            keys, sl.device_keys = sl.device_keys, None
            self._drop_blocks(keys)
        if mark:
            try:
                sl.word.store(slot.stamp(slot.RETIRED, sl.seq))
            except (ValueError, TypeError):
                pass  # already released
        # The mapping is not closed here: the atomic word and the view export it, and a
        # thread may still hold them. It is unmapped when the last reference goes (the
        # slot is in no table any more), so no access can ever touch unmapped memory.
        _unlink_quiet(sl.path)

    def _claim_own(self, sl: _Slot, seq: int) -> bool:
        """Claim our own publish ``seq`` the way a reader would (so a reader that won keeps
        its object); True if we won."""
        if not sl.word.cas(slot.stamp(slot.PUBLISHED, seq), slot.stamp(slot.CLAIMED, seq)):
            return False
        slot.record_claim(sl.mm, sl.claim_word, self._owner.pid, self._owner.start, seq)
        return True

    # ------------------------------------------------------------------ books
    def reap(self) -> int:
        """One bounded rotating pass over pending keys (docs/protocol.md §3.5), syscall-free: a consumed
        object's slot reads FREE in our own mapping."""
        self._outbox.flush_overflow()
        reclaimed: list[_Slot] = []
        orphaned: list[_Slot] = []
        with self._lock:
            for _ in range(min(REAP_BATCH, len(self._pending))):
                key, sl = self._pending.popitem(last=False)
                word = sl.word.load()
                if word == slot.stamp(slot.FREE, sl.seq):
                    reclaimed.append(sl)
                elif word == slot.stamp(slot.CLAIMED, sl.seq) and _claim_abandoned(sl):
                    orphaned.append(sl)  # the consumer died mid-read
                else:
                    self._pending[key] = sl
                    continue
                self._unlink_name(sl)  # see _unpend_locked
            self.num_reaped += len(reclaimed) + len(orphaned)
        for sl in orphaned:
            sl.word.store(slot.stamp(slot.FREE, sl.seq))  # the dead claimer's claim ends here
            reclaimed.append(sl)
        for sl in reclaimed:
            sl.unrecorded_since = None
            self._release(sl)
        return len(reclaimed)

    def take_back(self, key: str) -> None:
        """A reader of this process consumed ``key``: if we published it, reclaim it now."""
        if not self._pending:
            return
        with self._lock:
            sl = self._pending.get(key)
            if sl is None or sl.word.load() != slot.stamp(slot.FREE, sl.seq):
                return
            self._unpend_locked(key, sl)
            self.num_reaped += 1
        self._release(sl)

    def cleanup(self, key: str) -> bool:
        """Retract ``key`` if we published it and nobody claimed it yet.

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
        if not self._claim_own(sl, seq):
            return False  # a reader claimed it first: it frees the slot, reap picks it up
        with self._lock:
            if self._pending.get(key) is sl:
                self._unpend_locked(key, sl)
            self.num_cleaned += 1
        sl.word.store(slot.stamp(slot.FREE, seq))
        self._reclaim(sl)
        return True

    def cleanup_prefix(self, prefix: str) -> int:
        with self._lock:
            keys = [k for k in self._pending if is_prefix_match(k, prefix)]
        return sum(1 for k in keys if self.cleanup(k))

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def books(self) -> dict[str, int]:
        """Counters and pool figures for ``health`` (one consistent snapshot)."""
        with self._lock:
            slots = [*self._free, *self._pending.values(), *self._busy]
            return {
                "num_puts": self.num_puts,
                "num_put_failures": self.num_put_failures,
                "bytes_put": self.bytes_put,
                "num_reaped": self.num_reaped,
                "num_cleaned": self.num_cleaned,
                "num_pending_keys": len(self._pending),
                "num_live_objects": len(self._pending),
                "live_bytes": sum(s.payload_len for s in self._pending.values()),
                "pool_slots": len(slots),
                "pool_bytes": sum(s.size for s in slots),
                **(self._device.stats() if self._device is not None else {}),
            }

    def close(self) -> None:
        """Release every slot: names removed, files unlinked. A reader mid-copy keeps its
        mapping (and its claim); a put in flight releases its own slot."""
        with self._lock:
            if self.is_closed:
                return
            self.is_closed = True
            pending = list(self._pending.values())
            self._pending.clear()
            free, self._free = self._free, []
        if self._device is not None:
            self._device.close()  # first: a reader copying a block it claimed keeps it
        for sl in pending:
            if sl.khash is not None:
                _unlink_quiet(self._kprefix + sl.khash)
            claimed = sl.word.load() & 0xFF == slot.CLAIMED
            self._retire(sl, mark=not claimed)
        for sl in free:
            self._retire(sl)


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


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

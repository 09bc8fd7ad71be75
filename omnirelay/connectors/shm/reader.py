"""The reading side of the shm connector: find an object, claim it, copy it out.

A get finds the object one of two ways:

* through its key's *hint* — the newest arrival notice named the slot and the publish
  (``notices.Inbox.hints``). A slot mapped before (producers pool their slots, readers
  cache mappings) is claimed with no system call and no lock;
* through the key's *name* (no notice, a stale one, or a slot gone since): open, map or
  find the cached mapping, read the header, claim.

A claim is one compare-and-swap of the slot's stamp (``Mapping.claim``: ``slot.claim``'s
steps, one C call where the extension is in use): exactly one reader wins. The winner
decodes the payload straight out of the mapping (one copy) and marks the slot FREE; its
producer's reap then removes the name and pools the slot.

A small object is announced before it is written (``producer``): a reader that finds its
slot still WRITING for the notice's publish waits up to ``_PUBLISH_WAIT_NS`` for it, then
marks it WAITING and lets its producer announce it again (``slot`` says why no wake-up is
lost).

A get announced by a notice decodes with its slot's ``OutputStock`` (``codec``): the
tensors of the header the slot carried last, made while the reader was idle (waiting for
the publish, or about to sleep in :meth:`Reader.restock`), so a chunk whose header repeats
is copied into them with no allocation on the critical path (docs/performance.md,
output stocks).

A get that follows a *small* notice (``Arrivals.small``) stays bounded: it copies at most
``SMALL_OBJECT_BYTES``. A larger object met by name is left where it is and announced
again, not small, so the receiver fetches it like any large object.

On a GPU-direct edge (docs/protocol.md §3.9) the object's device tensors are copied out of
their producer's device pool by ``device`` (a ``DeviceReceiver``'s take) during the
decode, inside the claim: the slot is set FREE only after the copy, so the producer
releases a block only once its reader is done with it, and a reference it cannot serve
(stale, forged) is a FAILED get like any corrupt payload.

A key's name that leads to something that is not a valid object of that key is a FAILED
get, and the name is removed — claimed with a rename first, and given back if it turns
out to name another inode by then, so a reader never removes a name it did not judge.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable

from omnirelay.connectors.base import MAX_KEY_BYTES, SMALL_OBJECT_BYTES, GetResult, GetStatus
from omnirelay.connectors.shm import names, notices, slot
from omnirelay.connectors.shm.mappings import Mapping, MappingCache
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

__all__ = ["Reader"]

#: How long a reader that finds an announced object still being written waits for it
#: before it goes back to sleep (the producer then announces the object again).
_PUBLISH_WAIT_NS = 50_000
#: Output stocks kept (one per slot a notice named; all are dropped when full) and
#: refilled per idle wait at most.
_MAX_STOCKS = 64
_RESTOCK_PER_IDLE = 8


class Reader:
    """Gets of one connector (any thread). ``on_consumed(key)`` is told of every object
    this reader consumed (its producer may be in this process); ``on_error(reason)`` of
    every failed get."""

    def __init__(
        self,
        *,
        namespace: str,
        shm_dir: str,
        maps: MappingCache,
        inbox: notices.Inbox,
        outbox: notices.Outbox,
        on_consumed: Callable[[str], None],
        on_error: Callable[[str], None],
        device: codec.DeviceTaker | None = None,
        replica: int = 0,
    ) -> None:
        self._namespace = namespace
        self._replica = replica  # this reader's own replica: where its re-announcements go
        self._device = device
        self._dir = shm_dir
        self._kprefix = os.path.join(shm_dir, f"{names.PREFIX}{namespace}-k-")
        self._owner = names.self_owner()
        self._maps = maps
        self._hints = inbox.hints
        self._outbox = outbox
        self._on_consumed = on_consumed
        self._on_error = on_error
        self._rename_seq = itertools.count(1)
        self._stocks: dict[bytes, codec.OutputStock] = {}  # slot name -> its stream's stock
        self._to_restock: dict[codec.OutputStock, None] = {}  # decoded since the last idle wait
        self._lock = threading.Lock()  # the counters
        self.num_gets = 0
        self.num_get_failures = 0
        self.bytes_got = 0
        self.is_closed = False

    def get(self, to_stage: int, key: str) -> GetResult:
        # The hot path of every chunk, on a thread just woken: the steps are written out
        # here rather than spread over helpers (each Python call costs most on a cold CPU).
        key_bytes = key.encode("utf-8", "surrogatepass") if type(key) is str else b""
        if not key_bytes or len(key_bytes) > MAX_KEY_BYTES:
            try:
                key_bytes = names.key_bytes(key)  # raises with the reason
            except OmniRelayError as exc:
                return self._failed(str(exc))
        if self.is_closed:
            return self._failed("connector is closed")
        hint = self._hints.pop(key, None) if self._hints else None  # one dict op: GIL-atomic
        if hint is None:
            return self._get_by_name(key, key_bytes)
        name, seq, is_small = hint
        # A mapping cached before is used without a lock: the reference keeps it alive.
        mp = self._maps.by_name.get(name)
        pinned = mp is None or mp.retired
        if pinned:
            mp = self._maps.pin_by_slot_name(name)  # pinned until unpin (None: unusable hint)
        if mp is not None:
            stock = self._stocks.get(name)
            if stock is None:
                if len(self._stocks) >= _MAX_STOCKS:
                    self._stocks.clear()  # slots retired long ago; live ones come back
                stock = self._stocks[name] = codec.OutputStock()
            try:
                if is_small and mp.size > SMALL_OBJECT_BYTES:
                    res = None  # not what a small notice may name: look it up by name
                else:
                    res = self._claim(mp, key, key_bytes, seq, stock)
                    if res is None:
                        res = self._await_publish(mp, key, key_bytes, seq, stock)
            finally:
                if pinned:
                    self._maps.unpin(mp)
            if res is not None:
                return res
        # Bounded also when what a small notice announced is gone and the name is looked up.
        return self._get_by_name(key, key_bytes, to_stage=to_stage if is_small else None)

    def _await_publish(
        self, mp: Mapping, key: str, key_bytes: bytes, seq: int, stock: codec.OutputStock
    ) -> GetResult | None:
        """The claim of publish ``seq`` failed; if its notice came before the object was
        written (small objects are announced early), wait up to ``_PUBLISH_WAIT_NS`` for
        the publish and claim it. If it does not come, mark the slot WAITING, so its
        producer announces it again once published, and report NOT_YET. None: there is
        nothing of this publish to wait for (look the key up by name)."""
        base = seq << 8  # slot.stamp(state, seq) is base | state
        writing, waiting, published = base | slot.WRITING, base | slot.WAITING, base | slot.PUBLISHED
        deadline = 0
        word = mp.word.load()
        while True:
            if word == published:  # published since the failed claim: claim it now
                return self._claim(mp, key, key_bytes, seq, stock)
            if word == waiting:
                return GetResult(GetStatus.NOT_YET)  # the producer announces it again
            if word != writing:
                return None  # consumed, withdrawn or recycled: the key's name tells
            if not deadline:
                stock.refill()  # idle until the publish: not counted as waiting
                deadline = time.perf_counter_ns() + _PUBLISH_WAIT_NS
            elif time.perf_counter_ns() > deadline:
                if mp.word.cas(writing, waiting):
                    return GetResult(GetStatus.NOT_YET)  # the producer announces it again
            else:
                os.sched_yield()  # a producer sharing this CPU gets to finish
            word = mp.word.load()

    def _get_by_name(self, key: str, key_bytes: bytes, *, to_stage: int | None = None) -> GetResult:
        """Find the object through the key's name.

        ``to_stage`` set: the get of a small notice, bounded by SMALL_OBJECT_BYTES. A larger
        object is left in place and announced again to ``to_stage`` (ourselves) by a notice
        that is not small, so the receiver gets it the way it gets any large object.
        """
        path = self._kprefix + names.key_hash_bytes(key_bytes)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return GetResult(GetStatus.NOT_YET)
        except OSError as exc:
            return self._failed(f"cannot open {key!r}: {exc}")
        try:
            st = os.fstat(fd)
            if to_stage is not None and st.st_size > SMALL_OBJECT_BYTES:
                os.close(fd)
                self._outbox.announce_by_name(to_stage, key_bytes, self._replica)
                return GetResult(GetStatus.NOT_YET)
            mp = self._maps.pin_cached(st)
            if mp is None:
                mp = self._maps.map(fd, st, None)
        except (OSError, ValueError, ConnectorError) as exc:
            os.close(fd)
            self._remove_name_if(path, None)
            return self._failed(f"corrupt object for key {key!r}: cannot map it: {exc}")
        os.close(fd)
        try:
            hdr = slot.read_header(mp.mm, mp.size)
            if isinstance(hdr, str):
                self._maps.retire(mp)
                self._remove_name_if(path, st.st_ino)
                return self._failed(f"corrupt object for key {key!r}: {hdr}")
            if hdr.key != key_bytes:
                # The name may have been reaped and the slot recycled for another key since we
                # opened it (consumed objects keep their name until their producer's reap):
                # then the object we looked for is gone, which is not a corruption.
                if not _names_inode(path, st.st_ino):
                    return GetResult(GetStatus.NOT_YET)
                self._remove_name_if(path, st.st_ino)
                return self._failed(f"corrupt object for key {key!r}: header names a different key")
            if hdr.state != slot.PUBLISHED:
                return GetResult(GetStatus.NOT_YET)  # another reader holds it (or it is going away)
            res = self._claim(mp, key, key_bytes, hdr.seq, None)
            return res if res is not None else GetResult(GetStatus.NOT_YET)
        finally:
            self._maps.unpin(mp)

    def _claim(
        self, mp: Mapping, key: str, key_bytes: bytes, seq: int, stock: codec.OutputStock | None
    ) -> GetResult | None:
        """Claim publish ``seq`` of the mapped slot and consume it; None if it is not there
        (claimed by another reader, already recycled, or a notice that named the wrong slot).
        ``stock``: the slot's output stock (a get through the key's name has none)."""
        span = mp.claim(seq, key_bytes, self._owner.pid, self._owner.start)
        if span is None:
            return None
        off, nbytes = span
        try:
            obj = codec.decode(mp.view[off : off + nbytes], copy=True, stock=stock, device=self._device)
            if stock is not None and stock.can_refill and len(self._to_restock) < _MAX_STOCKS:
                self._to_restock[stock] = None
        except OmniRelayError as exc:
            return self._failed(f"corrupt payload for key {key!r}: {exc}")
        finally:
            mp.word.store(slot.stamp(slot.FREE, seq))  # Invariant: written after the last read.
        with self._lock:
            self.num_gets += 1
            self.bytes_got += nbytes
        self._on_consumed(key)
        return GetResult(GetStatus.READY, obj=obj, nbytes=nbytes)

    def restock(self) -> None:
        """About to sleep: refill the output stocks of the streams that decoded since (a
        few). Idle work, so the GIL goes first to any thread waiting for it (a scheduler
        woken by the chunk just handed over)."""
        if not self._to_restock:
            return
        os.sched_yield()
        for _ in range(_RESTOCK_PER_IDLE):
            try:
                stock = self._to_restock.popitem()[0]
            except KeyError:
                return
            stock.refill()

    def _remove_name_if(self, path: str, ino: int | None) -> None:
        """Remove a bad object's name, but only if it still names inode ``ino`` (claim it
        with a rename, compare, then drop or give back). ``ino`` None: any non-slot file."""
        claim = os.path.join(
            self._dir,
            names.claim_name(
                self._namespace, self._owner, os.path.basename(path)[-40:], next(self._rename_seq)
            ),
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
            try:
                os.unlink(claim)
            except FileNotFoundError:
                pass

    def _failed(self, reason: str) -> GetResult:
        with self._lock:
            self.num_get_failures += 1
        self._on_error(reason)
        return GetResult(GetStatus.FAILED, error=reason)


def _names_inode(path: str, ino: int) -> bool:
    """Whether ``path`` still names inode ``ino``."""
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False

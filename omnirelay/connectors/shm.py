"""``shm``: the default connector, across processes on one Linux host.

Beyond the reference (DESIGN.md §7):

* **Atomic publish, exclusive consume, no lock files.** The producer writes an object
  into a private slot file, then publishes it with one ``link()`` to the key's name —
  readers never see a partial object, and an unread object with the same key is never
  clobbered (``link`` fails with EEXIST). A reader claims with one ``rename()`` of the
  key's name to a private claim name: exactly one reader wins.
* **Fixed-length names.** Keys are hashed (``names.key_name``); the key itself lives in
  the slot header, so audits can recover it. Every name starts ``omnirelay-<namespace>``.
* **Reuse.** Slots are pooled, pre-faulted and stay mapped in the producer; consumers
  cache their mappings of recently seen slots. A put is one encode straight into shared
  memory; a get is one copy out (into huge-page backed memory via numpy).
* **Arrival notices.** After a put, a datagram naming the key goes to the target stage's
  abstract UNIX socket; ``wait_arrivals`` blocks on it. Waiting costs nothing per request.
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

from omnirelay.connectors import names, slot
from omnirelay.connectors.base import (
    REAP_BATCH,
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
from omnirelay.errors import ConnectorError, OmniRelayError
from omnirelay.payload import codec

__all__ = ["ShmConnector", "ShmOptions", "default_allocator", "notice_address"]

_MIN_SLOT = 16 << 10
_INSTANCES = itertools.count(1)
#: An empty datagram: "notices were lost, poll everything you wait for" (keys are never empty).
_OVERFLOW_MARKER = b""
_MiB = 1 << 20


def notice_address(namespace: str, stage: int) -> bytes:
    """Abstract-namespace socket address of a stage's arrival notices (nothing on disk)."""
    return f"\0{names.PREFIX}{namespace}-n-{stage}".encode()


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
    ino: int = 0
    payload_len: int = 0
    key: str | None = None
    published_name: str | None = None


@dataclass(eq=False)
class _Mapping:
    mm: mmap.mmap
    size: int
    users: int = 0
    retired: bool = False


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
        **options: Any,
    ) -> None:
        self.namespace = validate_namespace(namespace)
        self.stage_id = stage_id
        try:
            self.options = ShmOptions(**options)
        except TypeError as exc:
            raise ConnectorError(f"unknown shm connector option: {exc}") from exc
        self._dir = self.options.shm_dir
        self._kprefix = os.path.join(self._dir, f"{names.PREFIX}{self.namespace}-k-")
        self._notice_addrs: dict[int, bytes] = {}
        self._allocator = allocator
        self._owner = names.self_owner()
        self._instance = next(_INSTANCES)  # several connectors of one namespace in one process
        self._overflow: set[int] = set()  # stages whose notice queue overflowed; marker owed
        self._lock = threading.Lock()  # producer books: pending, free pool, counters
        self._pending: OrderedDict[str, _Slot] = OrderedDict()
        self._free: list[_Slot] = []
        self._busy: set[_Slot] = set()  # acquired for a put in progress
        self._slot_seq = 0
        self._publish_seq = 0
        self._claim_seq = 0
        self._c = _Counters()
        self._map_lock = threading.Lock()  # consumer mapping cache
        self._maps: OrderedDict[tuple[int, int], _Mapping] = OrderedDict()
        self._map_bytes = 0
        self._map_misses = 0
        self._closed = False
        self._send_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._send_sock.setblocking(False)
        self._listen: dict[int, socket.socket] = {}
        self._listen_lock = threading.Lock()
        if self.options.sweep_on_start:
            from omnirelay.connectors.sweep import sweep

            sweep(namespace=self.namespace, reclaim=True, shm_dir=self._dir)
        if self.options.listen and stage_id is not None:
            try:
                self._bind(stage_id)
            except ConnectorError:
                pass  # another connector of this namespace listens for the stage

    # ------------------------------------------------------------------ producer side
    def put(self, from_stage: int, to_stage: int, key: str, obj: Any) -> PutResult:
        try:
            validate_key(key)
            if self._closed:
                raise ConnectorError("connector is closed")
            self.reap_consumed()
            plan = codec.plan_encode(obj)
        except OmniRelayError as exc:
            return self._put_failed(key, str(exc))
        key_bytes = key.encode("utf-8", "surrogatepass")
        with self._lock:
            stale = self._pending.get(key)
            if stale is not None and slot.read_state(stale.mm) == slot.FREE:
                del self._pending[key]  # consumed, not reaped yet: the key is free again
            elif stale is not None:
                self._c.num_put_failures += 1
                return PutResult(ok=False, error=f"key {key!r} is already published and not yet consumed")
            else:
                stale = None
        if stale is not None:
            self._release(stale)
        need = slot.payload_offset(len(key_bytes)) + plan.nbytes
        try:
            sl = self._acquire(need)
        except OSError as exc:
            reason = "no space left in /dev/shm" if exc.errno == errno.ENOSPC else f"cannot allocate: {exc}"
            return self._put_failed(key, f"{reason} (needed {need} bytes)")
        khash = names.key_hash(key)
        published = f"{names.PREFIX}{self.namespace}-k-{khash}"
        try:
            self._publish_seq += 1
            slot.write_publish_header(
                sl.mm,
                key=key_bytes,
                payload_len=plan.nbytes,
                seq=self._publish_seq,
                owner_pid=self._owner.pid,
                owner_start=self._owner.start,
                created_ns=time.time_ns(),
                from_stage=from_stage,
                to_stage=to_stage,
            )
            off = slot.payload_offset(len(key_bytes))
            with memoryview(sl.mm) as mv:
                plan.write_into(mv[off : off + plan.nbytes])
            slot.write_state(sl.mm, slot.PUBLISHED)
            os.link(sl.path, self._kprefix + khash)
        except BaseException as exc:
            slot.write_state(sl.mm, slot.FREE)
            self._release(sl)
            if not isinstance(exc, Exception):
                raise
            if isinstance(exc, FileExistsError):
                return self._put_failed(
                    key, f"key {key!r} is already published (by this or another producer)"
                )
            return self._put_failed(key, f"{type(exc).__name__}: {exc}")
        sl.key, sl.payload_len, sl.published_name = key, plan.nbytes, published
        with self._lock:
            self._busy.discard(sl)
            self._pending[key] = sl
            self._c.num_puts += 1
            self._c.bytes_put += plan.nbytes
        self._notify(to_stage, key_bytes)
        return PutResult(ok=True, nbytes=plan.nbytes, handle=published)

    def _put_failed(self, key: object, reason: str) -> PutResult:
        with self._lock:
            self._c.num_put_failures += 1
            self._c.last_error = reason
        return PutResult(ok=False, error=reason)

    def _acquire(self, need: int) -> _Slot:
        with self._lock:
            best = None
            for sl in self._free:
                fits = need <= sl.size <= max(4 * need, need + 2 * _MiB, _MIN_SLOT)
                if fits and (best is None or sl.size < best.size):
                    best = sl
            if best is not None:
                self._free.remove(best)
                self._busy.add(best)
                return best
            self._slot_seq += 1
            name = names.slot_name(self.namespace, self._owner, f"{self._instance}.{self._slot_seq}")
        size = _slot_size(need)
        path = os.path.join(self._dir, name)
        mm = self._allocator(path, size)
        try:
            ino = os.stat(path).st_ino
        except OSError:
            mm.close()
            _unlink_quiet(path)
            raise
        sl = _Slot(name=name, path=path, size=size, mm=mm, ino=ino)
        with self._lock:
            self._busy.add(sl)
        return sl

    def _release(self, sl: _Slot) -> None:
        """Return a slot to the free pool, or retire it if the pool is full or closed."""
        sl.key = sl.published_name = None
        sl.payload_len = 0
        with self._lock:
            self._busy.discard(sl)
            pool_bytes = sum(s.size for s in self._free)
            keep = (
                not self._closed
                and len(self._free) < self.options.pool_max_slots
                and pool_bytes + sl.size <= self.options.pool_max_bytes
            )
            if keep:
                self._free.append(sl)
        if not keep:
            self._retire(sl)

    def _retire(self, sl: _Slot) -> None:
        try:
            slot.write_state(sl.mm, slot.RETIRED)
        except ValueError:
            pass  # already closed
        try:
            os.unlink(sl.path)
        except FileNotFoundError:
            pass
        try:
            sl.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it

    def _notify(self, to_stage: int, key_bytes: bytes) -> None:
        """Announce a key to the target stage. A full receiver queue (Linux queues only
        ``net.unix.max_dgram_qlen`` datagrams, 10 by default) is remembered, and an overflow
        marker is sent as soon as there is room, so the receiver polls everything once."""
        addr = self._notice_addrs.get(to_stage)
        if addr is None:
            addr = self._notice_addrs[to_stage] = notice_address(self.namespace, to_stage)
        if to_stage in self._overflow:
            self._send_overflow_marker(to_stage)
        try:
            self._send_sock.sendto(key_bytes, addr)
            sent = True
        except BlockingIOError:
            sent = False
            with self._lock:
                self._overflow.add(to_stage)
        except OSError:
            sent = False  # nobody listens yet: a new receiver polls on registration
        with self._lock:
            if sent:
                self._c.num_notices_sent += 1
            else:
                self._c.num_notices_lost += 1

    def _send_overflow_marker(self, to_stage: int) -> None:
        addr = self._notice_addrs.get(to_stage) or notice_address(self.namespace, to_stage)
        try:
            self._send_sock.sendto(_OVERFLOW_MARKER, addr)
        except BlockingIOError:
            return  # still full: try again on the next put or reap
        except OSError:
            pass  # the receiver is gone; nothing to tell
        with self._lock:
            self._overflow.discard(to_stage)

    def reap_consumed(self) -> int:
        """One bounded rotating pass over pending keys (SPEC §3.5), syscall-free: a consumed
        object's slot reads FREE in our own mapping."""
        for stage in list(self._overflow):
            self._send_overflow_marker(stage)
        reclaimed: list[_Slot] = []
        with self._lock:
            for _ in range(min(REAP_BATCH, len(self._pending))):
                key, sl = self._pending.popitem(last=False)
                state = slot.read_state(sl.mm)
                if state == slot.FREE:
                    reclaimed.append(sl)
                elif state == slot.CLAIMED and not self._claimer_alive(sl):
                    reclaimed.append(sl)  # the consumer died mid-read: the name is gone already
                else:
                    self._pending[key] = sl
            self._c.num_reaped += len(reclaimed)
        for sl in reclaimed:
            slot.write_state(sl.mm, slot.FREE)
            self._release(sl)
        return len(reclaimed)

    @staticmethod
    def _claimer_alive(sl: _Slot) -> bool:
        hdr = slot.read_header(sl.mm, sl.size)
        if isinstance(hdr, str):
            return False
        return names.owner_alive(names.OwnerId(hdr.claimer_pid, hdr.claimer_start))

    def cleanup(self, key: str) -> bool:
        """Retract ``key`` if this connector published it and nobody claimed it yet.

        Claims the key's name exactly like a reader does (one ``rename`` to a private
        name), then finds the slot by inode — so a slot recycled for another key in the
        meantime is never touched, and a reader that won the name keeps its object.
        Idempotent; returns True if an object was removed.
        """
        with self._lock:
            if key not in self._pending:
                return False
            self._claim_seq += 1
            seq = self._claim_seq
        khash = names.key_hash(key)
        claim = os.path.join(self._dir, names.claim_name(self.namespace, self._owner, khash, seq))
        try:
            os.rename(self._kprefix + khash, claim)
        except FileNotFoundError:
            return False  # a reader claimed it first: it frees the slot, reap picks it up
        try:
            ino = os.stat(claim).st_ino
            with self._lock:
                sl = self._pending.get(key)
                if sl is None or sl.ino != ino:
                    sl = None  # not our object under this name: give the name back
                else:
                    del self._pending[key]
                    self._c.num_cleaned += 1
            if sl is None:
                try:
                    os.link(claim, self._kprefix + khash)
                except FileExistsError:
                    pass
                return False
        finally:
            _unlink_quiet(claim)
        slot.write_state(sl.mm, slot.FREE)
        self._release(sl)
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
        try:
            validate_key(key)
        except OmniRelayError as exc:
            return self._get_failed(str(exc))
        if self._closed:
            return self._get_failed("connector is closed")
        khash = names.key_hash(key)
        published = self._kprefix + khash
        with self._lock:
            self._claim_seq += 1
            seq = self._claim_seq
        claim = os.path.join(self._dir, names.claim_name(self.namespace, self._owner, khash, seq))
        try:
            os.rename(published, claim)  # Invariant: exactly one reader wins this rename.
        except FileNotFoundError:
            return GetResult(GetStatus.NOT_YET)
        except OSError as exc:
            return self._get_failed(f"cannot claim {key!r}: {exc}")
        try:
            st = os.stat(claim)
            mp = self._cached_map(st)
            if mp is None:
                fd = os.open(claim, os.O_RDWR)
                try:
                    mp = self._map(fd, st)
                finally:
                    os.close(fd)
        except (OSError, ValueError) as exc:
            return self._get_failed(f"claimed {key!r} but cannot map it: {exc}")
        finally:
            _unlink_quiet(claim)
        try:
            return self._consume(mp, key)
        finally:
            self._unmap(mp)

    def _consume(self, mp: _Mapping, key: str) -> GetResult:
        hdr = slot.read_header(mp.mm, mp.size)
        if isinstance(hdr, str):
            return self._get_failed(f"corrupt object for key {key!r}: {hdr}")
        valid = True
        try:
            if hdr.state != slot.PUBLISHED:
                valid = False
                return self._get_failed(f"corrupt object for key {key!r}: slot state is {hdr.state}")
            if hdr.key != key.encode("utf-8", "surrogatepass"):
                return self._get_failed(f"corrupt object for key {key!r}: header names a different key")
            slot.write_claim(mp.mm, self._owner.pid, self._owner.start)
            off = hdr.payload_off
            with memoryview(mp.mm) as mv:
                try:
                    obj = codec.decode(mv[off : off + hdr.payload_len], copy=True)
                except OmniRelayError as exc:
                    return self._get_failed(f"corrupt payload for key {key!r}: {exc}")
        finally:
            if valid:
                slot.write_state(mp.mm, slot.FREE)  # Invariant: written after the last read.
        with self._lock:
            self._c.num_gets += 1
            self._c.bytes_got += hdr.payload_len
            # An in-process consumer of our own object: drop it from pending right away.
            sl = self._pending.get(key)
            if sl is not None and slot.read_state(sl.mm) == slot.FREE:
                del self._pending[key]
                self._c.num_reaped += 1
            else:
                sl = None
        if sl is not None:
            self._release(sl)
        return GetResult(GetStatus.READY, obj=obj, nbytes=hdr.payload_len)

    def _get_failed(self, reason: str) -> GetResult:
        with self._lock:
            self._c.num_get_failures += 1
            self._c.last_error = reason
        return GetResult(GetStatus.FAILED, error=reason)

    def _cached_map(self, st: os.stat_result) -> _Mapping | None:
        """A pinned cached mapping of the file ``st`` describes, or None. The cache holds
        the mapping, so the inode (and its number) cannot be reused while cached."""
        with self._map_lock:
            mp = self._maps.get((st.st_dev, st.st_ino))
            if mp is None or mp.size != st.st_size or mp.retired:
                return None
            self._maps.move_to_end((st.st_dev, st.st_ino))
            mp.users += 1
            return mp

    def _map(self, fd: int, st: os.stat_result) -> _Mapping:
        ident = (st.st_dev, st.st_ino)
        size = st.st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        mp = _Mapping(mm=mm, size=size, users=1)
        evict: list[_Mapping] = []
        with self._map_lock:
            old = self._maps.pop(ident, None)
            if old is not None:
                self._map_bytes -= old.size
                old.retired = True
                if old.users == 0:
                    evict.append(old)
            if self.options.map_cache_entries and size <= self.options.map_cache_bytes:
                self._maps[ident] = mp
                self._map_bytes += size
                evict.extend(self._trim_maps_locked())
            else:
                mp.retired = True  # not cached: closed after this get
        for old_mp in evict:
            _close_map(old_mp.mm)
        return mp

    def _trim_maps_locked(self) -> list[_Mapping]:
        """Evict least recently used mappings over the budget; every 64 misses also drop
        mappings of slots their producer retired (their memory is freed with them)."""
        out: list[_Mapping] = []
        self._map_misses += 1
        scan_retired = self._map_misses % 64 == 0
        for ident, mp in list(self._maps.items()):
            over = (
                len(self._maps) > self.options.map_cache_entries
                or self._map_bytes > self.options.map_cache_bytes
            )
            if not over and not scan_retired:
                break
            if not over and slot.read_state(mp.mm) != slot.RETIRED:
                continue
            del self._maps[ident]
            self._map_bytes -= mp.size
            mp.retired = True
            if mp.users == 0:
                out.append(mp)
        return out

    def _unmap(self, mp: _Mapping) -> None:
        with self._map_lock:
            mp.users -= 1
            close = mp.retired and mp.users == 0
        if close:
            _close_map(mp.mm)

    # ------------------------------------------------------------------ notices
    def _bind(self, stage: int) -> socket.socket:
        with self._listen_lock:
            sock = self._listen.get(stage)
            if sock is not None:
                return sock
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
            self._listen[stage] = sock
            return sock

    def wait_arrivals(self, to_stage: int, timeout: float | None = 0.1) -> Arrivals:
        if self._closed:
            raise ConnectorError("connector is closed")
        sock = self._bind(to_stage)
        keys = self._drain(sock)
        if keys or keys.overflowed or timeout == 0:
            return keys
        try:
            ready, _, _ = select.select([sock], [], [], timeout)
        except (OSError, ValueError):
            return keys  # closed under us
        return self._drain(sock) if ready else keys

    @staticmethod
    def _drain(sock: socket.socket) -> Arrivals:
        keys = Arrivals()
        while True:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return keys
            except OSError:
                return keys
            if data == _OVERFLOW_MARKER:
                keys.overflowed = True
            else:
                keys.append(data.decode("utf-8", "surrogatepass"))

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
            free, self._free = self._free, []
        for sl in pending:
            if sl.published_name is not None:
                _unlink_quiet(os.path.join(self._dir, sl.published_name))
            self._retire(sl)
        for sl in free:
            self._retire(sl)
        with self._map_lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._map_bytes = 0
        for mp in maps:
            mp.retired = True
            if mp.users == 0:
                _close_map(mp.mm)
        with self._listen_lock:
            socks = list(self._listen.values())
            self._listen.clear()
        for sock in socks:
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


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view still exists; the mapping is released with it

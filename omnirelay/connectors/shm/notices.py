"""Arrival notices of the shm connector: the wire format, the sending and the receiving side.

A notice is one datagram on the target stage's abstract UNIX socket
(:func:`address`, nothing on disk)::

    u8 tag | u64 publish seq (LE) | u16 slot name length (LE) | slot name | key (UTF-8)

The tag is ``TAG_SMALL`` when the named slot is at most ``SMALL_OBJECT_BYTES`` (a get of
it is bounded: ``Arrivals.small``), else ``TAG_NORMAL``. A notice that names no slot
(length 0) says "look the key up by name". An empty datagram is the overflow marker:
"notices were lost, poll everything you wait for". Notices are hints: a receiver still
claims the object, so a stale or forged one costs a failed compare-and-swap at most.

* :class:`Outbox` — sends notices (a producer's, and a reader's that announces a key
  again), and decides which are small; a full receiver queue is remembered and the
  overflow marker sent when there is room.
* :class:`Inbox` — the stages this process listens for: :meth:`Inbox.wait` returns the
  announced keys as :class:`~omnirelay.connectors.base.Arrivals`, and keeps each key's
  newest notice as its *hint* (:attr:`Inbox.hints`: where the object is).
* :func:`send` / :func:`drain` — one notice, and the queued datagrams of a socket, parsed
  (``(tag, seq, name, key)`` per notice, ``None`` for a marker or anything malformed).

Two implementations, picked once at import: the C extension ``_notice_ops`` (one call
per notice sent and one per drain, built at install time) or plain ``socket`` calls
where it is not built. Outbox and Inbox call the chosen one directly: on a CPU just woken
from idle every Python call layer on a notice's path costs microseconds, and the C calls
are an order of magnitude cheaper than the interpreted packing and parsing
(docs/performance.md).
:func:`backend` says which one is in use.
"""

from __future__ import annotations

import errno as _errno
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from omnirelay.connectors.base import MAX_KEY_BYTES, SMALL_OBJECT_BYTES, Arrivals, inbox_name
from omnirelay.connectors.shm.names import PREFIX
from omnirelay.errors import ConnectorError

__all__ = [
    "BUFSIZE",
    "HEADER",
    "MARKER",
    "TAG_NORMAL",
    "TAG_SMALL",
    "Hint",
    "Inbox",
    "Notice",
    "Outbox",
    "address",
    "backend",
    "drain",
    "encode",
    "send",
]

TAG_NORMAL = 0x4E  # "N"
TAG_SMALL = 0x53  # "S"
HEADER = struct.Struct("<BQH")
MARKER = b""
#: recv size: the longest notice a connector sends (a slot name is far shorter than 512
#: bytes) plus one, so a longer datagram shows as one that filled the buffer (malformed).
BUFSIZE = HEADER.size + 512 + MAX_KEY_BYTES + 1
#: Hints kept at most (the oldest go first): keys announced but never got.
MAX_HINTS = 8192

#: ``(tag, seq, slot name, key)``
Notice = tuple[int, int, bytes, str]
#: Where a key's newest notice says its object is: ``(slot name, publish seq, is small)``.
Hint = tuple[bytes, int, bool]


def address(namespace: str, stage: int, replica: int = 0) -> bytes:
    """Abstract-namespace socket address of the arrival notices of one stage worker (a
    stage's replica ``replica``; the stage's own address for replica 0)."""
    return f"\0{PREFIX}{namespace}-n-{inbox_name(stage, replica)}".encode()


def encode(tag: int, seq: int, name: bytes, key: bytes) -> bytes:
    return HEADER.pack(tag, seq, len(name)) + name + key


def _parse(data: bytes) -> Notice | None:
    if len(data) < HEADER.size or len(data) >= BUFSIZE:
        return None
    tag, seq, name_len = HEADER.unpack_from(data)
    if (tag != TAG_NORMAL and tag != TAG_SMALL) or len(data) <= HEADER.size + name_len:
        return None
    try:
        key = data[HEADER.size + name_len :].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    return tag, seq, data[HEADER.size : HEADER.size + name_len], key


def _py_send(sock: socket.socket, addr: bytes, tag: int, seq: int, name: bytes, key: bytes) -> int:
    try:
        sock.sendto(encode(tag, seq, name, key) if tag else MARKER, addr)
    except OSError as exc:
        return exc.errno or _errno.EIO
    return 0


def _py_drain(sock: socket.socket, poller: Any, max_count: int) -> list[Notice | None]:
    out: list[Notice | None] = []
    recv = sock.recv
    # The first recv needs no poll when the caller was just told a datagram is queued
    # (max_count 1); otherwise polling is cheaper than ending on a raised BlockingIOError.
    ready = max_count == 1
    while (ready or poller.poll(0)) and (not max_count or len(out) < max_count):
        ready = False
        try:
            data = recv(BUFSIZE)
        except OSError:  # drained by another thread, or closed under us
            break
        out.append(_parse(data))
    return out


def _load() -> Any:
    try:
        from omnirelay.connectors.shm import _notice_ops  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _notice_ops


_EXT = _load()


def _use(use_extension: bool | None) -> bool:
    if use_extension is None:
        return _EXT is not None
    if use_extension and _EXT is None:
        raise RuntimeError("the _notice_ops C extension is not built (pip install -e . compiles it)")
    return use_extension


def send(
    sock: socket.socket,
    addr: bytes,
    tag: int,
    seq: int,
    name: bytes,
    key: bytes,
    *,
    use_extension: bool | None = None,
) -> int:
    """Send one notice (``tag`` 0: the overflow marker) from a non-blocking socket; 0 or
    the errno of the failure (``EAGAIN``: the receiver's queue is full; others: nobody
    listens). ``use_extension``: force one implementation (tests); default: the C one if built."""
    if _use(use_extension):
        fd = sock.fileno()
        return int(_EXT.send(fd, addr, tag, seq, name, key)) if fd >= 0 else _errno.EBADF
    return _py_send(sock, addr, tag, seq, name, key)


def drain(
    sock: socket.socket, poller: Any, max_count: int = 0, *, use_extension: bool | None = None
) -> list[Notice | None]:
    """The queued datagrams of ``sock`` (at most ``max_count``; 0: all), parsed. With
    ``max_count`` 1 the caller knows one is queued (a poll said so)."""
    if _use(use_extension):
        fd = sock.fileno()
        if fd < 0:
            return []  # closed under us
        try:
            result: list[Notice | None] = _EXT.drain(fd, BUFSIZE, max_count)
        except OSError:  # closed under us
            return []
        return result
    return _py_drain(sock, poller, max_count)


def backend() -> str:
    return "C extension (omnirelay.connectors.shm._notice_ops)" if _EXT is not None else "Python sockets"


class Outbox:
    """Sends arrival notices to the stages of one namespace.

    Linux queues only ``net.unix.max_dgram_qlen`` datagrams per receiver (10 by default):
    a notice that finds the queue full is counted lost, and the overflow marker is sent
    as soon as there is room (before the next notice to that stage, or on
    :meth:`flush_overflow`), so the receiver polls everything once. Thread-safe.
    """

    def __init__(self, namespace: str, *, use_extension: bool | None = None) -> None:
        self._namespace = namespace
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._ext_send = _EXT.send if _use(use_extension) else None
        self._addrs: dict[tuple[int, int], bytes] = {}
        self._overflow: set[tuple[int, int]] = set()  # (stage, replica) owed the marker
        self._lock = threading.Lock()
        self.num_sent = 0
        self.num_lost = 0

    def announce_slot(
        self, to_stage: int, seq: int, name: bytes, size: int, key: bytes, replica: int = 0
    ) -> None:
        """Tell ``to_stage`` (its replica ``replica``) that publish ``seq`` of slot ``name``
        (``size`` bytes) holds ``key``; the notice says whether the slot is small."""
        tag = TAG_SMALL if size <= SMALL_OBJECT_BYTES else TAG_NORMAL
        self._send((to_stage, replica), tag, seq, name, key)

    def announce_by_name(self, to_stage: int, key: bytes, replica: int = 0) -> None:
        """Tell ``to_stage`` (its replica ``replica``) to look ``key`` up by its name (a
        notice naming no slot)."""
        self._send((to_stage, replica), TAG_NORMAL, 0, b"", key)

    def _send(self, to: tuple[int, int], tag: int, seq: int, name: bytes, key: bytes) -> None:
        """Any failure but a full queue means nobody listens yet; a new receiver polls
        everything when it registers."""
        addr = self._addrs.get(to)
        if addr is None:
            addr = self._addrs[to] = address(self._namespace, *to)
        if self._overflow and to in self._overflow:
            self._send_marker(to)
        ext_send = self._ext_send
        if ext_send is not None:
            fd = self._sock.fileno()
            err = int(ext_send(fd, addr, tag, seq, name, key)) if fd >= 0 else _errno.EBADF
        else:
            err = _py_send(self._sock, addr, tag, seq, name, key)
        with self._lock:
            if err == _errno.EAGAIN:
                self._overflow.add(to)
            if err:
                self.num_lost += 1
            else:
                self.num_sent += 1

    def flush_overflow(self) -> None:
        """Send the overflow marker to every stage owed one (called by the reap pass)."""
        if self._overflow:
            for to in list(self._overflow):
                self._send_marker(to)

    def _send_marker(self, to: tuple[int, int]) -> None:
        addr = self._addrs.get(to) or address(self._namespace, *to)
        if send(self._sock, addr, 0, 0, b"", b"") == _errno.EAGAIN:
            return  # still full: try again on the next notice or reap
        with self._lock:  # sent, or the receiver is gone: nothing more to tell
            self._overflow.discard(to)

    def close(self) -> None:
        self._sock.close()


class Inbox:
    """The arrival notices of the stages this process listens for.

    Each key's newest notice is kept in :attr:`hints` (key -> :data:`Hint`), oldest
    first, at most :data:`MAX_HINTS`. Hints are plain dict operations, atomic under the
    GIL: a reader pops its key's hint (each serves one get) without a lock; only
    evictions take one.
    """

    def __init__(self, namespace: str, *, use_extension: bool | None = None) -> None:
        self._namespace = namespace
        self._ext_drain = _EXT.drain if _use(use_extension) else None
        #: (stage, replica) -> (socket, its poll object)
        self._listen: dict[tuple[int, int], tuple[socket.socket, Any]] = {}
        self._listen_lock = threading.Lock()
        self.hints: dict[str, Hint] = {}
        self.hints_lock = threading.Lock()  # serializes evictions of old hints only

    def listen(self, stage: int, replica: int = 0) -> tuple[socket.socket, Any]:
        """Bind the notice socket of ``stage``'s replica ``replica`` (idempotent);
        ConnectorError if another receiver of that replica holds it."""
        with self._listen_lock:
            listener = self._listen.get((stage, replica))
            if listener is not None:
                return listener
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(address(self._namespace, stage, replica))
            except OSError as exc:
                sock.close()
                raise ConnectorError(
                    f"cannot listen for arrivals of stage {inbox_name(stage, replica)} in namespace "
                    f"{self._namespace!r}: {exc} (another receiver of this stage is running in this namespace)"
                ) from exc
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            except OSError:
                pass
            sock.setblocking(False)
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            listener = self._listen[(stage, replica)] = (sock, poller)
            return listener

    def wait(
        self, stage: int, timeout: float | None, idle: Callable[[], None] | None = None, replica: int = 0
    ) -> Arrivals:
        """Keys announced to ``stage`` (its replica ``replica``): those queued now, or else
        the first to come within ``timeout`` seconds (None: no bound; 0: do not wait).
        ``idle`` is called when nothing is queued, just before the wait (work best done
        while idle)."""
        listener = self._listen.get((stage, replica)) or self.listen(stage, replica)
        keys = self._drain(listener)
        if keys or keys.overflowed or timeout == 0:
            return keys
        if idle is not None:
            idle()
        try:
            ready = listener[1].poll(-1 if timeout is None else timeout * 1000.0)
        except (OSError, ValueError):
            return keys  # closed under us
        return self._drain(listener, ready=True) if ready else keys

    def _drain(self, listener: tuple[socket.socket, Any], *, ready: bool = False) -> Arrivals:
        """Take queued notices (no blocking): announced keys, and their hints.

        ``ready``: a blocking poll just said a notice is queued. Then only that one is
        taken: the first arrival after an idle wait costs one ``recv`` and no second
        system call; any others are taken by the next call, whose drain comes first.
        """
        keys = Arrivals()
        small: set[str] = set()
        keys.small = small
        hints = self.hints
        ext_drain = self._ext_drain
        if ext_drain is not None:
            fd = listener[0].fileno()
            try:
                got = ext_drain(fd, BUFSIZE, 1 if ready else 0) if fd >= 0 else []
            except OSError:  # closed under us
                got = []
        else:
            got = _py_drain(listener[0], listener[1], 1 if ready else 0)
        for notice in got:
            if notice is None:
                keys.overflowed = True  # lost notices, or a datagram we do not understand
                continue
            tag, seq, name, key = notice
            keys.append(key)
            # The newest notice of a key is its hint, so it alone says whether it is
            # small. Re-inserted last: the newest hint is kept longest. A notice naming
            # no slot says "look it up by name".
            hints.pop(key, None)
            if tag == TAG_SMALL and name:
                small.add(key)
                hints[key] = (name, seq, True)
            else:
                small.discard(key)
                if name:
                    hints[key] = (name, seq, False)
        if len(hints) > MAX_HINTS:
            self._evict_hints()
        return keys

    def _evict_hints(self) -> None:
        hints = self.hints
        with self.hints_lock:
            while len(hints) > MAX_HINTS:
                try:  # gets pop hints without the lock: the oldest may change under us
                    hints.pop(next(iter(hints)), None)
                except (RuntimeError, StopIteration):
                    continue

    def close(self) -> None:
        with self.hints_lock:
            self.hints.clear()
        with self._listen_lock:
            socks = list(self._listen.values())
            self._listen.clear()
        for sock, _ in socks:
            sock.close()

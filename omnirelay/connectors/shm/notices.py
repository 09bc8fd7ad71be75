"""Arrival notices of the shm connector: the wire format, sending and draining.

A notice is one datagram on the target stage's abstract UNIX socket
(:func:`address`, nothing on disk)::

    u8 tag | u64 publish seq (LE) | u16 slot name length (LE) | slot name | key (UTF-8)

The tag is ``TAG_SMALL`` when the named slot is at most ``SMALL_OBJECT_BYTES`` (a get of
it is bounded: ``Arrivals.small``), else ``TAG_NORMAL``. A notice that names no slot
(length 0) says "look the key up by name". An empty datagram is the overflow marker:
"notices were lost, poll everything you wait for". Notices are hints: a receiver still
claims the object, so a stale or forged one costs a failed compare-and-swap at most.

* :func:`send` — one notice (or the marker) from a non-blocking socket; returns 0 or the
  errno (``EAGAIN``: the receiver's queue is full; others: nobody listens).
* :func:`drain` — the queued datagrams of a non-blocking socket, parsed: a
  ``(tag, seq, name, key)`` tuple per notice, ``None`` for a marker or anything malformed.

Two implementations, picked at import: the C extension ``_notice_ops`` (one call per
notice sent and one per drain, built at install time) or plain ``socket`` calls.
:func:`backend` says which.
"""

from __future__ import annotations

import errno as _errno
import socket
import struct
from typing import Any

from omnirelay.connectors.base import MAX_KEY_BYTES
from omnirelay.connectors.shm.names import PREFIX

__all__ = [
    "BUFSIZE",
    "HEADER",
    "MARKER",
    "TAG_NORMAL",
    "TAG_SMALL",
    "Notice",
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

#: ``(tag, seq, slot name, key)``
Notice = tuple[int, int, bytes, str]


def address(namespace: str, stage: int) -> bytes:
    """Abstract-namespace socket address of a stage's arrival notices."""
    return f"\0{PREFIX}{namespace}-n-{stage}".encode()


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
#: The C extension's ``send(fd, addr, tag, seq, name, key) -> errno`` and ``drain(fd,
#: bufsize, max_count) -> list``, or None where it is not built: for the connector's hot
#: paths, which call them directly (one Python call layer less per notice on each side —
#: on a CPU just woken from idle each layer costs microseconds). The caller checks the fd
#: (``sock.fileno()`` is -1 once closed) and catches OSError from ``drain``.
EXT_SEND: Any = None if _EXT is None else _EXT.send
EXT_DRAIN: Any = None if _EXT is None else _EXT.drain


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
    """Send one notice (``tag`` 0: the overflow marker); 0 or the errno of the failure.
    ``use_extension``: force one implementation (tests); default: the C one if built."""
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

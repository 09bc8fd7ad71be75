"""The shm backend's reclaim: find omnirelay objects under /dev/shm and reclaim those
whose owner process is dead.

:func:`sweep` is this backend's part of the connector contract's reclaim
(:func:`omnirelay.connectors.reclaim_namespace`), and runs at connector startup (its own
namespace). An object is reclaimed only when its owner is known and dead; objects of
live processes, and objects whose owner cannot be determined, are left alone (and
listed).

A dead producer's object is *withdrawn* before its names are removed: its slot's stamp goes
from PUBLISHED (or WRITING, WAITING) to RETIRED. Unlinking alone is not enough: a reader
that mapped the slot earlier keeps the mapping, and an arrival notice it holds for the key
names the slot and its publish, so it could still claim the object after the sweep — and
hand a request that reuses the id its dead incarnation's chunk (docs/protocol.md §3.5). A
slot a live reader has CLAIMED is left to that reader.
"""

from __future__ import annotations

import mmap
import os
import time

from omnirelay.connectors.base import NamespaceObject, ReclaimReport
from omnirelay.connectors.shm import atomics, names, slot
from omnirelay.errors import ConnectorError

__all__ = ["sweep"]

_KIND_NAMES = {"s": "slot", "k": "object", "c": "claim"}


def _read_slot_header(path: str) -> slot.SlotHeader | str:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return str(exc)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, slot.HEADER_SIZE, 0)
        if len(head) < slot.HEADER_SIZE:
            return "too small"
        key_len = slot.key_len_of(head)
        data = head + os.pread(fd, min(key_len, 1 << 16), slot.HEADER_SIZE)
        return slot.read_header(data, size)  # only header and key are read
    finally:
        os.close(fd)


#: States of a publish no reader has taken yet: a sweep withdraws them.
_UNTAKEN = (slot.PUBLISHED, slot.WRITING, slot.WAITING)


def _withdraw(path: str) -> bool:
    """Retire the object in the slot file at ``path`` unless a reader took it: CAS its
    stamp from an untaken state to RETIRED of the same publish. True if withdrawn."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < slot.HEADER_SIZE:
            return False
        mm = mmap.mmap(fd, slot.HEADER_SIZE)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    try:
        if mm[: len(slot.MAGIC)] != slot.MAGIC:
            return False
        try:
            word = atomics.Word(mm, slot.STAMP_OFFSET)
        except (ConnectorError, ValueError):
            return False  # no atomics here: no reader here can claim either
        try:
            while True:
                stamp = word.load()
                if stamp & 0xFF not in _UNTAKEN:
                    return False
                if word.cas(stamp, slot.stamp(slot.RETIRED, stamp >> 8)):
                    return True
        finally:
            del word  # its export of the mapping, before the close
    finally:
        mm.close()


def sweep(
    namespace: str | None = None, *, reclaim: bool = False, shm_dir: str = names.SHM_DIR
) -> ReclaimReport:
    """List omnirelay objects under ``shm_dir`` (of ``namespace``, or all) and, with
    ``reclaim``, remove those whose owner is dead."""
    report = ReclaimReport()
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return report
    now = time.time()
    alive_cache: dict[names.OwnerId, bool] = {}

    def alive(owner: names.OwnerId) -> bool:
        if owner not in alive_cache:
            alive_cache[owner] = names.owner_alive(owner)
        return alive_cache[owner]

    for entry in sorted(entries):
        parsed = names.parse_name(entry)
        if parsed is None or (namespace is not None and parsed.namespace != namespace):
            continue
        path = os.path.join(shm_dir, entry)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        obj = NamespaceObject(
            name=entry,
            namespace=parsed.namespace,
            kind=_KIND_NAMES.get(parsed.kind, "unknown"),
            owner_pid=parsed.owner.pid if parsed.owner else None,
            owner_alive=None,
            age_s=max(0.0, now - st.st_mtime),
            size=st.st_size,
        )
        owner = parsed.owner
        if parsed.kind in ("k", "s"):
            hdr = _read_slot_header(path)
            if not isinstance(hdr, str):
                obj.state = slot.STATE_NAMES.get(hdr.state)
                if parsed.kind == "k":
                    obj.key = hdr.key.decode("utf-8", "surrogatepass")
                    owner = names.OwnerId(hdr.owner_pid, hdr.owner_start)
                    obj.owner_pid = hdr.owner_pid
                    obj.age_s = max(0.0, now - hdr.created_ns / 1e9)
        if owner is not None:
            obj.owner_alive = alive(owner)
            if reclaim and not obj.owner_alive:
                if parsed.kind in ("k", "s"):
                    _withdraw(path)
                try:
                    os.unlink(path)
                    obj.reclaimed = True
                except FileNotFoundError:
                    pass
        report.objects.append(obj)
    return report

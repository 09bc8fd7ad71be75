"""Find omnirelay objects under /dev/shm and reclaim those whose owner process is dead.

Used at connector startup (its own namespace) and by ``omnirelay doctor``. An object is
reclaimed only when its owner is known and dead; objects of live processes, and
objects whose owner cannot be determined, are left alone (and listed).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from omnirelay.connectors.shm import names, slot

__all__ = ["ShmObject", "SweepReport", "sweep"]

_KIND_NAMES = {"s": "slot", "k": "object", "c": "claim"}


@dataclass
class ShmObject:
    name: str
    namespace: str
    kind: str  # slot | object | claim | unknown
    owner_pid: int | None
    owner_alive: bool | None
    age_s: float
    size: int
    state: str | None = None
    key: str | None = None
    reclaimed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SweepReport:
    objects: list[ShmObject] = field(default_factory=list)

    @property
    def reclaimed(self) -> list[ShmObject]:
        return [o for o in self.objects if o.reclaimed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "objects": [o.to_dict() for o in self.objects],
            "num_objects": len(self.objects),
            "num_reclaimed": len(self.reclaimed),
            "bytes_reclaimed": sum(o.size for o in self.reclaimed),
        }


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


def sweep(
    namespace: str | None = None, *, reclaim: bool = False, shm_dir: str = names.SHM_DIR
) -> SweepReport:
    """List omnirelay objects (of ``namespace``, or all) and optionally reclaim dead owners'."""
    report = SweepReport()
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
        obj = ShmObject(
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
                try:
                    os.unlink(path)
                    obj.reclaimed = True
                except FileNotFoundError:
                    pass
        report.objects.append(obj)
    return report

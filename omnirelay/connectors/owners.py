"""Process identities: who owns a transfer object, and whether that process still runs.

Every backend that leaves objects a dead process could own (the ``shm`` slots, published
keys and claims; the device arenas a consumer maps) names their owner by an
:class:`OwnerId`: its pid and its start time (clock ticks since boot, /proc/PID/stat
field 22), so a recycled pid is never mistaken for the owner.

* :func:`self_owner` — this process's identity; :func:`owner_alive` — whether an owner
  still runs; :func:`process_start_ticks` — a pid's start time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["OwnerId", "owner_alive", "process_start_ticks", "self_owner"]


@dataclass(frozen=True)
class OwnerId:
    pid: int
    start: int

    def __str__(self) -> str:
        return f"{self.pid}.{self.start}"


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[19])  # field 22 overall
    except (ValueError, IndexError):
        return None


@lru_cache(maxsize=1)
def _self_owner_cached(pid: int) -> OwnerId:
    return OwnerId(pid, process_start_ticks(pid) or 0)


def self_owner() -> OwnerId:
    """This process's identity (recomputed after a fork)."""
    return _self_owner_cached(os.getpid())


def owner_alive(owner: OwnerId) -> bool:
    """True if the process that owns an object still runs (same pid and start time)."""
    if owner.pid <= 0:
        return False
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = process_start_ticks(owner.pid)
    if start is None:
        return False
    # start == 0 means the owner could not read its own start time: trust the pid.
    return owner.start == 0 or start == owner.start

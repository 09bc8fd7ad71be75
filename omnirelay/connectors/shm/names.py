"""Names of omnirelay objects under /dev/shm, and process identities.

Every name is ``omnirelay-<namespace>-<kind>-<rest>``; the namespace never contains ``-``.

=====  =====================================  ==========================================
kind   rest                                   what it is
=====  =====================================  ==========================================
``s``  ``<pid>.<start>-<n>``                  a pooled slot file owned by producer ``pid``
``k``  ``<blake2b(key)>``                     a published object: a hard link to a slot
``c``  ``<pid>.<start>-<hash>-<n>``           a claim in progress by consumer ``pid``
=====  =====================================  ==========================================

``<start>`` is the owner's start time (clock ticks since boot, /proc/PID/stat field 22),
so a recycled pid is never mistaken for the owner. Keys are hashed into fixed-length
names (any external id is safe: ``/``, ``..``, NUL, unicode, 1,000 characters); the
original key is stored in the object's header for audits.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache

from omnirelay.connectors.base import MAX_KEY_BYTES, validate_key

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "OwnerId",
    "ParsedName",
    "claim_name",
    "key_bytes",
    "key_hash",
    "key_hash_bytes",
    "key_name",
    "owner_alive",
    "parse_name",
    "process_start_ticks",
    "self_owner",
    "slot_name",
]

SHM_DIR = "/dev/shm"
PREFIX = "omnirelay-"


@dataclass(frozen=True)
class OwnerId:
    pid: int
    start: int

    def __str__(self) -> str:
        return f"{self.pid}.{self.start}"


@dataclass(frozen=True)
class ParsedName:
    name: str
    namespace: str
    kind: str  # "s" slot, "k" published key, "c" claim
    owner: OwnerId | None
    key_hash: str | None


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


def key_bytes(key: object) -> bytes:
    """The UTF-8 bytes of a valid transfer key (``validate_key``'s rules, one encode);
    raises :class:`~omnirelay.errors.InvalidKeyError` with the reason."""
    if type(key) is str and key:
        data = key.encode("utf-8", "surrogatepass")
        if len(data) <= MAX_KEY_BYTES:
            return data
    validate_key(key)  # raises with the precise reason
    raise AssertionError("unreachable")  # pragma: no cover


def key_hash(key: str) -> str:
    return key_hash_bytes(key.encode("utf-8", "surrogatepass"))


def key_hash_bytes(key: bytes) -> str:
    """``key_hash`` of a key already encoded as UTF-8 (surrogatepass)."""
    return hashlib.blake2b(key, digest_size=20).hexdigest()


def key_name(namespace: str, key: str) -> str:
    return f"{PREFIX}{namespace}-k-{key_hash(key)}"


def slot_name(namespace: str, owner: OwnerId, n: int | str) -> str:
    return f"{PREFIX}{namespace}-s-{owner}-{n}"


def claim_name(namespace: str, owner: OwnerId, khash: str, n: int) -> str:
    return f"{PREFIX}{namespace}-c-{owner}-{khash}-{n}"


def _parse_owner(text: str) -> OwnerId | None:
    pid, _, start = text.partition(".")
    if not (pid.isdigit() and start.isdigit()):
        return None
    return OwnerId(int(pid), int(start))


def parse_name(name: str) -> ParsedName | None:
    """Parse a /dev/shm entry name; None if it is not an omnirelay object."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("-")
    if len(parts) < 3:
        return None
    namespace, kind = parts[0], parts[1]
    if kind == "k" and len(parts) == 3:
        return ParsedName(name, namespace, kind, None, parts[2])
    if kind == "s" and len(parts) == 4:
        return ParsedName(name, namespace, kind, _parse_owner(parts[2]), None)
    if kind == "c" and len(parts) == 5:
        return ParsedName(name, namespace, kind, _parse_owner(parts[2]), parts[3])
    return ParsedName(name, namespace, kind, None, None)

"""Names of omnirelay objects under /dev/shm.

Every name is ``omnirelay-<namespace>-<kind>-<rest>``; the namespace never contains ``-``.

=====  =====================================  ==========================================
kind   rest                                   what it is
=====  =====================================  ==========================================
``s``  ``<pid>.<start>-<n>``                  a pooled slot file owned by producer ``pid``
``k``  ``<blake2b(key)>``                     a published object: a hard link to a slot
``c``  ``<pid>.<start>-<hash>-<n>``           a claim in progress by consumer ``pid``
=====  =====================================  ==========================================

``<pid>.<start>`` is the owner's identity (:class:`~omnirelay.connectors.owners.OwnerId`:
its start time too, so a recycled pid is never mistaken for the owner). Keys are hashed into fixed-length
names (any external id is safe: ``/``, ``..``, NUL, unicode, 1,000 characters); the
original key is stored in the object's header for audits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from omnirelay.connectors.base import MAX_KEY_BYTES, validate_key
from omnirelay.connectors.owners import OwnerId, owner_alive, process_start_ticks, self_owner

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
class ParsedName:
    name: str
    namespace: str
    kind: str  # "s" slot, "k" published key, "c" claim
    owner: OwnerId | None
    key_hash: str | None


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

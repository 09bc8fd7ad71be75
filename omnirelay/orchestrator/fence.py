"""The id-reuse fence and the requests parked behind it, as pure books (docs/protocol.md §2.8).

When a request ends, the front tells every stage that saw it to release its id. Until a
stage reports it released, what that stage says about the id belongs to the ended request
(stale), never to a new request that reuses the id; and it may still hold the ended
request's chunks (or be putting them) under the same keys. So:

* a release sent to a worker puts a fence on the id, held by that worker
  (:meth:`IdFence.hold`); the worker's ``Released`` report lifts it (:meth:`IdFence.lift`);
* a new request reusing a fenced id is parked (:meth:`IdFence.park`) and handed back to
  be admitted once the id's last fence goes — so is a request run again after losing a
  replica (the router's ``Rerun``), whose ids are fenced like any other;
* a dead worker's fences are no longer its own: no ``Released`` will come from it, but a
  reader that mapped one of its slots could still claim an object of the ended request
  until the supervisor swept the dead process's objects. Its fences pass to its
  :class:`Sweep` (:meth:`IdFence.worker_died`), lifted when the sweep is done
  (:meth:`IdFence.swept`).

No clock, no I/O: the orchestrator feeds the events in and admits what comes back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Holder", "IdFence", "Sweep"]

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class Sweep:
    """The fence a dead worker's sweep holds on an id until the supervisor withdrew and
    reclaimed the worker's objects (``worker``: its index)."""

    worker: int


#: Who holds a fence on an id: a worker's index (it was told to release the id), or a
#: dead worker's sweep.
Holder = int | Sweep


class IdFence(Generic[P]):
    """Fenced ids with their holders, and what is parked behind them (``P``: whatever the
    owner needs to admit it later); see the module docstring."""

    def __init__(self) -> None:
        #: id -> who has not lifted its fence on the id yet (never empty)
        self._holders: dict[str, set[Holder]] = {}
        #: id -> what waits for the id's last fence to go, in arrival order
        self._parked: dict[str, P] = {}

    # -- queries ------------------------------------------------------------------------

    def is_fenced(self, request_id: str) -> bool:
        """Does anyone still hold a fence on the id?"""
        return request_id in self._holders

    def holds(self, holder: Holder, request_id: str) -> bool:
        """Does ``holder`` hold a fence on the id (what it says of the id is stale)?"""
        holders = self._holders.get(request_id)
        return holders is not None and holder in holders

    def is_parked(self, request_id: str) -> bool:
        return request_id in self._parked

    @property
    def is_empty(self) -> bool:
        """No fence and nothing parked (the front's leak audit)."""
        return not self._holders and not self._parked

    def fenced_ids(self) -> list[str]:
        return sorted(self._holders)

    def parked_ids(self) -> list[str]:
        return sorted(self._parked)

    # -- fences -------------------------------------------------------------------------

    def hold(self, request_id: str, holder: Holder) -> None:
        """``holder`` was told to release the id (or, a :class:`Sweep`, will withdraw a
        dead worker's objects of it)."""
        self._holders.setdefault(request_id, set()).add(holder)

    def lift(self, holder: Holder, request_id: str) -> list[P]:
        """``holder`` released the id (a duplicate or unknown report changes nothing).
        Returns what was parked behind the id when that was its last fence (at most one):
        it is the caller's to admit now."""
        holders = self._holders.get(request_id)
        if holders is None or holder not in holders:
            return []
        holders.discard(holder)
        if holders:
            return []
        del self._holders[request_id]
        parked = self._parked.pop(request_id, None)
        return [] if parked is None else [parked]

    def worker_died(self, worker: int, *, ended: Iterable[str] = (), swept_later: bool = False) -> list[P]:
        """The worker is dead: no ``Released`` will come from it. Its fences are lifted —
        or, with ``swept_later`` (its process is gone and its objects are swept next),
        passed to its :class:`Sweep`, which also fences ``ended`` (the ids of the requests
        its death ended). Returns what was parked behind fences that went, in the order
        the ids were fenced."""
        sweep = Sweep(worker)
        if swept_later:
            for request_id in ended:
                self.hold(request_id, sweep)
        freed = []
        for request_id in [rid for rid, holders in self._holders.items() if worker in holders]:
            if swept_later:
                self.hold(request_id, sweep)
            freed += self.lift(worker, request_id)
        return freed

    def swept(self, worker: int) -> list[P]:
        """The dead worker's objects are withdrawn and reclaimed: its sweep's fences go.
        Returns what was parked behind the last of them."""
        sweep = Sweep(worker)
        freed = []
        for request_id in [rid for rid, holders in self._holders.items() if sweep in holders]:
            freed += self.lift(sweep, request_id)
        return freed

    # -- parked requests ----------------------------------------------------------------

    def park(self, request_id: str, item: P) -> None:
        """``item`` waits until the id's last fence goes (the id must be fenced)."""
        if request_id not in self._holders:
            raise ValueError(f"request id {request_id!r} is not fenced: nothing to wait for")
        if request_id in self._parked:
            raise ValueError(f"request id {request_id!r} is already parked")
        self._parked[request_id] = item

    def unpark(self, request_id: str) -> P | None:
        """Take back what is parked under the id (an abort); its fences stay."""
        return self._parked.pop(request_id, None)

    def drain(self) -> list[tuple[str, P]]:
        """Take back everything parked (shutdown); the fences stay."""
        items = list(self._parked.items())
        self._parked.clear()
        return items

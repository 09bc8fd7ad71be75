"""Which replica of a stage a request is bound to (docs/design.md §11), as a pure state machine.

A stage may run several worker processes (``replicas:`` in the pipeline file). When a
request enters a stage, the router asks :meth:`ReplicaBalancer.choose` for one of them and
binds the request to it for that stage: its submit, abort and release go to that replica,
and the previous stage announces its chunks of the request there.

The choice is a function of reported state only — no clock, no I/O:

* **load**: the requests each replica holds, as the router booked them (:meth:`bind` when a
  request is given to the replica, :meth:`unbind` when the replica finished it or the
  request ended), weighed by the replica's **capacity** (the requests it runs at once,
  reported in its hello: :meth:`set_capacity`). The least loaded replica wins;
* **ties** go round-robin (a rotating start), so equal replicas share a burst evenly;
* **affinity**: requests that carry the same session key (a realtime session, a
  conversation) go back to the replica that served the session before, while it is up
  and not busier than the least loaded one by more than :attr:`affinity_slack` requests
  (then the session moves, and its new replica is remembered);
* **health**: a replica that is down (:meth:`mark_down`) is never chosen until it is
  back (:meth:`mark_up`); :meth:`choose` returns None when no replica of the stage is up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ReplicaBalancer", "ReplicaLoad"]

#: Sessions remembered per balancer (the oldest are forgotten first).
MAX_SESSIONS = 4096


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica as the balancer sees it (for ``/health`` and tests)."""

    stage_id: int
    replica: int
    is_up: bool
    num_requests: int
    capacity: int


class ReplicaBalancer:
    """Load, capacity and health of every replica of every stage; see the module docstring."""

    def __init__(
        self,
        replicas: Mapping[int, int],
        *,
        capacity: Mapping[int, int] | None = None,
        affinity_slack: int = 2,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        """``replicas``: stage id -> how many replicas it runs; ``capacity``: stage id ->
        each replica's capacity until it reports its own (default 1)."""
        self.affinity_slack = affinity_slack
        self._max_sessions = max_sessions
        self._count = {s: int(n) for s, n in replicas.items()}
        caps = dict(capacity or {})
        self._load: dict[tuple[int, int], int] = {}
        self._capacity: dict[tuple[int, int], int] = {}
        self._down: set[tuple[int, int]] = set()
        for s, n in self._count.items():
            if n < 1:
                raise ValueError(f"stage {s} must have at least one replica, got {n}")
            for r in range(n):
                self._load[(s, r)] = 0
                self._capacity[(s, r)] = max(1, int(caps.get(s, 1)))
        self._next = dict.fromkeys(self._count, 0)  # round-robin start per stage
        self._sessions: OrderedDict[tuple[str, int], int] = OrderedDict()

    # -- queries ------------------------------------------------------------------------

    def num_replicas(self, stage_id: int) -> int:
        return self._count[stage_id]

    def is_up(self, stage_id: int, replica: int) -> bool:
        return (stage_id, replica) not in self._down

    def has_up(self, stage_id: int) -> bool:
        """Is any replica of the stage up?"""
        return any((stage_id, r) not in self._down for r in range(self._count[stage_id]))

    def load(self, stage_id: int, replica: int) -> int:
        return self._load[(stage_id, replica)]

    def describe(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(s, r, (s, r) not in self._down, self._load[(s, r)], self._capacity[(s, r)])
            for (s, r) in sorted(self._load)
        ]

    # -- the choice ---------------------------------------------------------------------

    def choose(self, stage_id: int, session: str | None = None) -> int | None:
        """The replica a request entering ``stage_id`` is bound to (None: none is up).
        Does not book the request: :meth:`bind` does."""
        n = self._count[stage_id]
        if n == 1:
            return None if (stage_id, 0) in self._down else 0
        up = [r for r in range(n) if (stage_id, r) not in self._down]
        if not up:
            return None
        start = self._next[stage_id]
        # Least loaded by share of capacity; among equals, the first from the rotating start.
        best = min(up, key=lambda r: (self._share(stage_id, r), (r - start) % n))
        if session is not None:
            remembered = self._sessions.get((session, stage_id))
            if (
                remembered is not None
                and remembered in up
                and self._load[(stage_id, remembered)] <= self._load[(stage_id, best)] + self.affinity_slack
            ):
                best = remembered
        self._next[stage_id] = (best + 1) % n
        if session is not None:
            self._remember(session, stage_id, best)
        return best

    def _share(self, stage_id: int, replica: int) -> float:
        return self._load[(stage_id, replica)] / self._capacity[(stage_id, replica)]

    def _remember(self, session: str, stage_id: int, replica: int) -> None:
        key = (session, stage_id)
        self._sessions[key] = replica
        self._sessions.move_to_end(key)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    # -- reported state -----------------------------------------------------------------

    def bind(self, stage_id: int, replica: int) -> None:
        """A request was given to the replica."""
        self._load[(stage_id, replica)] += 1

    def unbind(self, stage_id: int, replica: int) -> None:
        """The replica finished a request it was given, or the request ended."""
        key = (stage_id, replica)
        if self._load[key] <= 0:
            raise RuntimeError(f"replica {replica} of stage {stage_id} was unbound more often than bound")
        self._load[key] -= 1

    def set_capacity(self, stage_id: int, replica: int, capacity: int) -> None:
        """The replica's own report of the requests it runs at once (its hello)."""
        if capacity >= 1:
            self._capacity[(stage_id, replica)] = int(capacity)

    def mark_down(self, stage_id: int, replica: int) -> None:
        self._down.add((stage_id, replica))

    def mark_up(self, stage_id: int, replica: int) -> None:
        self._down.discard((stage_id, replica))

"""A stage engine's tick between its launch and its completion (``StageEngine.launch_step``).

* :class:`Call` — one executor call of the tick: launched (a
  :class:`~omnirelay.engine.interfaces.PendingStep`) or ended (its results or exception);
* :class:`Tick` — the launched tick: its outputs so far, the scheduler's output, its calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnirelay.engine.interfaces import BatchItem, PendingStep, StageOutput

__all__ = ["Call", "Tick"]


class Call:
    """One executor call of a tick: launched (``pending``) or ended (``value``: the
    results, or the exception)."""

    __slots__ = ("batch", "pending", "value")

    def __init__(self, batch: tuple[BatchItem, ...]) -> None:
        self.batch = batch
        self.pending: PendingStep | None = None
        self.value: Any = None

    def is_done(self) -> bool:
        if self.pending is None:
            return True
        try:
            return self.pending.is_done()
        except Exception:
            return True  # its result() raises it, which fails the batch


@dataclasses.dataclass(slots=True)
class Tick:
    """A launched tick, until :meth:`~omnirelay.engine.engine.StageEngine.complete_step`."""

    outputs: list[StageOutput]
    sched: Any = None
    calls: list[Call] = dataclasses.field(default_factory=list)

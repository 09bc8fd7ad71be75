"""The engine's optional step tracer: the one interface through which per-step timing flows.

A :class:`StageEngine` built with ``tracer=None`` (the default) does no timing work at
all: no clock is read for it and nothing is written into its outputs' ``metrics``. With
a tracer, the engine (and its transfer adapter) tell it what happened, and it may add
keys to the ``metrics`` of the outputs its steps made; the implementation that feeds the
timeline of ``omnirelay run`` and ``bench pipeline`` is
:class:`omnirelay.engine.step_recorder.StepRecorder`.

When each method is called (engine thread unless said otherwise):

* :meth:`~StepTracer.chunk_ready` — a receive worker thread committed a request's next
  chunk (before the engine can see it): ``is_waited`` says a get had found it missing,
  i.e. the request asked for it before it arrived. Must be quick and thread-safe.
* :meth:`~StepTracer.chunks_taken` — the engine drained those ready chunks; its next
  steps of these requests compute on them.
* :meth:`~StepTracer.call_started` / :meth:`~StepTracer.call_ended` — around one
  executor call for ``batch`` (``call_ended`` only when it returned: a call that raised
  made no step).
* :meth:`~StepTracer.output_made` — an output made by this tick's step of ``request``
  (its step output, or its final output after that step); the tracer may add keys to
  ``output.metrics``. Outputs made by no step (an abort, a refusal) are not shown to it.
* :meth:`~StepTracer.request_done` — the engine dropped the request: forget it.
* :meth:`~StepTracer.leak_state` — the tracer's per-request state (empty when idle), part
  of the engine's leak audit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from omnirelay.engine.interfaces import BatchItem, StageOutput
    from omnirelay.engine.request import Request

__all__ = ["StepTracer"]


@runtime_checkable
class StepTracer(Protocol):
    """What a stage engine reports about its steps; see the module docstring."""

    def chunk_ready(self, internal_id: str, is_waited: bool) -> None: ...

    def chunks_taken(self, internal_ids: Iterable[str]) -> None: ...

    def call_started(self, batch: Sequence[BatchItem]) -> None: ...

    def call_ended(self, batch: Sequence[BatchItem]) -> None: ...

    def output_made(self, request: Request, output: StageOutput) -> None: ...

    def request_done(self, internal_id: str) -> None: ...

    def leak_state(self) -> dict[str, Any]: ...

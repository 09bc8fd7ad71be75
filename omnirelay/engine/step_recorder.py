"""The step tracer of a traced pipeline: :class:`StepRecorder`, and :func:`step_of` to read it back.

:class:`StepRecorder` is the :class:`~omnirelay.engine.tracing.StepTracer` of a pipeline
started with ``Pipeline.start(trace_steps=True)`` (``omnirelay run``, ``bench
pipeline``): one per stage engine, in the stage's process. Into the ``metrics`` of every
output a step made it writes (:data:`STEP_METRICS`):

* ``arrival_s`` — when the request reached this stage (its admission);
* ``step_start_s`` / ``step_end_s`` — the executor call that made the output;
* ``item_compute_s`` — this request's share of that call: its wall time over the
  number of requests in the batch;
* ``input_time_s`` — when the newest chunk the request took was committed, present only
  when the request had asked for that chunk before it arrived (so the step waited for
  its upstream, as opposed to finding the chunk already there).

Model compute is the executor call's wall time: the runtime does not look inside an
executor, so input parsing, batching and output conversion in the executor count as
compute. Times are ``time.monotonic()``: one clock for every process of a host, so the
front compares them with its own submit and arrival times directly.

On the front, :func:`step_of` turns an output's metrics back into a :class:`Step`; the
timeline (:mod:`omnirelay.timeline`) reads steps from it. It lives beside the engine's
:class:`~omnirelay.engine.tracing.StepTracer` so that the API, which installs it, needs
nothing from the timeline, which drives the API.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omnirelay.engine.interfaces import BatchItem, StageOutput
    from omnirelay.engine.request import Request

__all__ = ["STEP_METRICS", "Step", "StepRecorder", "step_of"]

#: The keys :class:`StepRecorder` adds to an output's ``metrics`` (see the module docstring).
STEP_METRICS = ("arrival_s", "step_start_s", "step_end_s", "item_compute_s", "input_time_s")


@dataclass(frozen=True, slots=True)
class Step:
    """One executor call of one stage, as one request saw it (its wall time is the call's
    model compute, which the request waited for whole)."""

    stage_id: int
    start_s: float
    end_s: float
    input_time_s: float | None  # the commit of the chunk it had been waiting for
    item_compute_s: float = 0.0  # this request's share of the call
    arrival_s: float | None = None  # when the request reached the stage

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


def step_of(stage_id: int, metrics: Mapping[str, float]) -> Step | None:
    """The :class:`Step` in an output's metrics (None: the output was made by no step, or
    the stage records none)."""
    try:
        return Step(
            stage_id=stage_id,
            start_s=float(metrics["step_start_s"]),
            end_s=float(metrics["step_end_s"]),
            input_time_s=float(metrics["input_time_s"]) if "input_time_s" in metrics else None,
            item_compute_s=float(metrics.get("item_compute_s", 0.0)),
            arrival_s=float(metrics["arrival_s"]) if "arrival_s" in metrics else None,
        )
    except KeyError:
        return None


class StepRecorder:
    """Records one stage's steps into its outputs' metrics (a ``StepTracer``).

    :meth:`chunk_ready` runs on the adapter's receive workers, everything else on the
    engine thread; ``_lock`` guards the maps both sides touch (it is a leaf lock).

    Per request it keeps at most: the commit of a ready chunk not yet taken, the commit
    time of the last chunk it waited for, and its last executor call until the output
    that call made. :meth:`request_done` drops all three.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: Committed, not yet taken: the commit time when the request had waited for it.
        self._ready: dict[str, float | None] = {}
        #: The commit time of the newest chunk taken, if the request had waited for it.
        self._input: dict[str, float] = {}
        #: The request's last executor call: (start, end, its share of the wall time).
        self._steps: dict[str, tuple[float, float, float]] = {}
        self._call_start = 0.0

    def chunk_ready(self, internal_id: str, is_waited: bool) -> None:
        t = self._clock() if is_waited else None
        with self._lock:
            self._ready[internal_id] = t

    def chunks_taken(self, internal_ids: Iterable[str]) -> None:
        # A request's next chunk is asked for only after this one was taken: what is ready
        # for it now is the chunk its next steps compute on.
        with self._lock:
            for iid in internal_ids:
                if iid not in self._ready:
                    continue
                t = self._ready.pop(iid)
                if t is None:
                    self._input.pop(iid, None)
                else:
                    self._input[iid] = t

    def call_started(self, batch: Sequence[BatchItem]) -> None:
        with self._lock:
            for item in batch:
                self._steps.pop(item.internal_id, None)  # a call that raises records nothing
        self._call_start = self._clock()

    def call_ended(self, batch: Sequence[BatchItem]) -> None:
        end = self._clock()
        start = self._call_start
        share = (end - start) / max(1, len(batch))
        with self._lock:
            for item in batch:
                self._steps[item.internal_id] = (start, end, share)

    def output_made(self, request: Request, output: StageOutput) -> None:
        iid = request.internal_id
        with self._lock:
            step = self._steps.pop(iid, None)
            input_time = self._input.get(iid)
        if step is None:
            return
        start, end, share = step
        metrics = {
            **output.metrics,
            "arrival_s": request.arrival_time,
            "step_start_s": start,
            "step_end_s": end,
            "item_compute_s": share,
        }
        if input_time is not None:
            metrics["input_time_s"] = input_time
        output.metrics = metrics

    def request_done(self, internal_id: str) -> None:
        with self._lock:
            self._ready.pop(internal_id, None)
            self._input.pop(internal_id, None)
            self._steps.pop(internal_id, None)

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            maps = {"ready": sorted(self._ready), "inputs": sorted(self._input), "steps": sorted(self._steps)}
        return {k: v for k, v in maps.items() if v}

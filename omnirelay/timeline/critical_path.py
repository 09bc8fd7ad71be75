"""The critical path of one client output, across stages (``run`` and ``bench pipeline``).

* :class:`StageTrace` — the observer given to ``Pipeline.start(on_stage_output=...,
  trace_steps=True)``: for the requests it is told to :meth:`~StageTrace.watch`, it keeps
  every stage's outputs as :class:`StageEvent` s, with the step each was made by (the
  metrics the stages' :class:`~omnirelay.engine.step_recorder.StepRecorder` wrote).
  Intermediate stages (the Talker) are seen too.
* :func:`critical_path` — from a client output back to the submit: which steps of which
  stages the output waited for, and how the wall time splits into model compute and
  everything else (:class:`CriticalPath`).

Times are ``time.monotonic()``: one clock for every process of a host, so the front's
submit and arrival times and the stages' step times compare directly.

**The walk.** Start at the step that made the output (a final output made by no step —
an empty terminal — starts at the latest step before it of its stage or its upstream).
From a step, the predecessor is what it waited for last:

* the upstream step that produced its input chunk, when the step had been *waiting* for
  that chunk (``input_time_s`` is present and later than the previous step's end): the
  producer is the latest upstream step that ended before the chunk arrived;
* else the previous step of the same stage;
* else, for a stage's first step: the upstream's last step when the orchestrator
  forwarded the input complete (a non-chunk edge); otherwise the request's own
  admission at the stage (stage 0, or a consumer that found its first chunk already
  there when it registered), back to the submit.

Along the way the wall time is split exactly into segments (:data:`SEGMENTS`), so
``compute_s + sum(segments) == wall_s``: ``compute`` is the model compute of each step on
the path, taken as the executor call's wall time (a batched request waited for all of
it; input parsing and output conversion inside the executor count as compute too, see
:mod:`~omnirelay.engine.step_recorder`); ``schedule`` the gap between two steps of one stage
(engine tick, saves, outputs, waiting for a batch slot or for other requests' steps);
``transfer`` the producer's end to the chunk's commit at the consumer (send thread,
processor, put, notice, get, commit); ``wake`` the commit to the consumer's step;
``forward`` the upstream's end to a forwarded stage's first step; ``submit`` the API call
to the request's arrival in the stage whose admission started the path (control plane);
``admit`` that arrival to the stage's first step; ``deliver`` the step's end to the
client reading the output.

The producer is found by time: exact unless a transfer took longer than one upstream
step (then the walk credits one step too late and reports slightly *less* overhead).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnirelay.api import StageOutput
from omnirelay.engine.step_recorder import Step, step_of

__all__ = [
    "SEGMENTS",
    "CriticalPath",
    "StageEvent",
    "StageTrace",
    "audio_length",
    "critical_path",
    "steps_by_stage",
    "upstream_map",
]

#: How the time outside model compute on a critical path is split (see the module docstring).
SEGMENTS = ("submit", "admit", "schedule", "transfer", "wake", "forward", "deliver")


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One stage output of one request, as the front received it."""

    stage_id: int
    token_ids: tuple[int, ...]
    num_samples: int
    finished: bool
    finish_reason: str | None
    step: Step | None


def audio_length(audio: Any) -> int:
    if audio is None:
        return 0
    numel = getattr(audio, "numel", None)
    if callable(numel):
        return int(numel())
    size = getattr(audio, "size", None)
    return int(size) if isinstance(size, int) else len(audio)


class StageTrace:
    """Every stage's outputs of the watched requests (the ``on_stage_output`` observer).

    ``__call__`` runs on the front's event-loop thread; the other methods on any thread.
    A request's events stay until :meth:`take` (or :meth:`forget`) removes them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[StageEvent]] = {}

    def watch(self, request_id: str) -> None:
        """Start keeping the outputs of ``request_id`` (call before submitting it)."""
        with self._lock:
            self._events[request_id] = []

    def __call__(self, output: StageOutput) -> None:
        with self._lock:
            events = self._events.get(output.request_id)
            if events is None:
                return
            events.append(
                StageEvent(
                    stage_id=output.stage_id,
                    token_ids=tuple(output.token_ids),
                    num_samples=audio_length(output.audio),
                    finished=output.finished,
                    finish_reason=output.finish_reason,
                    step=step_of(output.stage_id, output.metrics),
                )
            )

    def take(self, request_id: str) -> list[StageEvent]:
        """The request's events in arrival order; stops watching it."""
        with self._lock:
            return self._events.pop(request_id, [])

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._events.pop(request_id, None)

    @property
    def num_watched(self) -> int:
        with self._lock:
            return len(self._events)


def steps_by_stage(events: Sequence[StageEvent]) -> dict[int, list[Step]]:
    """Each stage's steps, in order."""
    out: dict[int, list[Step]] = {}
    for e in events:
        if e.step is not None:
            out.setdefault(e.stage_id, []).append(e.step)
    return out


@dataclass(slots=True)
class CriticalPath:
    """The wall time from the submit to one client output, split along its critical path."""

    wall_s: float
    compute_s: float
    segments: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SEGMENTS, 0.0))
    #: The steps on the path, from the first (stage 0) to the one that made the output.
    path: list[Step] = field(default_factory=list)

    @property
    def overhead_s(self) -> float:
        """Wall time on the path minus model compute on it."""
        return self.wall_s - self.compute_s

    @property
    def overhead_share(self) -> float:
        return self.overhead_s / self.wall_s if self.wall_s > 0 else 0.0

    def compute_by_stage(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for s in self.path:
            out[s.stage_id] = out.get(s.stage_id, 0.0) + s.wall_s
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "compute_s": self.compute_s,
            "overhead_s": self.overhead_s,
            "overhead_share": self.overhead_share,
            "segments_s": dict(self.segments),
            "compute_by_stage_s": {str(k): v for k, v in self.compute_by_stage().items()},
            "num_steps_on_path": len(self.path),
            "steps_on_path_by_stage": {
                str(k): sum(1 for s in self.path if s.stage_id == k) for k in sorted(self.compute_by_stage())
            },
        }


def _latest_before(steps: Sequence[Step], t: float) -> Step | None:
    best = None
    for s in steps:
        if s.end_s <= t and (best is None or s.end_s > best.end_s):
            best = s
    return best


def critical_path(
    events: Sequence[StageEvent],
    *,
    submit_s: float,
    target_s: float,
    target_stage: int,
    target_step: Step | None,
    upstream: Mapping[int, int | None],
    forwarded: frozenset[int] = frozenset(),
) -> CriticalPath:
    """The critical path from ``submit_s`` to a client output that arrived at ``target_s``.

    ``target_stage``/``target_step``: the stage that made the output and the step in its
    metrics (None for an output made by no step). ``upstream``: each stage's input stage
    (None for stage 0); ``forwarded``: the stages whose input is forwarded complete by
    the orchestrator (not chunked). See the module docstring for the walk.
    """
    by_stage = steps_by_stage(events)
    cp = CriticalPath(wall_s=target_s - submit_s, compute_s=0.0)
    seg = cp.segments
    stage, node = target_stage, target_step
    if node is None:
        candidates = [
            last
            for s in (target_stage, upstream.get(target_stage))
            if s is not None and (last := _latest_before(by_stage.get(s, []), target_s)) is not None
        ]
        if not candidates:
            seg["submit"] += cp.wall_s
            return cp
        node = max(candidates, key=lambda s: s.end_s)
        stage = node.stage_id
    seg["deliver"] += target_s - node.end_s
    while True:
        cp.path.append(node)
        cp.compute_s += node.wall_s
        steps = by_stage.get(stage, [])
        k = next((i for i, s in enumerate(steps) if s == node), None)
        prev = steps[k - 1] if k is not None and k > 0 else None
        up = upstream.get(stage)
        inp = node.input_time_s
        if inp is not None and up is not None and (prev is None or inp > prev.end_s):
            producer = _latest_before(by_stage.get(up, []), inp)
            if producer is not None:
                seg["wake"] += node.start_s - inp
                seg["transfer"] += inp - producer.end_s
                stage, node = up, producer
                continue
        if prev is not None:
            seg["schedule"] += node.start_s - prev.end_s
            node = prev
            continue
        if up is not None and stage in forwarded:
            last = _latest_before(by_stage.get(up, []), node.start_s)
            if last is not None:
                seg["forward"] += node.start_s - last.end_s
                stage, node = up, last
                continue
        # The stage's first step waited for the request itself: its admission.
        arrival = node.arrival_s
        if arrival is None or not submit_s <= arrival <= node.start_s:
            arrival = submit_s
        seg["submit"] += arrival - submit_s
        seg["admit"] += node.start_s - arrival
        break
    cp.path.reverse()
    return cp


def upstream_map(config: Any) -> dict[int, int | None]:
    """Each stage's input stage (the first of its ``input_sources``; None for a source)."""
    return {s.id: (s.input_sources[0] if s.input_sources else None) for s in config.stages}

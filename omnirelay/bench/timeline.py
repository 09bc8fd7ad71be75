"""One request's timeline across stages, and its critical path (``run`` and ``bench pipeline``).

* :class:`StageTrace` — the observer given to ``Pipeline.start(on_stage_output=...)``: for
  the requests it is told to :meth:`~StageTrace.watch`, it keeps every stage's outputs as
  :class:`StageEvent` s, with the step timing the engine puts in their ``metrics``
  (:mod:`omnirelay.engine.stage_output`). Intermediate stages (the Talker) are seen too.
* :func:`critical_path` — from a client output back to the submit: which steps of which
  stages the output waited for, and how the wall time splits into model compute and
  everything else (:class:`CriticalPath`).
* :func:`drive_request` — submit one request, read its outputs (timing each arrival),
  and return its :class:`RequestTimeline`: time to first text token and first audio,
  audio chunks, codec frames, and the critical paths to the first audio and to the end.

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
the path (the whole executor call: a batched request waited for all of it);
``step_overhead`` is the rest of each step's executor call (input parsing, batching,
output conversion); ``schedule`` the gap between two steps of one stage (engine tick,
saves, outputs, waiting for a batch slot or for other requests' steps); ``transfer`` the
producer's end to the chunk's commit at the consumer (send thread, processor, put,
notice, get, commit); ``wake`` the commit to the consumer's step; ``forward`` the upstream's
end to a forwarded stage's first step; ``submit`` the API call to the request's arrival
in the stage whose admission started the path (control plane); ``admit`` that arrival to
the stage's first step; ``deliver`` the step's end to the client reading the output.

The producer is found by time: exact unless a transfer took longer than one upstream
step (then the walk credits one step too late and reports slightly *less* overhead).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnirelay.engine.interfaces import SamplingParams, StageOutput
from omnirelay.orchestrator.router import RequestOutput, stage_sampling_defaults

if TYPE_CHECKING:
    from omnirelay.api import Pipeline

__all__ = [
    "SEGMENTS",
    "ClientArrival",
    "CriticalPath",
    "RequestTimeline",
    "StageEvent",
    "StageTrace",
    "Step",
    "critical_path",
    "drive_request",
    "step_of",
    "steps_by_stage",
    "upstream_map",
]

#: How the time outside model compute on a critical path is split (see the module docstring).
SEGMENTS = ("submit", "admit", "step_overhead", "schedule", "transfer", "wake", "forward", "deliver")


@dataclass(frozen=True, slots=True)
class Step:
    """One executor call of one stage, as one request saw it."""

    stage_id: int
    start_s: float
    end_s: float
    compute_s: float  # model compute of the whole call
    input_time_s: float | None  # the arrival of the chunk it had been waiting for
    item_compute_s: float = 0.0  # this request's share of the call's compute
    arrival_s: float | None = None  # when the request reached the stage

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One stage output of one request, as the front received it."""

    stage_id: int
    token_ids: tuple[int, ...]
    num_samples: int
    finished: bool
    finish_reason: str | None
    step: Step | None


def step_of(stage_id: int, metrics: Mapping[str, float]) -> Step | None:
    """The :class:`Step` in an output's metrics (None: the output was made by no step)."""
    try:
        return Step(
            stage_id=stage_id,
            start_s=float(metrics["step_start_s"]),
            end_s=float(metrics["step_end_s"]),
            compute_s=float(metrics["step_compute_s"]),
            input_time_s=float(metrics["input_time_s"]) if "input_time_s" in metrics else None,
            item_compute_s=float(metrics.get("item_compute_s", 0.0)),
            arrival_s=float(metrics["arrival_s"]) if "arrival_s" in metrics else None,
        )
    except KeyError:
        return None


def _num_samples(audio: Any) -> int:
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
                    num_samples=_num_samples(output.audio),
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
            out[s.stage_id] = out.get(s.stage_id, 0.0) + min(s.compute_s, s.wall_s)
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
        compute = min(node.compute_s, node.wall_s)
        cp.compute_s += compute
        seg["step_overhead"] += node.wall_s - compute
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


# ------------------------------------------------------------------ one request, end to end


@dataclass(frozen=True, slots=True)
class ClientArrival:
    """One output as the client read it; ``at_s`` counts from the submit."""

    at_s: float
    stage_id: int
    modality: str
    num_tokens: int
    num_samples: int
    finished: bool
    step: Step | None


@dataclass(slots=True)
class RequestTimeline:
    """What one request did, seen from the client and from every stage."""

    request_id: str
    submit_s: float
    arrivals: list[ClientArrival]
    events: list[StageEvent]
    finish_reason: str | None
    text: str
    sample_rate: int | None
    #: Codec frames the stage feeding the audio stage generated (stop tokens excluded);
    #: None when no stage feeds an audio stage.
    num_frames: int | None
    cp_first_audio: CriticalPath | None
    cp_done: CriticalPath | None

    @property
    def first_text(self) -> ClientArrival | None:
        return next((a for a in self.arrivals if a.modality == "text" and a.num_tokens), None)

    @property
    def first_audio(self) -> ClientArrival | None:
        return next((a for a in self.arrivals if a.modality == "audio" and a.num_samples), None)

    @property
    def ttft_s(self) -> float | None:
        a = self.first_text
        return None if a is None else a.at_s

    @property
    def ttfa_s(self) -> float | None:
        a = self.first_audio
        return None if a is None else a.at_s

    @property
    def total_s(self) -> float:
        return self.arrivals[-1].at_s if self.arrivals else 0.0

    @property
    def audio_chunks(self) -> list[ClientArrival]:
        return [a for a in self.arrivals if a.modality == "audio" and a.num_samples]

    @property
    def num_samples(self) -> int:
        return sum(a.num_samples for a in self.arrivals if a.modality == "audio")

    @property
    def num_text_tokens(self) -> int:
        return sum(a.num_tokens for a in self.arrivals if a.modality == "text")

    def compute_by_stage(self) -> dict[int, float]:
        """Model compute per stage for this request (its own share of each batch)."""
        out: dict[int, float] = {}
        for e in self.events:
            if e.step is not None:
                out[e.stage_id] = out.get(e.stage_id, 0.0) + e.step.item_compute_s
        return out

    def to_dict(self) -> dict[str, Any]:
        rate = self.sample_rate or 0
        return {
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "text": self.text,
            "num_text_tokens": self.num_text_tokens,
            "ttft_s": self.ttft_s,
            "ttfa_s": self.ttfa_s,
            "total_s": self.total_s,
            "sample_rate": self.sample_rate,
            "num_samples": self.num_samples,
            "audio_s": self.num_samples / rate if rate else None,
            "num_codec_frames": self.num_frames,
            "compute_by_stage_s": {str(k): v for k, v in self.compute_by_stage().items()},
            "audio_chunks": [
                {
                    "index": i,
                    "at_s": a.at_s,
                    "num_samples": a.num_samples,
                    "ms": 1000.0 * a.num_samples / rate if rate else None,
                }
                for i, a in enumerate(self.audio_chunks)
            ],
            "critical_path_first_audio": None
            if self.cp_first_audio is None
            else self.cp_first_audio.to_dict(),
            "critical_path_done": None if self.cp_done is None else self.cp_done.to_dict(),
        }


def drive_request(
    pipe: Pipeline,
    trace: StageTrace,
    prompt_token_ids: Sequence[int],
    *,
    modalities: Sequence[str] | None = None,
    sampling: Mapping[int, SamplingParams] | None = None,
    request_id: str | None = None,
    on_output: Callable[[RequestOutput, float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RequestTimeline:
    """Submit one request on ``pipe`` (started with ``on_stage_output=trace``), read every
    output, and return its timeline. ``on_output(output, seconds_since_submit)`` sees each
    output as it arrives (streaming text, writing audio).

    A failed request raises :class:`~omnirelay.errors.RequestFailedError`. An interrupt
    (``KeyboardInterrupt``) while waiting aborts the request, waits for its terminal
    output (at most 10 s), then propagates.
    """
    rid = request_id if request_id is not None else uuid.uuid4().hex
    trace.watch(rid)
    arrivals: list[ClientArrival] = []
    texts: list[str] = []
    rate: int | None = None
    reason: str | None = None
    try:
        submit_s = clock()
        handle = pipe.submit(
            list(prompt_token_ids), modalities=modalities, sampling=dict(sampling or {}), request_id=rid
        )
        try:
            for out in handle:
                at = clock() - submit_s
                n = _num_samples(out.audio)
                arrivals.append(
                    ClientArrival(
                        at_s=at,
                        stage_id=out.stage_id,
                        modality=out.modality,
                        num_tokens=len(out.token_ids),
                        num_samples=n,
                        finished=out.finished,
                        step=step_of(out.stage_id, out.metrics),
                    )
                )
                if out.text:
                    texts.append(out.text)
                if n and out.sample_rate:
                    rate = out.sample_rate
                if out.finished:
                    reason = out.finish_reason
                if on_output is not None:
                    on_output(out, at)
        except KeyboardInterrupt:
            handle.abort()
            try:
                handle.result(timeout=10.0)
            except Exception:  # the terminal, an error, or a timeout: we are leaving anyway
                pass
            raise
    finally:
        events = trace.take(rid)
    return _timeline(pipe, rid, submit_s, arrivals, events, "".join(texts), rate, reason, sampling)


def _timeline(
    pipe: Pipeline,
    rid: str,
    submit_s: float,
    arrivals: list[ClientArrival],
    events: list[StageEvent],
    text: str,
    rate: int | None,
    reason: str | None,
    sampling: Mapping[int, SamplingParams] | None,
) -> RequestTimeline:
    config = pipe.config
    upstream = upstream_map(config)
    tl = RequestTimeline(
        request_id=rid,
        submit_s=submit_s,
        arrivals=arrivals,
        events=events,
        finish_reason=reason,
        text=text,
        sample_rate=rate,
        num_frames=None,
        cp_first_audio=None,
        cp_done=None,
    )
    audio_stages = [s.id for s in config.stages if str(s.final_output_type) == "audio"]
    feeder = upstream.get(audio_stages[0]) if audio_stages else None
    if feeder is not None:
        params = (sampling or {}).get(feeder) or stage_sampling_defaults(config.stage(feeder))
        stops = set(params.stop_token_ids)
        tl.num_frames = sum(1 for e in events if e.stage_id == feeder for t in e.token_ids if t not in stops)

    forwarded = frozenset(e.dst for e in config.edges() if str(e.contract) != "chunks")

    def walk(a: ClientArrival) -> CriticalPath:
        return critical_path(
            events,
            submit_s=submit_s,
            target_s=submit_s + a.at_s,
            target_stage=a.stage_id,
            target_step=a.step,
            upstream=upstream,
            forwarded=forwarded,
        )

    first_audio = tl.first_audio
    if first_audio is not None:
        tl.cp_first_audio = walk(first_audio)
    if arrivals and reason not in ("abort", "error"):
        last = arrivals[-1]
        if last.stage_id >= 0:
            tl.cp_done = walk(last)
    return tl

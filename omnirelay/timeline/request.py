"""One request end to end: its client arrivals, its stage events, its critical paths.

* :func:`drive_request` — submit one request, read its outputs (timing each arrival),
  and return its :class:`RequestTimeline`: time to first text token and first audio,
  what a listener hears of the audio (first playable audio, gaps:
  :func:`~omnirelay.timeline.playback.playback_of`), audio chunks, codec frames, and the
  critical paths to the first audio and to the end
  (:func:`~omnirelay.timeline.critical_path.critical_path`).

Times are ``time.monotonic()``, the clock the stages' step times use too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnirelay.api import Pipeline, RequestOutput, SamplingParams, stage_sampling_defaults
from omnirelay.engine.step_recorder import Step, step_of
from omnirelay.timeline.critical_path import (
    CriticalPath,
    StageEvent,
    StageTrace,
    audio_length,
    critical_path,
    upstream_map,
)
from omnirelay.timeline.playback import Playback, playback_of

__all__ = ["ClientArrival", "RequestTimeline", "drive_request"]


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
    def playback(self) -> Playback:
        """The stream as a listener hears it (first playable audio, gaps, silence)."""
        rate = self.sample_rate or 0
        return playback_of((a.at_s, a.num_samples / rate if rate else 0.0) for a in self.audio_chunks)

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
            "playback": self.playback.to_dict(),
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


def _arrival(out: RequestOutput, at_s: float, num_samples: int) -> ClientArrival:
    return ClientArrival(
        at_s=at_s,
        stage_id=out.stage_id,
        modality=out.modality,
        num_tokens=len(out.token_ids),
        num_samples=num_samples,
        finished=out.finished,
        step=step_of(out.stage_id, out.metrics),
    )


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
    inputs: Any = None,
    buffered: bool = False,
) -> RequestTimeline:
    """Submit one request on ``pipe`` (started with ``on_stage_output=trace`` and
    ``trace_steps=True``: without step times the critical paths are empty), read every
    output, and return its timeline. ``on_output(output, seconds_since_submit)`` sees each
    output as it arrives (streaming text, writing audio). ``inputs``: the prompt stage's
    full input (a speech prompt's voice, ``SpeechPrompt.inputs``). ``buffered``: the caller
    shows nothing before the end, so a lost replica runs the request again (docs/protocol.md
    §2.9); ``on_output`` then sees the ``restarted`` output, and the timeline keeps only the
    rerun's arrivals (its times still from the first submit).

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
            list(prompt_token_ids),
            modalities=modalities,
            sampling=dict(sampling or {}),
            request_id=rid,
            inputs=inputs,
            buffered=buffered,
        )
        try:
            for out in handle:
                at = clock() - submit_s
                n = audio_length(out.audio)
                if out.restarted:  # what came before was the failed attempt's
                    arrivals.clear()
                    texts.clear()
                else:
                    arrivals.append(_arrival(out, at, n))
                if out.text and out.modality == "text":
                    texts.append(out.text)  # the answer (not a transcript's or the aligner's words)
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
    # A feeder whose own output is text (a Thinker speaking through a voice) sends words,
    # not codec frames.
    if feeder is not None and str(config.stage(feeder).final_output_type) != "text":
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

"""One request's timeline across the stages of a pipeline (``omnirelay run``, ``bench pipeline``).

* ``critical_path.py`` — :class:`StageTrace` (the front's observer of every stage's
  outputs), :func:`critical_path` (from a client output back to the submit: which steps
  it waited for, and the wall time split into model compute and the rest).
* ``request.py`` — :func:`drive_request`: one request end to end, its
  :class:`RequestTimeline`.
* ``playback.py`` — :func:`playback_of`: what a listener hears of an audio stream (first
  playable audio, gaps, silence, gap-free), the one definition every measurement uses.
* the stages' half, :class:`StepRecorder` (:mod:`omnirelay.engine.step_recorder`, where
  the API that installs it finds it): the step tracer a pipeline started with
  ``trace_steps=True`` runs in every stage, writing each step's times into its outputs'
  metrics; :func:`step_of` reads them back.
"""

from omnirelay.engine.step_recorder import STEP_METRICS, Step, StepRecorder, step_of
from omnirelay.timeline.critical_path import (
    SEGMENTS,
    CriticalPath,
    StageEvent,
    StageTrace,
    critical_path,
    steps_by_stage,
    upstream_map,
)
from omnirelay.timeline.playback import GAP_FREE_MAX_S, Playback, playback_of
from omnirelay.timeline.request import ClientArrival, RequestTimeline, drive_request

__all__ = [
    "GAP_FREE_MAX_S",
    "SEGMENTS",
    "STEP_METRICS",
    "ClientArrival",
    "CriticalPath",
    "Playback",
    "RequestTimeline",
    "StageEvent",
    "StageTrace",
    "Step",
    "StepRecorder",
    "critical_path",
    "drive_request",
    "playback_of",
    "step_of",
    "steps_by_stage",
    "upstream_map",
]

"""One request's timeline across the stages of a pipeline (``omnirelay run``, ``bench pipeline``).

* ``critical_path.py`` — :class:`StageTrace` (the front's observer of every stage's
  outputs), :func:`critical_path` (from a client output back to the submit: which steps
  it waited for, and the wall time split into model compute and the rest).
* ``request.py`` — :func:`drive_request`: one request end to end, its
  :class:`RequestTimeline`.
"""

from omnirelay.timeline.critical_path import (
    SEGMENTS,
    CriticalPath,
    StageEvent,
    StageTrace,
    Step,
    critical_path,
    step_of,
    steps_by_stage,
    upstream_map,
)
from omnirelay.timeline.request import ClientArrival, RequestTimeline, drive_request

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

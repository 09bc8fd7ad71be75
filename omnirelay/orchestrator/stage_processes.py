"""The stage worker processes as the front sees them, and what it reports about them.

* :class:`StageProcess` — one stage's worker: its process, readiness, exit and death
  reason, supervision state and restarts, the event socket the loop watches (the
  orchestrator's books, one per stage); :class:`StageState` — its lifecycle;
* :class:`StageHealth` / :class:`PipelineHealth` — ``Orchestrator.health()``'s answer;
* :class:`ShutdownReport` — what shutdown found;
* :func:`describe_exit` — an exit code in words.
"""

from __future__ import annotations

import asyncio
import enum
import signal
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

__all__ = ["PipelineHealth", "ShutdownReport", "StageHealth", "StageProcess", "StageState", "describe_exit"]


class StageState(enum.StrEnum):
    """A stage's lifecycle as the front supervises it (docs/design.md §10).

    ``starting`` → ``healthy`` (its worker said hello); ``healthy`` → ``restarting`` (the
    process died; waiting out the backoff) → ``starting`` (a new process builds its
    engine) → ``healthy``; ``restarting`` → ``failed`` when the restart policy gives up
    (or restarts are off). ``failed`` is final until the pipeline is started again.
    """

    STARTING = "starting"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    FAILED = "failed"
    #: not started: the pipeline runs without it (``PipelineOptions.audio_input=False``)
    OFF = "off"


class StageHealth(msgspec.Struct, kw_only=True):
    """One stage worker as the front sees it (and as its worker reports, when alive): a
    stage's, or one replica's of a replicated stage (``replica`` of ``replicas``)."""

    stage_id: int
    name: str
    replica: int = 0
    replicas: int = 1
    is_alive: bool
    pid: int | None
    exitcode: int | None = None
    #: requests the stage holds, by the router's books
    num_requests: int = 0
    #: requests the worker's engine holds, by the worker (None: no reply)
    queue_depth: int | None = None
    engine: dict[str, Any] | None = None
    error: str | None = None
    #: :class:`StageState` value
    state: str = StageState.HEALTHY.value
    #: restarts of this stage since the pipeline started
    num_restarts: int = 0
    #: how its last process ended (``killed by SIGKILL``), None while the first one runs
    last_exit: str | None = None
    #: while restarting or starting again: seconds until it is expected back
    retry_after_s: float | None = None


class PipelineHealth(msgspec.Struct, kw_only=True):
    is_healthy: bool
    namespace: str
    num_requests: int
    stages: list[StageHealth]
    #: admission by real-time capacity (:class:`~omnirelay.orchestrator.capacity.StreamGate`):
    #: its limit, the audio streams admitted and waiting, those running dry
    audio_streams: dict[str, int | None] = {}
    #: requests run again on another replica after theirs died (since the start)
    num_reruns: int = 0

    @property
    def is_serving(self) -> bool:
        """Every stage that was started has a healthy worker: all requests are served
        (with a replica down, on the others)."""
        up = {
            s.stage_id
            for s in self.stages
            if s.is_alive and s.error is None and s.state == StageState.HEALTHY
        }
        started = {s.stage_id for s in self.stages if s.state != StageState.OFF}
        return bool(started) and up == started

    @property
    def status(self) -> str:
        """``healthy``; ``degraded`` when a replica is down but every stage has one up;
        ``failed`` when a stage was given up on; ``restarting`` while a stage comes back;
        else ``unhealthy`` (a stage does not answer)."""
        if self.is_healthy:
            return "healthy"
        if self.is_serving:
            return "degraded"
        states = {st.state for st in self.stages}
        if StageState.FAILED in states:
            return "failed"
        if states & {StageState.RESTARTING, StageState.STARTING}:
            return "restarting"
        return "unhealthy"


class ShutdownReport(msgspec.Struct, kw_only=True):
    """What shutdown found: exit codes, and objects the final reclaim of the namespace removed."""

    exitcodes: dict[int, int | None]
    num_killed: int = 0
    num_reclaimed: int = 0
    num_objects_left: int = 0


def describe_exit(exitcode: int | None) -> str:
    """``killed by SIGKILL`` / ``exit code 1`` / ``still running``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class WorkerProcess(Protocol):
    """What the front holds of a worker: a spawned process, or a worker on a Ray node
    (:class:`omnirelay.orchestrator.ray_placement.RayWorkerProcess`)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class StageProcess:
    """One worker process of a stage as the front tracks it (the orchestrator's thread
    only): the stage's, or one replica's of a replicated stage. ``index`` is its place
    among the pipeline's workers (:meth:`PipelineConfig.workers`; the stage id when no
    stage has replicas)."""

    stage_id: int
    label: str
    name: str
    replica: int = 0
    index: int = -1
    process: WorkerProcess | None = None
    pid: int | None = None
    exitcode: int | None = None
    is_ready: bool = False
    is_exited: bool = False
    is_dead: bool = False  # cannot take requests: dead, restarting, or given up on
    death_reason: str | None = None
    said_goodbye: bool = False
    hello: asyncio.Future[None] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    #: the event socket's descriptor the loop watches (None: not watched)
    reader_fd: int | None = None
    state: StageState = StageState.STARTING
    num_restarts: int = 0
    #: how the last process ended, in words
    last_exit: str | None = None
    #: loop time when the stage is expected back (restarting / starting again)
    expected_back: float | None = None
    #: how long the last start took, spawn to hello (estimates the next one)
    startup_s: float = 0.0
    #: when the current process was spawned (monotonic)
    startup_began: float = 0.0
    #: what the current process reported before it went down (StageFatal, StartupFailed)
    cause: str | None = None
    #: never started: the pipeline runs without this stage
    is_off: bool = False

    def __post_init__(self) -> None:
        if self.index < 0:
            self.index = self.stage_id

    @property
    def process_name(self) -> str:
        """``s1`` (a stage's worker), ``s1r2`` (replica 2 of stage 1)."""
        return f"s{self.stage_id}" + (f"r{self.replica}" if self.replica else "")

    def new_process(self, process: WorkerProcess) -> None:
        """Books for a freshly spawned worker of this stage (first or restarted)."""
        self.process, self.pid = process, process.pid
        self.exitcode = None
        self.is_ready = self.is_exited = self.said_goodbye = False
        self.exited = asyncio.Event()
        self.state = StageState.STARTING
        self.cause = None

"""The stage worker processes as the front sees them, and what it reports about them.

* :class:`StageProcess` — one stage's worker: its process, readiness, exit and death
  reason, supervision state and restarts, the event socket the loop watches (the
  orchestrator's books, one per worker); :class:`StageState` — its lifecycle;
* :class:`WorkerTable` — every worker of a pipeline by its index, and which worker serves
  each replica of each stage (the one place that maps stages to worker processes);
* :class:`WorkerLaunch` — what every worker is started with, and the :class:`WorkerSpec`
  of one worker;
* :class:`StagesDown` — the stages that cannot take requests now, for callers on any thread;
* :class:`StageHealth` / :class:`PipelineHealth` — ``Orchestrator.health()``'s answer;
* :class:`ShutdownReport` — what shutdown found;
* :func:`describe_exit` — an exit code in words.
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from omnirelay.errors import StageDiedError
from omnirelay.worker import DEFAULT_ENGINE_FACTORY, WorkerSpec

if TYPE_CHECKING:
    from omnirelay.engine.tracing import StepTracer
    from omnirelay.pipeline import PipelineConfig
    from omnirelay.worker.worker_control import ControlPaths

__all__ = [
    "PipelineHealth",
    "ShutdownReport",
    "StageHealth",
    "StageProcess",
    "StageState",
    "StagesDown",
    "WorkerLaunch",
    "WorkerTable",
    "describe_exit",
]


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

    @property
    def is_up(self) -> bool:
        """Alive, healthy and answering: it serves its requests."""
        return self.is_alive and self.error is None and self.state == StageState.HEALTHY


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
        up = {s.stage_id for s in self.stages if s.is_up}
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


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What every worker of a pipeline is started with (besides its place in the pipeline)."""

    engine_factory: str = DEFAULT_ENGINE_FACTORY
    #: each stage engine's step tracer (built in its worker); None: no step timing
    tracer_factory: Callable[[], StepTracer] | None = None
    idle_wait_s: float = 1.0
    wait_slice_s: float = 0.01
    #: how long a start (a worker's hello, Ray's placement) may take
    startup_timeout_s: float = 120.0

    def spec(self, config: PipelineConfig, worker: StageProcess, paths: ControlPaths) -> WorkerSpec:
        """What ``worker`` is spawned with: the pipeline as its replica sees it."""
        return WorkerSpec(
            stage_id=worker.stage_id,
            pipeline=config.for_replica(worker.stage_id, worker.replica),
            worker=worker.index,
            paths=paths,
            parent_pid=os.getpid(),
            engine_factory=self.engine_factory,
            tracer_factory=self.tracer_factory,
            idle_wait_s=self.idle_wait_s,
            wait_slice_s=self.wait_slice_s,
        )


class WorkerTable:
    """Every worker process of a pipeline, by its index (:meth:`PipelineConfig.workers`),
    and which worker serves each replica of each stage. The orchestrator's thread only,
    except the snapshots (:meth:`pids`, :meth:`replica_pids`)."""

    def __init__(self, config: PipelineConfig) -> None:
        #: every worker, at its index (the list the supervisor watches)
        self.workers = [
            StageProcess(
                w.stage_id,
                config.stages[w.stage_id].replica_label(w.replica),
                config.stages[w.stage_id].name,
                replica=w.replica,
                index=w.index,
            )
            for w in config.workers()
        ]
        self._index = {(w.stage_id, w.replica): w.index for w in self.workers}
        self._replicas_of: dict[int, list[StageProcess]] = {s.id: [] for s in config.stages}
        for w in self.workers:
            self._replicas_of[w.stage_id].append(w)
        #: the stage's workers that said hello during the start
        self._ready_at_start: dict[int, set[int]] = {s.id: set() for s in config.stages}
        #: woken whenever a stage goes down, comes back or is given up on (:meth:`changed`)
        self._waiters: list[asyncio.Future[None]] = []

    def __getitem__(self, worker: int) -> StageProcess:
        return self.workers[worker]

    def __iter__(self) -> Iterator[StageProcess]:
        return iter(self.workers)

    def __len__(self) -> int:
        return len(self.workers)

    def serving(self, stage_id: int, replica: int) -> StageProcess:
        """The worker that runs replica ``replica`` of stage ``stage_id``."""
        return self.workers[self._index[(stage_id, replica)]]

    def replicas(self, stage_id: int) -> list[StageProcess]:
        """The workers of one stage, by replica."""
        return self._replicas_of[stage_id]

    def others_up(self, st: StageProcess) -> bool:
        """Does another worker of ``st``'s stage serve it?"""
        return any(not w.is_dead for w in self._replicas_of[st.stage_id] if w is not st)

    def turn_off(self, stage_id: int, reason: str) -> None:
        """The stage is not started: the pipeline runs without it."""
        for st in self._replicas_of[stage_id]:
            st.is_off, st.is_dead, st.state, st.death_reason = True, True, StageState.OFF, reason

    def mark_started(self) -> None:
        """Every worker that was started said hello."""
        for st in self.workers:
            if not st.is_off:
                st.state = StageState.HEALTHY

    def ready_at_start(self, worker: int) -> bool:
        """The worker said hello during the start; True when it was its stage's last."""
        st = self.workers[worker]
        ready = self._ready_at_start[st.stage_id]
        ready.add(worker)
        return len(ready) == len(self._replicas_of[st.stage_id])

    def is_ready(self) -> bool:
        """Every started stage is ``healthy`` — with replicas, each of its workers is
        ``healthy`` or ``failed``, one at least ``healthy``. Raises
        :class:`StageDiedError` when every worker of a stage is ``failed`` (given up on)."""
        started = [ws for ws in self._replicas_of.values() if not ws[0].is_off]
        for workers in started:
            if all(w.state == StageState.FAILED for w in workers):
                raise StageDiedError(workers[0].death_reason or f"{workers[0].label} failed")
        return all(
            all(w.state in (StageState.HEALTHY, StageState.FAILED) for w in workers)
            and any(w.state == StageState.HEALTHY for w in workers)
            for workers in started
        )

    def changed(self) -> None:
        """A worker went down, came back or was given up on: wake :meth:`wait_ready`."""
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once :meth:`is_ready` (at once when it is); raises what it raises, and
        :class:`TimeoutError` after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.is_ready():
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"the stages were not all healthy within {timeout_s:g} s")
            await asyncio.wait([fut], timeout=remaining)

    def pids(self) -> dict[int, int | None]:
        """Each stage's worker pid (its replica 0's; None: not running)."""
        return {st.stage_id: st.pid for st in self.workers if st.replica == 0}

    def replica_pids(self) -> dict[tuple[int, int], int | None]:
        """Every worker's pid by ``(stage id, replica)`` (None: not running)."""
        return {(st.stage_id, st.replica): st.pid for st in self.workers}

    def exitcodes(self) -> dict[int, int | None]:
        return {st.index: st.exitcode for st in self.workers}

    def local_placement(self) -> dict[int, dict[str, Any]]:
        """Where each worker of a local pipeline runs: this host."""
        host = socket.gethostname()
        return {
            w.index: {
                "node_id": "local",
                "node_ip": "127.0.0.1",
                "hostname": host,
                "stage": w.stage_id,
                "replica": w.replica,
            }
            for w in self.workers
        }

    def health(
        self,
        replies: Mapping[int, Any],
        timeout_s: float,
        num_requests: Callable[[int, int], int],
        retry_after: Callable[[StageProcess], float | None],
    ) -> list[StageHealth]:
        """Each worker's health from what the front knows and its worker's
        ``HealthReply`` (in ``replies`` by index; missing: it did not answer within
        ``timeout_s``); ``num_requests``: the router's count per (stage, replica)."""
        out = []
        for st in self.workers:
            reply = replies.get(st.index)
            is_alive = not st.is_dead and not st.is_exited
            error = None if st.is_off else st.death_reason
            if is_alive and reply is None:
                error = f"{st.label} did not answer a health request within {timeout_s:g} s"
            out.append(
                StageHealth(
                    stage_id=st.stage_id,
                    name=st.name,
                    replica=st.replica,
                    replicas=len(self._replicas_of[st.stage_id]),
                    is_alive=is_alive,
                    pid=st.pid,
                    exitcode=st.exitcode,
                    num_requests=num_requests(st.stage_id, st.replica),
                    queue_depth=None if reply is None else reply.num_requests,
                    engine=None if reply is None else reply.engine,
                    error=error,
                    state=st.state.value,
                    num_restarts=st.num_restarts,
                    last_exit=st.last_exit,
                    retry_after_s=retry_after(st),
                )
            )
        return out


class StagesDown:
    """The stages that cannot take requests now (none of their workers is up), with the
    reason and when each is expected back; thread-safe (the API asks from its callers'
    threads, the orchestrator's loop writes)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: stage id -> (reason, clock time it is expected back, or None)
        self._down: dict[int, tuple[str, float | None]] = {}

    def mark_down(self, stage_id: int, reason: str, retry_after_s: float | None) -> None:
        back = None if retry_after_s is None else self._clock() + retry_after_s
        with self._lock:
            self._down[stage_id] = (reason, back)

    def mark_up(self, stage_id: int) -> None:
        with self._lock:
            self._down.pop(stage_id, None)

    def first(self, stage_ids: range | list[int]) -> tuple[int, str, float | None] | None:
        """The first of ``stage_ids`` that is down, as ``(stage id, reason, seconds until
        it is expected back or None)``; None when none is."""
        now = self._clock()
        with self._lock:
            for sid in stage_ids:
                down = self._down.get(sid)
                if down is not None:
                    reason, back = down
                    return sid, reason, None if back is None else max(0.0, back - now)
        return None

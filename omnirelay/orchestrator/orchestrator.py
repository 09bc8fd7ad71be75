"""The front-side orchestrator: requests, the router, and what the stage workers say.

:class:`Orchestrator` lives on one asyncio event loop (the API runs it on a thread of
its own, :mod:`omnirelay.api`); every method is called on that loop's thread, so the
router, the handles map and the sockets have exactly one user.

* :meth:`Orchestrator.start` — the :class:`~omnirelay.orchestrator.supervisor.StageSupervisor`
  spawns one worker per stage (one per replica of a replicated stage) and waits for every
  hello (a failure raises :class:`StageDiedError` naming the stage).
* Replicas (docs/design.md §11): the router binds each request to one replica of each
  stage; the orchestrator sends each action to the bound replica's worker. When a replica
  dies, the requests bound to it that the client has had nothing of are run again on the
  others (the router's :class:`Rerun`, admitted once every stage released the id); a stage
  is down only when none of its replicas is up.
* :meth:`Orchestrator.admit` / :meth:`Orchestrator.abort` — requests in, by the router.
* Per stage, a reader task routes what the worker says. The supervisor watches each
  process's sentinel, so a dead worker is seen at once: the router fails every request
  that needed it with ``stage_unavailable`` (the reason names the stage, the pid and the
  signal), the stage's fences go, the connectors reclaim what the dead process owned (the
  ids it held stay fenced until then), and the stage is restarted by the pipeline's
  restart policy (or given up on). While it is down, requests that need it are refused
  at once (:meth:`Orchestrator.unavailable`); requests that do not need it are served.
* :meth:`Orchestrator.health`, :meth:`Orchestrator.leak_state` — queries over the
  control plane with a timeout.
* :meth:`Orchestrator.shutdown` — fail what is in flight, ask every worker to stop,
  wait (then SIGTERM, then SIGKILL), close the sockets, remove the socket directory,
  reclaim the namespace. Idempotent.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from omnirelay.connectors import reclaim_namespace
from omnirelay.engine.interfaces import StageOutput
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import (
    InvalidRequestError,
    OmniRelayError,
    PipelineError,
    StageDiedError,
)
from omnirelay.orchestrator.capacity import StreamGate
from omnirelay.orchestrator.front_control import FrontControl
from omnirelay.orchestrator.handle import RequestHandle
from omnirelay.orchestrator.queries import WorkerQueries
from omnirelay.orchestrator.router import (
    Action,
    ClientOutput,
    InputBuilder,
    PipelineRequest,
    RequestOutput,
    Rerun,
    Router,
    StageAbort,
    StageRelease,
    StageSubmit,
)
from omnirelay.orchestrator.stage_processes import (
    PipelineHealth,
    ShutdownReport,
    StageHealth,
    StageProcess,
    StageState,
    describe_exit,
)
from omnirelay.orchestrator.supervisor import StageSupervisor, SupervisorHooks
from omnirelay.pipeline import PipelineConfig
from omnirelay.worker import DEFAULT_ENGINE_FACTORY, WorkerSpec
from omnirelay.worker.worker_control import ControlPaths

if TYPE_CHECKING:
    from omnirelay.orchestrator.ray_placement import RayPlacement

from omnirelay.worker.messages import (
    Abort,
    Goodbye,
    HealthReply,
    HealthRequest,
    Hello,
    LeakStateReply,
    LeakStateRequest,
    Outputs,
    Release,
    Released,
    RequestFailed,
    StageFatal,
    StartupFailed,
    Submit,
    ToFront,
    stage_output,
    wire_request,
)

#: The key of the front's own books in :meth:`Orchestrator.leak_state` (no stage has it).
FRONT = -1

__all__ = [
    "FRONT",
    "Orchestrator",
    "PipelineHealth",
    "ShutdownReport",
    "StageHealth",
    "StageState",
    "describe_exit",
]


class Orchestrator:
    """Front process side of a running pipeline; see the module docstring."""

    def __init__(
        self,
        config: PipelineConfig,
        *,
        namespace: str,
        engine_factory: str = DEFAULT_ENGINE_FACTORY,
        input_builders: Mapping[int, InputBuilder] | None = None,
        startup_timeout_s: float = 120.0,
        idle_wait_s: float = 1.0,
        wait_slice_s: float = 0.01,
        on_stage_output: Callable[[StageOutput], None] | None = None,
        tracer_factory: Callable[[], StepTracer] | None = None,
        on_stage_ready: Callable[[int], None] | None = None,
        off_stages: frozenset[int] = frozenset(),
    ) -> None:
        self.config = msgspec.structs.replace(config, namespace=namespace)
        #: Sees every stage's outputs (intermediate stages too) before they are routed.
        self._on_stage_output = on_stage_output
        self.namespace = namespace
        self.router = Router(self.config, input_builders=input_builders)
        self._engine_factory = engine_factory
        #: Each stage engine's step tracer (built in its worker); None: no step timing.
        self._tracer_factory = tracer_factory
        self._startup_timeout_s = startup_timeout_s
        self._idle_wait_s = idle_wait_s
        self._wait_slice_s = wait_slice_s
        self._handles: dict[str, RequestHandle] = {}
        #: every worker process, by its index (:meth:`PipelineConfig.workers`)
        self._workers = [
            StageProcess(
                w.stage_id,
                self.config.stages[w.stage_id].replica_label(w.replica),
                self.config.stages[w.stage_id].name,
                replica=w.replica,
                index=w.index,
            )
            for w in self.config.workers()
        ]
        #: (stage id, replica) -> worker index
        self._index = {(w.stage_id, w.replica): w.index for w in self._workers}
        #: stage id -> its workers
        self._replicas_of: dict[int, list[StageProcess]] = {s.id: [] for s in self.config.stages}
        for w in self._workers:
            self._replicas_of[w.stage_id].append(w)
        #: the stage's workers that said hello during the start (for ``on_stage_ready``)
        self._ready_at_start: dict[int, set[int]] = {s.id: set() for s in self.config.stages}
        self._on_stage_ready = on_stage_ready
        self._ray: RayPlacement | None = None
        self._supervisor = StageSupervisor(
            namespace=namespace,
            stages=self._workers,
            make_spec=self._worker_spec,
            policy=self.config.restart,
            startup_timeout_s=startup_timeout_s,
            hooks=SupervisorHooks(
                stage_down=self._on_stage_down,
                stage_unavailable=self._on_stage_unavailable,
                stage_up=self._on_stage_up,
                route=self._on_message,
                read=self._read,
                stage_ready=self._on_worker_ready,
                swept=self._on_swept,
            ),
            preload=_worker_imports(self.config),
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queries = WorkerQueries(self._send)
        #: stages that cannot take requests now → (reason, retry-after s), for callers on
        #: other threads (:meth:`unavailable`); the router keeps its own copy
        self._down: dict[int, tuple[str, float | None]] = {}
        self._down_lock = threading.Lock()
        #: woken whenever a stage goes down, comes back or is given up on
        self._state_waiters: list[asyncio.Future[None]] = []
        #: The id-reuse fence: id → the stages told to release it that have not reported
        #: :class:`Released` yet. What a fenced stage says about the id belongs to the
        #: ended request (stale), never to a new one reusing the id. A dead worker's
        #: fences become its sweep's (:func:`_sweep_fence`): its objects of the id may still
        #: be claimable until the sweep withdrew them.
        self._unreleased: dict[str, set[int]] = {}
        #: A new request reusing a fenced id waits here until the last fence of the id
        #: goes: before that a stage may still hold the ended request's chunks (or be
        #: putting them) under the same keys. So does a request run again after losing a
        #: replica (with how often it ran before).
        self._parked: dict[str, tuple[PipelineRequest, RequestHandle, int]] = {}
        #: requests run again after losing a replica (a count for tests and /health)
        self.num_reruns = 0
        #: Admission by real-time capacity: the audio streams served at once, and the
        #: requests for audio waiting for a stream, in arrival order.
        self.streams = StreamGate(
            self.config.max_audio_streams, min_headroom_s=0.0 if self.config.hold_audio_while_dry else None
        )
        self._waiting: dict[str, tuple[PipelineRequest, RequestHandle]] = {}
        self._speaks = any(s.final_output and str(s.final_output_type) == "audio" for s in self.config.stages)
        self.num_stale_messages = 0
        self._is_closing = False
        self._shutdown_report: ShutdownReport | None = None
        self.num_bad_messages = 0
        #: stages not started (the pipeline runs without them); requests needing one are refused
        self.off_stages = off_stages
        for sid in off_stages:
            reason = f"{self.config.stage(sid).label} was not started (the pipeline runs without it)"
            for st in self._replicas_of[sid]:
                st.is_off, st.is_dead, st.state, st.death_reason = True, True, StageState.OFF, reason
            self.router.set_unavailable(sid, reason, None)
            self._down[sid] = (reason, None)

    # -- startup -------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the workers and wait until each built its engine; raises on failure
        (after tearing down whatever was started)."""
        self._loop = asyncio.get_running_loop()
        try:
            await self._start()
        except BaseException:
            await self.shutdown(timeout_s=5.0)
            raise

    async def _start(self) -> None:
        if self.config.placement.is_ray:
            await self._place_on_ray()
        await self._supervisor.start()
        for st in self._workers:
            if not st.is_off:
                st.state = StageState.HEALTHY

    async def _place_on_ray(self) -> None:
        """Connect to the Ray cluster and place the stages (blocking calls: off the loop)."""
        from omnirelay.orchestrator.ray_placement import RayPlacement

        placement = self._ray = RayPlacement(self.config, timeout_s=self._startup_timeout_s)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, placement.connect)
        self.config = await loop.run_in_executor(None, placement.place)
        self._supervisor.use_placement(placement.process, placement.front_ip)

    def pids(self) -> dict[int, int | None]:
        """Each stage's worker pid (its replica 0's; None: not running). A snapshot; safe
        from any thread."""
        return {st.stage_id: st.pid for st in self._workers if st.replica == 0}

    def replica_pids(self) -> dict[tuple[int, int], int | None]:
        """Every worker's pid by ``(stage id, replica)`` (None: not running). A snapshot;
        safe from any thread."""
        return {(st.stage_id, st.replica): st.pid for st in self._workers}

    def placement_report(self) -> dict[int, dict[str, Any]]:
        """Where each worker runs (node id, address, host name; with ``stage`` and
        ``replica``), by worker index (the stage id when no stage has replicas); this host
        for a local pipeline."""
        if self._ray is not None:
            return self._ray.describe()
        host = socket.gethostname()
        return {
            w.index: {
                "node_id": "local",
                "node_ip": "127.0.0.1",
                "hostname": host,
                "stage": w.stage_id,
                "replica": w.replica,
            }
            for w in self._workers
        }

    @property
    def _control(self) -> FrontControl | None:
        return self._supervisor.control

    def _worker_spec(self, worker: int, paths: ControlPaths) -> WorkerSpec:
        w = self._workers[worker]
        return WorkerSpec(
            stage_id=w.stage_id,
            pipeline=self.config.for_replica(w.stage_id, w.replica),
            worker=worker,
            paths=paths,
            parent_pid=os.getpid(),
            engine_factory=self._engine_factory,
            tracer_factory=self._tracer_factory,
            idle_wait_s=self._idle_wait_s,
            wait_slice_s=self._wait_slice_s,
        )

    # -- requests ------------------------------------------------------------------------

    def admit(self, request: PipelineRequest, handle: RequestHandle, num_reruns: int = 0) -> None:
        """Admit one request (validated by the API); its outputs go to ``handle``.
        ``num_reruns``: how often it ran before (a :class:`Rerun` admitted again)."""
        rid = request.request_id
        if self._is_closing:
            self.streams.release(rid)
            handle.deliver(_error_output(rid, "the pipeline is shutting down"))
            return
        if rid in self._handles or rid in self._parked or rid in self._waiting:
            handle.deliver(_error_output(rid, f"request id {rid!r} is already in flight"))
            return
        if rid in self._unreleased:
            # admitted once the stages released the id
            self._parked[rid] = (request, handle, num_reruns)
            return
        # A request for audio takes a stream first; behind earlier waiters, or while the gate
        # is shut, it waits (a stream ends, or the one running dry catches up).
        waits = self._is_audio(request) and rid not in self.streams
        if waits and (self._waiting or self.streams.try_acquire(rid) is not None):
            self._waiting[rid] = (request, handle)
            return
        try:
            actions = self.router.admit(request, num_reruns=num_reruns)
        except InvalidRequestError as exc:
            self.streams.release(rid)
            handle.deliver(_error_output(rid, str(exc)))
            return
        self._handles[rid] = handle
        self._execute(actions)

    def _is_audio(self, request: PipelineRequest) -> bool:
        return self.is_audio_modalities(request.modalities)

    def is_audio_modalities(self, modalities: tuple[str, ...] | None) -> bool:
        """Whether a request for ``modalities`` takes an audio stream (None: every output)."""
        return self._speaks and (modalities is None or "audio" in modalities)

    @property
    def num_waiting(self) -> int:
        """Requests for audio waiting for a stream (readable from any thread)."""
        return len(self._waiting)

    def _admit_waiting(self) -> None:
        """Admit waiting requests for audio, first come first served, while the gate lets."""
        while self._waiting:
            rid, (request, handle) = next(iter(self._waiting.items()))
            if self.streams.try_acquire(rid) is not None:
                return
            del self._waiting[rid]
            self.admit(request, handle)

    def abort(self, request_id: str) -> None:
        """Abort a request in flight; unknown (ended) ids are a no-op."""
        parked = self._parked.pop(request_id, None) or self._waiting.pop(request_id, None)
        if parked is not None:
            self.streams.release(request_id)  # a parked reuse (or rerun) may hold its stream
            parked[1].deliver(
                RequestOutput(
                    request_id=request_id, stage_id=-1, modality="", finished=True, finish_reason="abort"
                )
            )
            self._admit_waiting()
            return
        self._execute(self.router.abort(request_id))

    @property
    def num_requests(self) -> int:
        return self.router.num_requests

    # -- carrying out the router's decisions -------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        """Carry out the router's actions: the stage messages first, in order, then the
        client outputs, in order. A request's last output comes with its releases: the
        stages get them before the client (who may submit the next request at once)
        competes with this thread."""
        queue: deque[Action] = deque(actions)
        outputs: list[RequestOutput] = []
        reruns: list[Rerun] = []
        while queue:
            action = queue.popleft()
            if isinstance(action, ClientOutput):
                outputs.append(action.output)
            elif isinstance(action, StageSubmit):
                queue.extend(self._submit(action))
            elif isinstance(action, StageAbort):
                self._send(self._worker_of(action.stage_id, action.replica), Abort(action.request_id))
            elif isinstance(action, StageRelease):
                worker = self._worker_of(action.stage_id, action.replica)
                if self._send(worker, Release(action.request_id)):
                    self._unreleased.setdefault(action.request_id, set()).add(worker)
            elif isinstance(action, Rerun):
                reruns.append(action)
        for output in outputs:
            self._deliver(output)
        for rerun in reruns:
            self._rerun(rerun)

    def _worker_of(self, stage_id: int, replica: int) -> int:
        return self._index[(stage_id, replica)]

    def _rerun(self, rerun: Rerun) -> None:
        """A request that lost a replica before its client had anything: admit it again,
        under the same id, once every stage released it (parked behind the id's fences)."""
        rid = rerun.request.request_id
        handle = self._handles.pop(rid, None)
        if handle is None:
            return
        self.num_reruns += 1
        self.admit(rerun.request, handle, num_reruns=rerun.num_reruns)

    def _submit(self, action: StageSubmit) -> list[Action]:
        rid = action.request.request_id
        if rid not in self.router:  # the request ended earlier in this batch of actions
            return []
        st = self._workers[self._worker_of(action.stage_id, action.replica)]
        if st.is_dead:
            return self.router.fail(
                rid, st.death_reason or f"{st.label} is not running", stage_id=st.stage_id
            )
        try:
            message = Submit(wire_request(action.request))
        except OmniRelayError as exc:
            return self.router.fail(rid, f"{st.label}: its input cannot be sent: {exc}", stage_id=st.stage_id)
        if not self._send(st.index, message):
            reason = f"{st.label} worker process (pid {st.pid}) is unreachable"
            return self._stage_failed(st.index, reason)
        return []

    def _is_fenced(self, worker: int, request_id: str) -> bool:
        workers = self._unreleased.get(request_id)
        return workers is not None and worker in workers

    def _lift_fence(self, worker: int, request_id: str) -> None:
        """The worker released the id (or died); admit a parked reuse (or rerun) of the id
        once no worker is left to release it."""
        workers = self._unreleased.get(request_id)
        if workers is None or worker not in workers:
            return
        workers.discard(worker)
        if workers:
            return
        del self._unreleased[request_id]
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            self.admit(*parked)

    def _send(self, worker: int, message: Any) -> bool:
        return self._supervisor.send(worker, message)

    def _deliver(self, output: RequestOutput) -> None:
        rid = output.request_id
        handle = self._handles.get(rid)
        if handle is None:
            return
        if output.finished:
            del self._handles[rid]
        handle.deliver(output)
        if rid in self.streams:
            if output.audio is not None and output.sample_rate:
                self.streams.note_audio(rid, _num_samples(output.audio) / output.sample_rate)
            if output.finished or (output.modality == "audio" and output.stage_finished):
                self.streams.release(rid)
            if self._waiting:
                self._admit_waiting()

    # -- what workers say -------------------------------------------------------------------

    def _read(self, worker: int) -> None:
        """The worker's event socket may have messages: route the ones queued, a bounded
        batch at a time (the other workers' messages and the clients' calls get their
        turn in between)."""
        control = self._control
        if control is None:
            return
        try:
            messages, num_bad, has_more = control.recv_ready(worker, _READ_BATCH)
        except zmq.ZMQError:  # the context was terminated at shutdown
            return
        if has_more:
            assert self._loop is not None
            self._loop.call_soon(self._read, worker)
        self.num_bad_messages += num_bad
        for message in messages:
            try:
                self._on_message(worker, message)
            except Exception as exc:  # a bug: report it, and still route the rest of the burst
                assert self._loop is not None
                label = self._workers[worker].label
                self._loop.call_exception_handler(
                    {"message": f"routing a message of {label} failed", "exception": exc}
                )

    def _on_message(self, worker: int, message: ToFront) -> None:
        st = self._workers[worker]
        stage_id = st.stage_id
        if isinstance(message, Outputs):
            for wire in message.outputs:
                if self._is_fenced(worker, wire.request_id):
                    self.num_stale_messages += 1
                    continue
                try:
                    out = stage_output(wire)
                except OmniRelayError as exc:
                    reason = f"{st.label}: its output cannot be decoded: {exc}"
                    self._execute(self.router.fail(wire.request_id, reason, stage_id=stage_id))
                    continue
                if self._on_stage_output is not None:
                    self._on_stage_output(out)
                self._execute(self.router.on_output(out, st.replica))
        elif isinstance(message, RequestFailed):
            if self._is_fenced(worker, message.request_id):
                self.num_stale_messages += 1
                return
            if self.router.binding(message.request_id).get(stage_id, st.replica) != st.replica:
                self.num_stale_messages += 1  # an earlier binding's replica (a rerun's)
                return
            reason = f"{st.label}: {message.error}"
            self._execute(self.router.fail(message.request_id, reason, stage_id=stage_id))
        elif isinstance(message, Released):
            self._lift_fence(worker, message.request_id)
        elif isinstance(message, HealthReply | LeakStateReply):
            self._queries.answer(message.seq, message)
        elif isinstance(message, Hello):
            if st.pid is None:  # a worker on a Ray node: its pid comes with its hello
                st.pid = message.pid
            if message.capacity:
                self.router.set_capacity(stage_id, st.replica, message.capacity)
            self._supervisor.on_hello(st)
        elif isinstance(message, StartupFailed):
            st.cause = f"{st.label} failed to start (pid {message.pid}): {message.error}"
            self._supervisor.fail_hello(st, st.cause)
            self._on_stage_down(worker, st.cause, st.cause, None)
        elif isinstance(message, StageFatal):
            st.cause = f"{st.label} failed: {message.error}"
            self._on_stage_down(worker, st.cause, st.cause, None)
        elif isinstance(message, Goodbye):
            st.said_goodbye = True

    def _stage_failed(
        self, worker: int, reason: str, retry_after_s: float | None = None, *, swept_later: bool = False
    ) -> list[Action]:
        """Mark the worker dead (once) and act on every request bound to it: run again on
        another replica the ones the client has had nothing of, fail the others with
        ``stage_unavailable`` (docs/protocol.md §2.8: each is released in every stage).

        ``swept_later``: the worker's process is gone and the supervisor sweeps its objects
        next (:meth:`_on_swept`). Until then the ids it held stay fenced: a reader that
        mapped one of its slots could still claim an object of the ended request under
        the key a reuse of the id puts."""
        st = self._workers[worker]
        if st.is_dead:
            return []
        st.is_dead = True
        actions = self.router.on_replica_died(st.stage_id, st.replica, reason, retry_after_s=retry_after_s)
        sweep = _sweep_fence(worker)
        if swept_later:
            for action in actions:
                rid = (
                    action.request.request_id
                    if isinstance(action, Rerun | StageSubmit)
                    else action.request_id
                )
                self._unreleased.setdefault(rid, set()).add(sweep)
        for rid in [rid for rid, workers in self._unreleased.items() if worker in workers]:
            # No Released will come; a parked reuse is admitted (and fails at once when it
            # needs this stage) — after the sweep, when it follows.
            if swept_later:
                self._unreleased[rid].add(sweep)
            self._lift_fence(worker, rid)
        return actions

    def _on_swept(self, worker: int) -> None:
        """The dead worker's objects are withdrawn and reclaimed: lift its sweep's fences."""
        sweep = _sweep_fence(worker)
        for rid in [rid for rid, workers in self._unreleased.items() if sweep in workers]:
            self._lift_fence(sweep, rid)

    def _others_up(self, st: StageProcess) -> bool:
        """Does another worker of ``st``'s stage serve it?"""
        return any(not w.is_dead for w in self._replicas_of[st.stage_id] if w is not st)

    # -- supervision hooks (docs/design.md §10) -----------------------------------------------

    def _on_stage_down(self, worker: int, reason: str, unavailable: str, retry_after_s: float | None) -> None:
        """A worker's process died. When it was its stage's last one up, new requests that
        need the stage are refused with ``unavailable`` from now on (on every thread)
        before the in-flight ones are failed with ``reason`` — a client that resubmits as
        soon as its request failed already hears that the stage is restarting. A replica
        of a stage whose other replicas are up only takes its requests with it (those the
        client has had nothing of run again elsewhere)."""
        st = self._workers[worker]
        if self._others_up(st):
            st.death_reason = unavailable
            actions = self._stage_failed(worker, reason, retry_after_s, swept_later=True)
            self._execute(actions)
            self._wake_state_waiters()
            return
        self._on_stage_unavailable(worker, unavailable, retry_after_s)
        actions = self._stage_failed(worker, reason, retry_after_s, swept_later=True)
        self.router.set_unavailable(st.stage_id, unavailable, retry_after_s)  # over the death's reason
        self._execute(actions)

    def _on_stage_unavailable(self, worker: int, reason: str, retry_after_s: float | None) -> None:
        st = self._workers[worker]
        st.death_reason = reason
        if self._others_up(st):
            self._wake_state_waiters()  # another replica serves the stage
            return
        self.router.set_unavailable(st.stage_id, reason, retry_after_s)
        back = None if retry_after_s is None else time.monotonic() + retry_after_s
        with self._down_lock:
            self._down[st.stage_id] = (reason, back)
        self._wake_state_waiters()

    def _on_stage_up(self, worker: int) -> None:
        st = self._workers[worker]
        self.router.on_replica_back(st.stage_id, st.replica)
        with self._down_lock:
            self._down.pop(st.stage_id, None)
        self._wake_state_waiters()

    def _on_worker_ready(self, worker: int) -> None:
        """A worker said hello during the start: the stage is ready once all its replicas are."""
        st = self._workers[worker]
        ready = self._ready_at_start[st.stage_id]
        ready.add(worker)
        if self._on_stage_ready is not None and len(ready) == len(self._replicas_of[st.stage_id]):
            self._on_stage_ready(st.stage_id)

    def _wake_state_waiters(self) -> None:
        waiters, self._state_waiters = self._state_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once every worker is ``healthy`` (at once when they are), or, for a
        stage with replicas, ``failed`` beside a healthy one. Raises
        :class:`StageDiedError` when every worker of a stage is ``failed`` (given up on)
        and :class:`TimeoutError` after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            started = [ws for ws in self._replicas_of.values() if not ws[0].is_off]
            for workers in started:
                if all(w.state == StageState.FAILED for w in workers):
                    raise StageDiedError(workers[0].death_reason or f"{workers[0].label} failed")
            if all(
                all(w.state in (StageState.HEALTHY, StageState.FAILED) for w in workers)
                and any(w.state == StageState.HEALTHY for w in workers)
                for workers in started
            ):
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._state_waiters.append(fut)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"the stages were not all healthy within {timeout_s:g} s")
            await asyncio.wait([fut], timeout=remaining)

    def unavailable(self, stage_ids: range | list[int]) -> tuple[int, str, float | None] | None:
        """The first of ``stage_ids`` that cannot take requests now (none of its replicas
        is up), as ``(stage id, reason, seconds until it is expected back or None)``; None
        when all can. Any thread."""
        now = time.monotonic()
        with self._down_lock:
            for sid in stage_ids:
                down = self._down.get(sid)
                if down is not None:
                    reason, back = down
                    return sid, reason, None if back is None else max(0.0, back - now)
        return None

    # -- queries --------------------------------------------------------------------------

    async def health(self, timeout_s: float = 2.0) -> PipelineHealth:
        """Per worker (a stage, or each of its replicas): alive, pid, exit, requests held,
        the engine's health, its supervision state and restarts."""
        replies = await self._queries.ask(self._workers, HealthRequest, timeout_s)
        stages = []
        for st in self._workers:
            reply: HealthReply | None = replies.get(st.index)
            is_alive = not st.is_dead and not st.is_exited
            error = None if st.is_off else st.death_reason
            if is_alive and reply is None:
                error = f"{st.label} did not answer a health request within {timeout_s:g} s"
            stages.append(
                StageHealth(
                    stage_id=st.stage_id,
                    name=st.name,
                    replica=st.replica,
                    replicas=len(self._replicas_of[st.stage_id]),
                    is_alive=is_alive,
                    pid=st.pid,
                    exitcode=st.exitcode,
                    num_requests=self.router.num_requests_on(st.stage_id, st.replica),
                    queue_depth=None if reply is None else reply.num_requests,
                    engine=None if reply is None else reply.engine,
                    error=error,
                    state=st.state.value,
                    num_restarts=st.num_restarts,
                    last_exit=st.last_exit,
                    retry_after_s=self._supervisor.retry_after(st),
                )
            )
        return PipelineHealth(
            is_healthy=all(
                s.is_alive and s.error is None and s.state == StageState.HEALTHY
                for s in stages
                if s.state != StageState.OFF
            ),
            namespace=self.namespace,
            num_requests=self.router.num_requests,
            stages=stages,
            audio_streams=self.streams.health(num_queued=len(self._waiting)).to_dict(),
            num_reruns=self.num_reruns,
        )

    async def leak_state(self, timeout_s: float = 5.0, settle_s: float = 2.0) -> dict[int, dict[str, Any]]:
        """``{worker: {"worker": ..., "engine": ...}}`` of every live worker (keyed by its
        index: the stage id when no stage has replicas), each taken once the worker's
        in-flight cleanup settled (at most ``settle_s``), and under :data:`FRONT` the
        front's own per-request books when any is left (audio streams admitted, requests
        waiting for one or parked)."""
        replies = await self._queries.ask(
            self._workers, lambda seq: LeakStateRequest(seq, settle_s), timeout_s + settle_s
        )
        missing = [st.label for st in self._workers if not st.is_dead and st.index not in replies]
        if missing:
            raise PipelineError(f"no leak-state reply from {', '.join(missing)} within {timeout_s:g} s")
        books: dict[int, dict[str, Any]] = {index: reply.state for index, reply in replies.items()}
        front = {
            **self.streams.leak_state(),
            **({"waiting": sorted(self._waiting)} if self._waiting else {}),
            **({"parked": sorted(self._parked)} if self._parked else {}),
        }
        if front:
            books[FRONT] = {"front": front}
        return books

    # -- shutdown -------------------------------------------------------------------------

    async def shutdown(self, timeout_s: float = 10.0) -> ShutdownReport:
        """Stop everything; idempotent (a second call returns the first report)."""
        if self._shutdown_report is not None:
            return self._shutdown_report
        self._is_closing = True
        self._execute(self.router.fail_all("the pipeline is shutting down"))
        handles = [(rid, p[1]) for rid, p in self._parked.items()]
        handles += [(rid, w[1]) for rid, w in self._waiting.items()]
        self._parked.clear()
        self._waiting.clear()
        for rid, handle in handles:
            self.streams.release(rid)
            handle.deliver(_error_output(rid, "the pipeline is shutting down"))
        num_killed = await self._supervisor.stop(timeout_s)
        if self._ray is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._ray.close)
        self._queries.cancel_all()
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(None, lambda: reclaim_namespace(self.namespace))
        self._shutdown_report = ShutdownReport(
            exitcodes={st.index: st.exitcode for st in self._workers},
            num_killed=num_killed,
            num_reclaimed=len(report.reclaimed),
            num_objects_left=len(report.objects) - len(report.reclaimed),
        )
        return self._shutdown_report


def _sweep_fence(worker: int) -> int:
    """The fence a dead worker's sweep holds on an id (never a worker's index)."""
    return -1 - worker


#: Messages of one stage routed per loop callback (see :meth:`Orchestrator._read`).
_READ_BATCH = 64


def _num_samples(audio: Any) -> int:
    numel = getattr(audio, "numel", None)
    return int(numel()) if callable(numel) else len(audio)


def _error_output(request_id: str, reason: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, stage_id=-1, modality="", finished=True, finish_reason="error", error=reason
    )


def _worker_imports(config: PipelineConfig) -> tuple[str, ...]:
    """What the pipeline's stage workers import to build their models (the fork server
    imports it once; :mod:`omnirelay.worker.processes`)."""
    from omnirelay.models import worker_imports

    return worker_imports(config)

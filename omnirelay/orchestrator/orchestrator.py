"""The front-side orchestrator: requests, the router, and what the stage workers say.

:class:`Orchestrator` lives on one asyncio event loop (the API runs it on a thread of
its own, :mod:`omnirelay.api`); every method is called on that loop's thread. It is a
shell over parts that keep their own books, each with its own tests: the
:class:`~omnirelay.orchestrator.router.Router` (one request's path; with replicas, which
replica serves it, docs/design.md §11), the :class:`~omnirelay.orchestrator.fence.IdFence`
(the id-reuse fence and the requests parked behind it), the
:class:`~omnirelay.orchestrator.capacity.StreamQueue` in front of the audio-stream gate, and
the :class:`~omnirelay.orchestrator.stage_processes.WorkerTable` (which worker serves which
replica of which stage), whose processes the
:class:`~omnirelay.orchestrator.supervisor.StageSupervisor` spawns, watches and restarts
(docs/design.md §10). What is left here is carrying out the router's actions, routing
what the workers say, and what a worker's death means for requests:

* the requests a dead worker held that the client has had nothing of run again on
  another replica (the router's :class:`Rerun`, parked until every stage released the
  id); the others fail with ``stage_unavailable``. The dead process's ids stay fenced
  until the supervisor swept its objects;
* a stage none of whose workers is up refuses new requests at once
  (:meth:`Orchestrator.unavailable`, any thread) until it is back; requests that do not
  need it are served.

:meth:`Orchestrator.shutdown` fails what is in flight, stops the workers and reclaims the
namespace; it is idempotent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from omnirelay.connectors import reclaim_namespace
from omnirelay.engine.interfaces import StageOutput
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import InvalidRequestError, OmniRelayError, PipelineError
from omnirelay.orchestrator.capacity import StreamGate, StreamQueue
from omnirelay.orchestrator.fence import IdFence
from omnirelay.orchestrator.front_control import FrontControl
from omnirelay.orchestrator.handle import RequestHandle
from omnirelay.orchestrator.queries import WorkerQueries
from omnirelay.orchestrator.requests import InputBuilder, PipelineRequest, RequestOutput
from omnirelay.orchestrator.router import (
    Action,
    ClientOutput,
    Rerun,
    Router,
    StageAbort,
    StageRelease,
    StageSubmit,
)
from omnirelay.orchestrator.stage_processes import (
    PipelineHealth,
    ShutdownReport,
    StageProcess,
    StagesDown,
    StageState,
    WorkerLaunch,
    WorkerTable,
)
from omnirelay.orchestrator.supervisor import StageSupervisor, SupervisorHooks
from omnirelay.pipeline import PipelineConfig
from omnirelay.worker import DEFAULT_ENGINE_FACTORY, WorkerSpec
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
from omnirelay.worker.worker_control import ControlPaths

if TYPE_CHECKING:
    from omnirelay.orchestrator.ray_placement import RayPlacement

#: The key of the front's own books in :meth:`Orchestrator.leak_state` (no stage has it).
FRONT = -1

__all__ = ["FRONT", "Orchestrator"]

#: A request parked behind the id-reuse fence: its handle, and how often it ran before.
_Parked = tuple[PipelineRequest, RequestHandle, int]
#: A request for audio waiting for a stream.
_Waiting = tuple[PipelineRequest, RequestHandle]


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
        self.namespace = namespace
        self._init_requests(input_builders, on_stage_output)
        self._init_capacity()
        launch = WorkerLaunch(engine_factory, tracer_factory, idle_wait_s, wait_slice_s, startup_timeout_s)
        self._init_workers(launch, on_stage_ready)
        self._init_off_stages(off_stages)

    def _init_requests(
        self,
        input_builders: Mapping[int, InputBuilder] | None,
        on_stage_output: Callable[[StageOutput], None] | None,
    ) -> None:
        """The router, the clients' handles, the id-reuse fence and the counters."""
        self.router = Router(self.config, input_builders=input_builders)
        self._handles: dict[str, RequestHandle] = {}
        #: ids not yet released by every stage told to, and the requests parked behind
        #: them: a new request reusing the id, or one run again after losing a replica
        self._fence: IdFence[_Parked] = IdFence()
        #: sees every stage's outputs (intermediate stages too) before they are routed
        self._on_stage_output = on_stage_output
        #: requests run again after losing a replica (a count for tests and /health)
        self.num_reruns = 0
        #: what fenced stages said about ids they were told to release (dropped)
        self.num_stale_messages = 0
        self._is_closing = False
        self._shutdown_report: ShutdownReport | None = None

    def _init_capacity(self) -> None:
        """Admission by real-time capacity: the audio streams served at once, and the
        requests for audio waiting for a stream, in arrival order."""
        brake = 0.0 if self.config.hold_audio_while_dry else None
        self.streams = StreamGate(self.config.max_audio_streams, min_headroom_s=brake)
        speaks = any(s.final_output and str(s.final_output_type) == "audio" for s in self.config.stages)
        self._waiting: StreamQueue[_Waiting] = StreamQueue(self.streams, speaks=speaks)

    def _init_workers(self, launch: WorkerLaunch, on_stage_ready: Callable[[int], None] | None) -> None:
        """The worker table, the supervisor that runs its processes, and the stage state
        other threads read."""
        from omnirelay.models import worker_imports  # what the workers import to build their models

        self._launch = launch
        self._workers = WorkerTable(self.config)
        self._on_stage_ready = on_stage_ready
        self._ray: RayPlacement | None = None
        self._supervisor = StageSupervisor(
            namespace=self.namespace,
            stages=self._workers.workers,
            make_spec=self._worker_spec,
            policy=self.config.restart,
            startup_timeout_s=launch.startup_timeout_s,
            hooks=SupervisorHooks(
                stage_down=self._on_stage_down,
                stage_unavailable=self._on_stage_unavailable,
                stage_up=self._on_stage_up,
                route=self._on_message,
                stage_ready=self._on_worker_ready,
                swept=self._on_swept,
            ),
            preload=worker_imports(self.config),  # the fork server imports them once
        )
        self._queries = WorkerQueries(self._send)
        #: stages that cannot take requests now, for callers on other threads
        #: (:meth:`unavailable`); the router keeps its own copy
        self._down = StagesDown()

    def _init_off_stages(self, off_stages: frozenset[int]) -> None:
        #: stages not started (the pipeline runs without them); requests needing one are refused
        self.off_stages = off_stages
        for sid in off_stages:
            reason = f"{self.config.stage(sid).label} was not started (the pipeline runs without it)"
            self._workers.turn_off(sid, reason)
            self.router.set_unavailable(sid, reason, None)
            self._down.mark_down(sid, reason, None)

    # -- startup -------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the workers and wait until each built its engine; raises on failure
        (after tearing down whatever was started)."""
        try:
            if self.config.placement.is_ray:
                await self._place_on_ray()
            await self._supervisor.start()
        except BaseException:
            await self.shutdown(timeout_s=5.0)
            raise
        self._workers.mark_started()

    async def _place_on_ray(self) -> None:
        """Connect to the Ray cluster and place the stages (blocking calls: off the loop)."""
        from omnirelay.orchestrator.ray_placement import RayPlacement

        placement = self._ray = RayPlacement(self.config, timeout_s=self._launch.startup_timeout_s)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, placement.connect)
        self.config = await loop.run_in_executor(None, placement.place)
        self._supervisor.use_placement(placement.process, placement.front_ip)

    def _worker_spec(self, worker: int, paths: ControlPaths) -> WorkerSpec:
        return self._launch.spec(self.config, self._workers[worker], paths)

    @property
    def _control(self) -> FrontControl | None:
        return self._supervisor.control

    def pids(self) -> dict[int, int | None]:
        """Each stage's worker pid (its replica 0's; None: not running). A snapshot; safe
        from any thread."""
        return self._workers.pids()

    def replica_pids(self) -> dict[tuple[int, int], int | None]:
        """Every worker's pid by ``(stage id, replica)`` (None: not running). A snapshot;
        safe from any thread."""
        return self._workers.replica_pids()

    def placement_report(self) -> dict[int, dict[str, Any]]:
        """Where each worker runs (node id, address, host name; with ``stage`` and
        ``replica``), by worker index (the stage id when no stage has replicas); this host
        for a local pipeline."""
        if self._ray is not None:
            return self._ray.describe()
        return self._workers.local_placement()

    # -- requests ------------------------------------------------------------------------

    def admit(self, request: PipelineRequest, handle: RequestHandle, num_reruns: int = 0) -> None:
        """Admit one request (validated by the API); its outputs go to ``handle``.
        ``num_reruns``: how often it ran before (a :class:`Rerun` admitted again)."""
        rid = request.request_id
        if self._is_closing:
            self.streams.release(rid)
            handle.deliver(_last_output(rid, "error", "the pipeline is shutting down"))
            return
        if rid in self._handles or self._fence.is_parked(rid) or rid in self._waiting:
            handle.deliver(_last_output(rid, "error", f"request id {rid!r} is already in flight"))
            return
        if self._fence.is_fenced(rid):
            self._fence.park(rid, (request, handle, num_reruns))  # admitted once the stages released it
            return
        # A request for audio takes a stream first; behind earlier waiters, or while the gate
        # is shut, it waits (a stream ends, or the one running dry catches up).
        if self._waiting.enter(rid, request.modalities, (request, handle)):
            return
        try:
            actions = self.router.admit(request, num_reruns=num_reruns)
        except InvalidRequestError as exc:
            self.streams.release(rid)
            handle.deliver(_last_output(rid, "error", str(exc)))
            return
        self._handles[rid] = handle
        self._execute(actions)

    def is_audio_modalities(self, modalities: tuple[str, ...] | None) -> bool:
        """Whether a request for ``modalities`` takes an audio stream (None: every output)."""
        return self._waiting.takes_stream(modalities)

    @property
    def num_waiting(self) -> int:
        """Requests for audio waiting for a stream (readable from any thread)."""
        return len(self._waiting)

    def _admit_waiting(self) -> None:
        """Admit waiting requests for audio, first come first served, while the gate lets."""
        while (waiter := self._waiting.pop_admitted()) is not None:
            self.admit(*waiter)

    def abort(self, request_id: str) -> None:
        """Abort a request in flight; unknown (ended) ids are a no-op."""
        parked = self._fence.unpark(request_id) or self._waiting.withdraw(request_id)
        if parked is not None:
            self.streams.release(request_id)  # a parked reuse (or rerun) may hold its stream
            parked[1].deliver(_last_output(request_id, "abort"))
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
                st = self._workers.serving(action.stage_id, action.replica)
                self._send(st.index, Abort(action.request_id))
            elif isinstance(action, StageRelease):
                st = self._workers.serving(action.stage_id, action.replica)
                if self._send(st.index, Release(action.request_id)):
                    self._fence.hold(action.request_id, st.index)
            elif isinstance(action, Rerun):
                reruns.append(action)
        for output in outputs:
            self._deliver(output)
        for rerun in reruns:
            self._rerun(rerun)

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
        st = self._workers.serving(action.stage_id, action.replica)
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

    def _admit_parked(self, freed: list[_Parked]) -> None:
        """Admit what the fence let go (a reuse of an id, or a rerun), in order."""
        for parked in freed:
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
            self.streams.note_audio(rid, _audio_seconds(output))
            if output.finished or (output.modality == "audio" and output.stage_finished):
                self.streams.release(rid)
            self._admit_waiting()

    # -- what workers say -------------------------------------------------------------------

    def _on_message(self, worker: int, message: ToFront) -> None:
        st = self._workers[worker]
        if isinstance(message, Outputs):
            self._on_outputs(st, message)
        elif isinstance(message, RequestFailed):
            if self._fence.holds(worker, message.request_id):
                self.num_stale_messages += 1
                return
            if self.router.binding(message.request_id).get(st.stage_id, st.replica) != st.replica:
                self.num_stale_messages += 1  # an earlier binding's replica (a rerun's)
                return
            reason = f"{st.label}: {message.error}"
            self._execute(self.router.fail(message.request_id, reason, stage_id=st.stage_id))
        elif isinstance(message, Released):
            self._admit_parked(self._fence.lift(worker, message.request_id))
        elif isinstance(message, HealthReply | LeakStateReply):
            self._queries.answer(message.seq, message)
        elif isinstance(message, Hello):
            if st.pid is None:  # a worker on a Ray node: its pid comes with its hello
                st.pid = message.pid
            if message.capacity:
                self.router.set_capacity(st.stage_id, st.replica, message.capacity)
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

    def _on_outputs(self, st: StageProcess, message: Outputs) -> None:
        """Route a worker's outputs, dropping those of ids it is fenced on (stale)."""
        for wire in message.outputs:
            if self._fence.holds(st.index, wire.request_id):
                self.num_stale_messages += 1
                continue
            try:
                out = stage_output(wire)
            except OmniRelayError as exc:
                reason = f"{st.label}: its output cannot be decoded: {exc}"
                self._execute(self.router.fail(wire.request_id, reason, stage_id=st.stage_id))
                continue
            if self._on_stage_output is not None:
                self._on_stage_output(out)
            self._execute(self.router.on_output(out, st.replica))

    def _stage_failed(
        self, worker: int, reason: str, retry_after_s: float | None = None, *, swept_later: bool = False
    ) -> list[Action]:
        """Mark the worker dead (once) and act on every request bound to it: run again on
        another replica the ones the client has had nothing of, fail the others with
        ``stage_unavailable`` (docs/protocol.md §2.8: each is released in every stage).

        ``swept_later``: the worker's process is gone and the supervisor sweeps its objects
        next (:meth:`_on_swept`). Until then the ids it held stay fenced: a reader that
        mapped one of its slots could still claim an object of the ended request under
        the key a reuse of the id puts. Otherwise its fences go now (no ``Released`` will
        come), and a parked reuse is admitted (failing at once when it needs this stage)."""
        st = self._workers[worker]
        if st.is_dead:
            return []
        st.is_dead = True
        actions = self.router.on_replica_died(st.stage_id, st.replica, reason, retry_after_s=retry_after_s)
        ended = [_request_id_of(action) for action in actions]
        self._admit_parked(self._fence.worker_died(worker, ended=ended, swept_later=swept_later))
        return actions

    def _on_swept(self, worker: int) -> None:
        """The dead worker's objects are withdrawn and reclaimed: lift its sweep's fences."""
        self._admit_parked(self._fence.swept(worker))

    # -- supervision hooks (docs/design.md §10) -----------------------------------------------

    def _on_stage_down(self, worker: int, reason: str, unavailable: str, retry_after_s: float | None) -> None:
        """A worker's process died. When it was its stage's last one up, new requests that
        need the stage are refused with ``unavailable`` from now on (on every thread)
        before the in-flight ones are failed with ``reason`` — a client that resubmits as
        soon as its request failed already hears that the stage is restarting. A replica
        of a stage whose other replicas are up only takes its requests with it (those the
        client has had nothing of run again elsewhere)."""
        st = self._workers[worker]
        if self._workers.others_up(st):
            st.death_reason = unavailable
            actions = self._stage_failed(worker, reason, retry_after_s, swept_later=True)
            self._execute(actions)
            self._workers.changed()
            return
        self._on_stage_unavailable(worker, unavailable, retry_after_s)
        actions = self._stage_failed(worker, reason, retry_after_s, swept_later=True)
        self.router.set_unavailable(st.stage_id, unavailable, retry_after_s)  # over the death's reason
        self._execute(actions)

    def _on_stage_unavailable(self, worker: int, reason: str, retry_after_s: float | None) -> None:
        st = self._workers[worker]
        st.death_reason = reason
        if not self._workers.others_up(st):  # else another replica serves the stage
            self.router.set_unavailable(st.stage_id, reason, retry_after_s)
            self._down.mark_down(st.stage_id, reason, retry_after_s)
        self._workers.changed()

    def _on_stage_up(self, worker: int) -> None:
        st = self._workers[worker]
        self.router.on_replica_back(st.stage_id, st.replica)
        self._down.mark_up(st.stage_id)
        self._workers.changed()

    def _on_worker_ready(self, worker: int) -> None:
        """A worker said hello during the start: the stage is ready once all its replicas are."""
        if self._workers.ready_at_start(worker) and self._on_stage_ready is not None:
            self._on_stage_ready(self._workers[worker].stage_id)

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once every worker is ``healthy`` (at once when they are), or, for a
        stage with replicas, ``failed`` beside a healthy one. Raises
        :class:`StageDiedError` when every worker of a stage is ``failed`` (given up on)
        and :class:`TimeoutError` after ``timeout_s``."""
        await self._workers.wait_ready(timeout_s)

    def unavailable(self, stage_ids: range | list[int]) -> tuple[int, str, float | None] | None:
        """The first of ``stage_ids`` that cannot take requests now (none of its replicas
        is up), as ``(stage id, reason, seconds until it is expected back or None)``; None
        when all can. Any thread."""
        return self._down.first(stage_ids)

    # -- queries --------------------------------------------------------------------------

    async def health(self, timeout_s: float = 2.0) -> PipelineHealth:
        """Per worker (a stage, or each of its replicas): alive, pid, exit, requests held,
        the engine's health, its supervision state and restarts."""
        replies = await self._queries.ask(self._workers, HealthRequest, timeout_s)
        stages = self._workers.health(
            replies, timeout_s, self.router.num_requests_on, self._supervisor.retry_after
        )
        return PipelineHealth(
            is_healthy=all(s.is_up for s in stages if s.state != StageState.OFF),
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
        waiting, parked = self._waiting.waiting_ids(), self._fence.parked_ids()
        front = {
            **self.streams.leak_state(),
            **({"waiting": waiting} if waiting else {}),
            **({"parked": parked} if parked else {}),
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
        handles = [(rid, parked[1]) for rid, parked in self._fence.drain()]
        handles += [(rid, waiter[1]) for rid, waiter in self._waiting.drain()]
        for rid, handle in handles:
            self.streams.release(rid)
            handle.deliver(_last_output(rid, "error", "the pipeline is shutting down"))
        num_killed = await self._supervisor.stop(timeout_s)
        loop = asyncio.get_running_loop()
        if self._ray is not None:
            await loop.run_in_executor(None, self._ray.close)
        self._queries.cancel_all()
        report = await loop.run_in_executor(None, lambda: reclaim_namespace(self.namespace))
        self._shutdown_report = ShutdownReport(
            exitcodes=self._workers.exitcodes(),
            num_killed=num_killed,
            num_reclaimed=len(report.reclaimed),
            num_objects_left=len(report.objects) - len(report.reclaimed),
        )
        return self._shutdown_report


def _request_id_of(action: Action) -> str:
    return action.request.request_id if isinstance(action, Rerun | StageSubmit) else action.request_id


def _audio_seconds(output: RequestOutput) -> float:
    """Seconds of audio in ``output`` (0 without audio)."""
    audio = output.audio
    if audio is None or not output.sample_rate:
        return 0.0
    numel = getattr(audio, "numel", None)
    return (int(numel()) if callable(numel) else len(audio)) / output.sample_rate


def _last_output(rid: str, finish_reason: str, error: str | None = None) -> RequestOutput:
    """The front's own last output of a request that is at no stage (any more)."""
    return RequestOutput(
        request_id=rid, stage_id=-1, modality="", finished=True, finish_reason=finish_reason, error=error
    )

"""The stage engine: scheduler + executor + transfer adapter of one stage, one tick at a time.

:class:`StageEngine` implements :class:`~omnirelay.engine.interfaces.StageEngineProtocol`.

Threads. ``step`` / ``take_released`` / ``has_work`` / ``wait_for_work`` run on the
stage's engine thread (the worker loop). ``add_request``, ``abort``, ``release``, ``wake``
and ``shutdown`` may be called from any thread: they only append a command to the inbox
and wake the engine thread; the next ``step`` applies the commands first, so aborts and
releases land at step boundaries.

One tick (``step``)::

    apply commands (add / abort / release)
    events = adapter.poll_events()                   # ready chunks, failures, stall timeouts,
                                                     # retired sender generations
    sched = scheduler.schedule(events)               # pure
    adapter.load_async(...) for the requests that parked, and (AR receivers) for the next
        chunk of every request this tick steps: it is fetched during the step
    results = executor.step(batch) for each batch    # one call per tick when batching
    update = scheduler.update_from_output(sched, results)
    adapter.load_async(...) for the requests that parked after their step (a generation
        receiver: deferred to the next step or wait, after the outputs went out)
    adapter.save_async(...) for each step's next_stage_output, and the terminal at finish,
        only when the request's final_stage_id > this stage (a text-only request never puts)
    -> StageOutputs (streamed per step, or once at the finish when ``stream`` is false)

Waiting. ``wait_for_work`` blocks on one condition (the adapter's event box, or the
engine's own when it has no adapter) that a ready chunk, a transfer failure or a command
wakes. Parked requests are never polled by the engine; an idle stage wakes only when
something arrives or the caller's timeout ends.

Timing. Given a ``tracer`` (:class:`~omnirelay.engine.tracing.StepTracer`), the engine
and its adapter report each executor call, each chunk made ready and taken, and each
output a step made; the tracer may add keys to those outputs' ``metrics``. Without one
(the default) no timing work is done.

Ownership at the finish of a request:

* normal finish after a terminal chunk was admitted: only the receive side is released
  here; the adapter cleans the send side itself once the terminal is put, then its
  generation retires (``events.retired_senders``) and the engine drops the request's last
  entry;
* abort, failure, or nothing sent: ``adapter.cleanup(internal, external)`` at once;
* ``release(request_id)``: all of the above, and ``connector.cleanup_prefix`` of the
  incoming ``"{id}_{source}_"`` (the arrival notices of it nobody read are forgotten), then
  — once no sender generation of the id is left — ``connector.cleanup_prefix("{id}_{stage}_")``
  for chunks nobody read. The
  release is then complete: ``take_released()`` hands the id out once (release as data,
  the way vLLM's scheduler reports finished requests). A stage that sends nothing for
  the id completes it in the step that applies it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from omnirelay.connectors.base import Connector
from omnirelay.engine.generation_scheduler import GenerationScheduler
from omnirelay.engine.intake import admission_problem, stage_sampling
from omnirelay.engine.interfaces import BatchItem, Executor, StageOutput, StageRequest
from omnirelay.engine.launched import Call, Tick
from omnirelay.engine.need import (
    DECODER_STEP_TOKENS,
    DECODER_URGENT_HEADROOM_S,
    FRAMES_URGENT_HEADROOM_S,
    NeedPolicy,
)
from omnirelay.engine.request import Request, RequestStatus, make_internal_id
from omnirelay.engine.scheduler import ARScheduler
from omnirelay.engine.scheduler_base import BaseScheduler, ChunkLoad, RequestUpdate, describe_failure
from omnirelay.engine.stage_output import OutputBuilder
from omnirelay.engine.stage_roles import StageRoles, resolve_stage_roles
from omnirelay.engine.tracing import StepTracer
from omnirelay.errors import ConfigError, PipelineError
from omnirelay.pipeline.config import ExecutionType, PipelineConfig, StageConfig
from omnirelay.transfer import (
    ChunkProcessor,
    SaveResult,
    TransferAdapter,
    TransferConfig,
    TransferEvents,
)
from omnirelay.transfer.keys import key_prefix
from omnirelay.transfer.wakeup import Parker, wake_all

__all__ = ["StageEngine"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Add:
    request: StageRequest


@dataclasses.dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Release:
    request_id: str


_Command = _Add | _Abort | _Release


def need_policy(stage: StageConfig, roles: StageRoles, processor: Any) -> NeedPolicy | None:
    """How the stage picks a tick's requests by need (:mod:`omnirelay.engine.need`), or
    None (every running request): a chunk-receiving generation stage (Code2Wav) by the
    audio it decoded, an AR stage whose tokens are codec frames (the Talker: its
    processor names ``frame_seconds``) by its frames; any other stage steps everyone."""
    if stage.execution_type is ExecutionType.GENERATION:
        if roles.receive_from_stage is None:
            return None
        return NeedPolicy(headroom_s=DECODER_URGENT_HEADROOM_S, max_step_tokens=DECODER_STEP_TOKENS)
    frame_s = getattr(processor, "frame_seconds", None)
    if not isinstance(frame_s, float | int) or frame_s <= 0:
        return None
    return NeedPolicy(headroom_s=FRAMES_URGENT_HEADROOM_S, seconds_per_token=float(frame_s))


def _build_scheduler(
    stage: StageConfig,
    roles: StageRoles,
    executor: Executor,
    clock: Callable[[], float],
    processor: Any = None,
    by_need: bool = False,
) -> BaseScheduler:
    """The stage's scheduler: the generation scheduler for a generation stage (with the
    executor's chunk reader: what a committed chunk means is the consuming model's
    business, docs/protocol.md §4.9), else the AR scheduler."""
    common: dict[str, Any] = {
        "stage_id": stage.id,
        "max_num_seqs": stage.max_num_seqs,
        "receives_chunks": roles.receive_from_stage is not None,
        "supports_batching": bool(executor.supports_batching),
        "max_num_batched_tokens": stage.max_num_batched_tokens,
        "clock": clock,
    }
    # A device group's stage picks each tick's requests by need (need_policy).
    need = need_policy(stage, roles, processor) if by_need else None
    if stage.execution_type is ExecutionType.GENERATION:
        return GenerationScheduler(chunk_reader=getattr(executor, "read_chunk", None), need=need, **common)
    # An AR receiver (a Talker) needs a chunk for every step and it is usually there
    # already: fetch it while the executor computes the step before (chunk prefetch).
    pieces = stage.max_prefill_piece_tokens
    if pieces is not None and not getattr(executor, "supports_prefill_pieces", False):
        raise ConfigError(
            f"{stage.label}: max_prefill_piece_tokens is set but executor {type(executor).__name__} "
            "cannot take a prompt in pieces (it does not declare supports_prefill_pieces); "
            "remove the key"
        )
    return ARScheduler(prefetch_chunks=True, need=need, max_prefill_piece_tokens=pieces, **common)


class StageEngine:
    """One stage in one process; see the module docstring."""

    def __init__(
        self,
        stage_config: StageConfig | int,
        pipeline_config: PipelineConfig,
        executor: Executor,
        connector: Connector | None,
        *,
        processor: ChunkProcessor | None = None,
        transfer_config: TransferConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer: StepTracer | None = None,
        use_launch: bool = True,
        schedule_by_need: bool = False,
    ) -> None:
        stage = pipeline_config.stage(stage_config)
        self._init_stage(stage, pipeline_config, executor, clock, tracer)
        self._init_executor(executor, processor, use_launch=use_launch, schedule_by_need=schedule_by_need)
        self._init_inbox()
        self._init_transfer(connector, processor, transfer_config)
        self._init_books()

    def _init_stage(
        self,
        stage: StageConfig,
        pipeline_config: PipelineConfig,
        executor: Executor,
        clock: Callable[[], float],
        tracer: StepTracer | None,
    ) -> None:
        self.stage_id = stage.id
        self.stage = stage
        self.pipeline = pipeline_config
        self.roles: StageRoles = resolve_stage_roles(pipeline_config, stage)
        if str(executor.execution_type) != str(stage.execution_type):
            raise ConfigError(
                f"{stage.label}: executor {type(executor).__name__} has execution_type "
                f"{executor.execution_type!r} but the stage is {str(stage.execution_type)!r}"
            )
        self._clock = clock
        #: Per-step timing, off unless given (:mod:`omnirelay.engine.tracing`).
        self._tracer = tracer

    def _init_executor(
        self,
        executor: Executor,
        processor: ChunkProcessor | None,
        *,
        use_launch: bool,
        schedule_by_need: bool,
    ) -> None:
        self._executor = executor
        #: the executor splits a step into launch and completion (``launch``), and this
        #: engine uses it (``use_launch``: in a device group, where a loop overlaps stages)
        self._launches = use_launch and callable(getattr(executor, "launch", None))
        #: the tick launched and not yet completed (:meth:`launch_step`)
        self._tick: Tick | None = None
        #: told whenever this engine may have work (:meth:`set_wake_listener`)
        self._wake_listener: Callable[[], None] | None = None
        self._scheduler = _build_scheduler(
            self.stage, self.roles, executor, self._clock, processor, schedule_by_need
        )
        #: A generation receiver's next chunk (Code2Wav: the next decode window) is far
        #: away: it registers once the step's outputs are on their way (see
        #: :meth:`_load_deferred`), so its first poll does not compete with them.
        self._defers_loads = isinstance(self._scheduler, GenerationScheduler)
        self._deferred_loads: list[ChunkLoad] = []
        #: while a step's results are applied: the send workers its saves will wake
        self._save_wakes: list[Parker] | None = None

    def _init_inbox(self) -> None:
        # Inbox: commands from any thread. ``_cond`` guards it and ``_is_closed``.
        self._cond = threading.Condition()
        self._inbox: deque[_Command] = deque()
        self._is_closed = False
        self._is_wake_pending = False

    def _init_transfer(
        self,
        connector: Connector | None,
        processor: ChunkProcessor | None,
        transfer_config: TransferConfig | None,
    ) -> None:
        stage, tracer = self.stage, self._tracer
        self._connector = connector
        self._adapter: TransferAdapter | None = None
        if self.roles.has_transfer:
            if connector is None:
                raise ConfigError(
                    f"{stage.label} sends or receives chunks ({self.roles}); it needs a connector"
                )
            config = self.roles.transfer_config(stage, self.pipeline, transfer_config)
            self._adapter = TransferAdapter(
                connector,
                config,
                processor=processor,
                clock=self._clock,
                on_chunk_ready=None if tracer is None else tracer.chunk_ready,
            )
        elif transfer_config is not None:
            raise ConfigError(f"{stage.label} has no chunk edge; it takes no transfer_config")

    def _init_books(self) -> None:
        # Engine-thread state (guarded by ``_step_lock`` for readers on other threads).
        self._step_lock = threading.RLock()
        self._live: dict[str, str] = {}  # external id -> internal id of its live request
        self._sending: dict[str, str] = {}  # finished, terminal admitted, generation not retired
        self._releasing: set[str] = set()  # released ids whose sender generation has not retired
        self._released: list[str] = []  # completed releases, until take_released() hands them out
        self._outputs = OutputBuilder(self.stage.id)
        self._seq = 0
        self._counts: dict[str, int] = dict.fromkeys(
            ("num_steps", "num_executor_calls", "num_items", "max_batch_size", "num_executor_errors",
             "num_release_errors", "num_outputs", "num_added", "num_rejected", "num_aborted",
             "num_released", "num_prefix_cleanups", "num_keys_released", "num_saves",
             "num_transfer_failures", "num_idle_waits", "num_wakeups"),
            0,
        )  # fmt: skip
        self._finish_counts: dict[str, int] = {}
        self.last_error: str | None = None

    # ----------------------------------------------------------------- commands (any thread)

    def add_request(self, request: StageRequest) -> None:
        """Queue a request; the next ``step`` admits it (or answers with an error output)."""
        self._post(_Add(request))

    def abort(self, request_id: str) -> None:
        """Abort the live request with this external id at the next step boundary; its
        final output has ``finish_reason="abort"``. No-op for an unknown id."""
        self._post(_Abort(request_id))

    def release(self, request_id: str) -> None:
        """No stage needs the request any more: drop its state here (silently aborting it
        if still live) and every transfer object this stage still owns for it. Idempotent."""
        self._post(_Release(request_id))

    def wake(self) -> None:
        """End the current (or the next) ``wait_for_work`` early, for example so the worker
        loop sees its stop flag."""
        with self._cond:
            self._is_wake_pending = True
        self._notify()

    def _post(self, command: _Command) -> None:
        with self._cond:
            if self._is_closed:
                raise PipelineError(f"stage {self.stage_id} engine is shut down")
            self._inbox.append(command)
        self._notify()

    def _notify(self) -> None:
        if self._adapter is not None:
            self._adapter.kick()  # tells the listener too
            return
        with self._cond:
            self._cond.notify_all()
        if self._wake_listener is not None:
            self._wake_listener()

    def set_wake_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener()`` (from any thread, under no lock of the engine) whenever
        this engine may have new work: a command, a ready chunk, a transfer failure, a
        retired sender. The loop of a device group waits on one waker for all its
        engines (:mod:`omnirelay.worker.group`) instead of in ``wait_for_work``."""
        self._wake_listener = listener
        if self._adapter is not None:
            self._adapter.set_event_listener(listener)

    def _has_commands(self) -> bool:
        # Lock-free on purpose: it runs under the adapter's event lock (see wait_for_work).
        return bool(self._inbox) or self._is_closed or self._is_wake_pending

    # ----------------------------------------------------------------- reports (engine thread)

    def take_released(self) -> list[str]:
        """The ids whose release completed since the last call, each once (engine thread;
        the worker loop calls it after every ``step``). A completed release: this stage
        holds no state and no transfer object of the id, and creates none under it."""
        with self._step_lock:
            released, self._released = self._released, []
            return released

    def num_requests(self) -> int:
        """Requests this engine holds (admitted, not yet finished, aborted or released)."""
        return len(self._live)

    def limit_slots(self, num_slots: int) -> int:
        """Run at most ``num_slots`` requests at once (the executor's KV slots, sized at
        startup from the device memory); returns the stage's limit now. Before any request."""
        sched = self._scheduler
        sched.max_num_seqs = max(1, min(sched.max_num_seqs, num_slots))
        return sched.max_num_seqs

    # ----------------------------------------------------------------- waiting (engine thread)

    def has_work(self) -> bool:
        """Would ``step`` do anything now? Parked requests waiting for chunks don't count."""
        if self._inbox or self._scheduler.has_work():
            return True
        return self._adapter is not None and self._adapter.wait_events(0)

    def wait_for_work(self, timeout: float) -> bool:
        """Block until there is work or ``timeout`` seconds passed; True if there is work.

        Wakes on a command, a ready chunk or a transfer failure — never on a timer of its
        own. Stall timeouts are collected by ``step``, so call ``step`` at least every
        timeout (the worker loop does).
        """
        self._load_deferred()
        if self.has_work():
            return True
        self._counts["num_idle_waits"] += 1
        if self._adapter is not None:
            woke = self._adapter.wait_events(timeout, wake_if=self._has_commands)
        else:
            with self._cond:
                woke = self._cond.wait_for(self._has_commands, timeout)
        if woke:
            self._counts["num_wakeups"] += 1
        self._is_wake_pending = False
        return woke or self.has_work()

    # ----------------------------------------------------------------- the tick

    def step(self) -> list[StageOutput]:
        """Apply commands, run one scheduler tick and its executor calls; the outputs.
        (:meth:`launch_step` then :meth:`complete_step`, which waits for the calls.)"""
        self.launch_step()
        return self.complete_step()

    def launch_step(self) -> bool:
        """The first half of a tick: apply commands, schedule, and launch the executor
        calls (an executor with ``launch`` enqueues its work and returns at once, see
        :class:`~omnirelay.engine.interfaces.PendingStep`; any other one runs its step
        here). True while a call is still running. Commands posted from now on wait for
        the next tick: an abort between launch and completion lands after the step."""
        with self._step_lock:
            if self._tick is not None:
                raise PipelineError(f"stage {self.stage_id}: a step is in flight; complete it first")
            outputs: list[StageOutput] = []
            self._tick = Tick(outputs)
            if self._is_closed:
                return False
            self._counts["num_steps"] += 1
            self._load_deferred()
            for command in self._take_commands():
                self._apply_command(command, outputs)
            events = self._poll_transfer(outputs)
            sched = self._tick.sched = self._scheduler.schedule(events)
            self._load(sched.chunk_loads)
            for request in sched.finished:
                self._finish(request, None, outputs)
            self._tick.calls = [self._launch_executor(batch) for batch in sched.batches]
            return not self.is_step_done()

    def is_step_done(self) -> bool:
        """Has every executor call of the launched tick ended? (Polls; never blocks.)"""
        tick = self._tick
        return tick is None or all(call.is_done() for call in tick.calls)

    def complete_step(self) -> list[StageOutput]:
        """The second half of a tick: the calls' results (waiting for those still running)
        go to the scheduler; the tick's outputs. ``[]`` when nothing was launched."""
        with self._step_lock:
            tick, self._tick = self._tick, None
            if tick is None or self._is_closed:
                return []
            outputs = tick.outputs
            sched = tick.sched
            if sched is not None and sched.batches:
                results = [self._end_call(call) for call in tick.calls]
                update = self._scheduler.update_from_output(sched, results)
                if self._defers_loads:
                    self._deferred_loads.extend(update.chunk_loads)
                else:
                    self._load(update.chunk_loads)
                # The step's chunks are admitted first, then the send workers woken once:
                # woken per chunk, a worker took the thread (and the GIL) at every row.
                wakes: list[Parker] = []
                self._save_wakes = wakes
                try:
                    for u in update.updates:
                        self._apply_update(u, outputs)
                finally:
                    self._save_wakes = None
                    wake_all(wakes)
            self._counts["num_outputs"] += len(outputs)
            return outputs

    def _launch_executor(self, batch: tuple[BatchItem, ...]) -> Call:
        """Start one executor call: launched (an executor with ``launch``) or run now."""
        self._counts["num_executor_calls"] += 1
        self._counts["num_items"] += len(batch)
        self._counts["max_batch_size"] = max(self._counts["max_batch_size"], len(batch))
        if self._tracer is not None:
            self._tracer.call_started(batch)
        call = Call(batch)
        try:
            if self._launches:
                call.pending = self._executor.launch(list(batch))  # type: ignore[attr-defined]
            else:
                call.value = self._executor.step(list(batch))
        except Exception as exc:
            call.value = exc
        return call

    def _end_call(self, call: Call) -> Any:
        """One executor call's results, or the exception it raised (which fails this
        batch's requests, not the stage)."""
        if call.pending is not None:
            try:
                call.value = call.pending.result()
            except Exception as exc:
                call.value = exc
            call.pending = None
        if isinstance(call.value, Exception):
            failure = call.value
            self._counts["num_executor_errors"] += 1
            self.last_error = f"executor: {type(failure).__name__}: {failure}"
        elif self._tracer is not None:
            self._tracer.call_ended(call.batch)
        return call.value

    def _take_commands(self) -> list[_Command]:
        with self._cond:
            commands = list(self._inbox)
            self._inbox.clear()
        return commands

    def _apply_command(self, command: _Command, outputs: list[StageOutput]) -> None:
        if isinstance(command, _Add):
            self._apply_add(command.request, outputs)
        elif isinstance(command, _Abort):
            iid = self._live.get(command.request_id)
            request = None if iid is None else self._scheduler.abort(iid)
            if request is not None:
                self._counts["num_aborted"] += 1
                self._finish(request, None, outputs)
        else:
            self._apply_release(command.request_id)

    def _apply_add(self, sr: StageRequest, outputs: list[StageOutput]) -> None:
        ext = sr.request_id
        sampling = stage_sampling(self.stage, sr.sampling)
        problem = admission_problem(
            sr, sampling, stage=self.stage, roles=self.roles, is_active=ext in self._live
        )
        if problem is not None:
            self._counts["num_rejected"] += 1
            outputs.append(self._outputs.rejected(ext, problem))
            return
        self._seq += 1
        request = Request(
            internal_id=make_internal_id(ext, self.stage_id, self._seq),
            external_id=ext,
            stage_id=self.stage_id,
            prompt_token_ids=list(sr.prompt_token_ids),
            sampling=sampling,
            arrival_time=self._clock(),
            is_placeholder=sr.is_placeholder,
            inputs=sr.inputs,
            final_stage_id=sr.final_stage_id,
            stream=sr.stream,
            extras=sr.extras,
            send_to_replica=sr.send_to_replica,
        )
        self._live[ext] = request.internal_id
        self._counts["num_added"] += 1
        self._scheduler.add_request(request)

    def _apply_release(self, ext: str) -> None:
        self._counts["num_released"] += 1
        iid = self._live.get(ext)
        if iid is not None:
            request = self._scheduler.abort(iid)
            assert request is not None, iid
            self._cleanup(request, terminal_admitted=False)  # silent: nobody waits for it
        source = self.roles.receive_from_stage
        if source is not None and self._connector is not None:
            # Notices received for the id and never read (a dead producer's) must not answer
            # the id once it is reused; a connector forgets them here (docs/protocol.md §3.5).
            self._counts["num_keys_released"] += self._connector.cleanup_prefix(key_prefix(ext, source))
        adapter = self._adapter
        if adapter is None or not self.roles.is_sender:
            self._released.append(ext)  # nothing of the id is left here
            return
        sending = self._sending.get(ext)
        if sending is not None:
            adapter.cleanup(sending, ext)  # cancel; a queued terminal still goes out first
        self._releasing.add(ext)
        self._settle_sender(ext)  # else the generation's retirement settles it, after its last put

    def _settle_sender(self, ext: str) -> None:
        """A sender generation of ``ext`` retired (or none is left): what waited for it may
        proceed — once no generation of the id is left, a pending release completes."""
        assert self._adapter is not None
        owner = self._adapter.sender_owner(ext)
        sending = self._sending.get(ext)
        if sending is not None and owner != sending:
            del self._sending[ext]  # its terminal is out (or dropped): nothing more to say
        if owner is not None or ext not in self._releasing:
            return  # a newer generation of a reused id: its own retirement settles the rest
        self._releasing.discard(ext)
        assert self._connector is not None
        self._counts["num_prefix_cleanups"] += 1
        self._counts["num_keys_released"] += self._connector.cleanup_prefix(key_prefix(ext, self.stage_id))
        self._released.append(ext)

    def _poll_transfer(self, outputs: list[StageOutput]) -> TransferEvents | None:
        adapter = self._adapter
        if adapter is None:
            return None
        events = adapter.poll_events()
        if self._tracer is not None and events.ready:
            self._tracer.chunks_taken(c.internal_id for c in events.ready)
        adapter.take_external_failures()  # the engine reports failures through its outputs
        for f in (*events.failed, *events.timed_out):
            self._counts["num_transfer_failures"] += 1
            if f.internal_id in self._scheduler.requests:
                continue  # the scheduler fails it this tick
            if self._sending.get(f.external_id) == f.internal_id:
                # The request finished here but its chunks did not get out: say so.
                outputs.append(self._outputs.late_error(f.external_id, describe_failure(f)))
                self._finish_counts["error"] = self._finish_counts.get("error", 0) + 1
            adapter.cleanup(f.internal_id, f.external_id)
        for ext in events.retired_senders:
            self._settle_sender(ext)
        return events

    def _load(self, loads: tuple[ChunkLoad, ...] | list[ChunkLoad]) -> None:
        if loads:
            assert self._adapter is not None
            wakes: list[Parker] = []  # the receive workers, woken once all are registered
            try:
                for iid, ext in loads:
                    self._adapter.load_async(iid, ext, wakes=wakes)
            finally:
                wake_all(wakes)

    def load_deferred(self) -> None:
        """Register the chunk loads the last step deferred now (engine thread). A device
        group's loop calls it once a completed step's outputs went out: it never waits in
        :meth:`wait_for_work`, and a parked request's chunk that arrives unregistered wakes
        nothing, so it would wait for whatever next steps this stage."""
        self._load_deferred()

    def _load_deferred(self) -> None:
        """Register the chunk loads the last step deferred (engine thread: at the start of
        the next step, or before waiting). Nothing can finish their requests in between:
        commands are applied by ``step``, after this."""
        if self._deferred_loads:
            loads, self._deferred_loads = self._deferred_loads, []
            self._load(loads)

    # ----------------------------------------------------------------- results

    def _apply_update(self, update: RequestUpdate, outputs: list[StageOutput]) -> None:
        request = update.request
        problem = self._save(update)
        if not request.is_finished:
            out = self._outputs.step(update)
            if out is not None:
                if self._tracer is not None:
                    self._tracer.output_made(request, out)
                outputs.append(out)
            return
        self._finish(request, update, outputs, problem=problem)

    def _save(self, update: RequestUpdate) -> str | None:
        """``save_async`` this step's output (and the terminal at the finish) when a later
        stage needs this request. Returns why a terminal could not be admitted."""
        request = update.request
        adapter = self._adapter
        if adapter is None or not self.roles.is_sender or request.final_stage_id <= self.stage_id:
            return None  # docs/protocol.md §10.8: no consumer, no chunk
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return None  # no terminal: the cleanup cancels the generation
        is_terminal = request.is_finished
        if not is_terminal and (update.next_stage_output is None or update.is_recompute):
            return None
        ext = request.external_id
        self._counts["num_saves"] += 1
        admission = adapter.save_async(
            request.internal_id,
            ext,
            update.next_stage_output,
            context=request.snapshot(update.new_token_ids),
            is_finished=is_terminal,
            to_replica=request.send_to_replica,
            wakes=self._save_wakes,
        )
        if not is_terminal:
            return None  # a rejection is recorded as a failure: the next tick fails the request
        if admission is SaveResult.ENQUEUED:
            # Its retirement, reported at the earliest by the next poll, drops the entry.
            self._sending[ext] = request.internal_id
            return None
        draining = (
            " (its external id still drains from an earlier request)" if adapter.is_draining(ext) else ""
        )
        return f"the terminal chunk for stage {self.roles.send_to_stage} was {admission.value}{draining}"

    def _finish(
        self,
        request: Request,
        update: RequestUpdate | None,
        outputs: list[StageOutput],
        problem: str | None = None,
    ) -> None:
        """A request left the scheduler: its final output, then its resources."""
        terminal_admitted = problem is None and request.external_id in self._sending
        if terminal_admitted:
            assert self._sending[request.external_id] == request.internal_id
        reason = "error" if problem is not None else (request.status.finish_reason or "error")
        self._finish_counts[reason] = self._finish_counts.get(reason, 0) + 1
        out = self._outputs.final(request, update, error=problem)
        if update is not None and self._tracer is not None:
            self._tracer.output_made(request, out)  # made by this tick's step
        outputs.append(out)
        self._cleanup(request, terminal_admitted=terminal_admitted)

    def _cleanup(self, request: Request, *, terminal_admitted: bool) -> None:
        iid, ext = request.internal_id, request.external_id
        if self._live.get(ext) == iid:
            del self._live[ext]
        self._outputs.drop(iid)
        try:
            self._executor.release(iid)
        except Exception as exc:
            self._counts["num_release_errors"] += 1
            self.last_error = f"executor.release({iid!r}): {type(exc).__name__}: {exc}"
        if self._adapter is not None:
            if terminal_admitted:
                self._adapter.cleanup_receiver(iid)  # the send side cleans up after the terminal
            else:
                self._adapter.cleanup(iid, ext)
        if self._tracer is not None:
            self._tracer.request_done(iid)  # after the receiver's cleanup: no commit can follow

    # ----------------------------------------------------------------- operations

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the adapter's queues are idle and reap consumed keys until no
        progress is made (tests, audits). False on timeout."""
        if self._adapter is None:
            return True
        deadline = time.monotonic() + timeout
        previous = None
        while True:
            if not self._adapter.flush(max(0.0, deadline - time.monotonic())):
                return False
            pending = len(self._connector.pending_keys()) if self._connector is not None else 0
            if pending == 0 or pending == previous:
                return True
            previous = pending

    def health(self) -> dict[str, Any]:
        return {
            "status": "closed" if self._is_closed else "healthy",
            "stage_id": self.stage_id,
            "stage": self.stage.name,
            "execution_type": str(self.stage.execution_type),
            "send_to_stage": self.roles.send_to_stage,
            "receive_from_stage": self.roles.receive_from_stage,
            "supports_batching": bool(self._executor.supports_batching),
            "scheduler": self._scheduler.stats(),
            "num_live": len(self._live),
            "num_sending": len(self._sending),
            "num_finished_by_reason": dict(self._finish_counts),
            **self._counts,
            "last_error": self.last_error,
            "transfer": None if self._adapter is None else self._adapter.health(),
        }

    def leak_state(self) -> dict[str, Any]:
        """Every non-empty per-request map of the engine, its executor and its adapter."""
        with self._step_lock:
            out: dict[str, Any] = {f"scheduler.{k}": v for k, v in self._scheduler.leak_state().items()}
            with self._cond:
                inbox = [repr(c) for c in self._inbox]
            maps: dict[str, Any] = {
                "live": dict(self._live),
                "sending": dict(self._sending),
                "releasing": sorted(self._releasing),
                "unreported_releases": list(self._released),
                "inbox": inbox,
                "outputs": self._outputs.leak_state(),
            }
            out.update({k: v for k, v in maps.items() if v})
            executor_leaks = getattr(self._executor, "leak_state", None)
            if callable(executor_leaks) and (leaks := executor_leaks()):
                out["executor"] = leaks
            if self._tracer is not None and (traced := self._tracer.leak_state()):
                out["tracer"] = traced
            if self._adapter is not None:
                out.update({f"transfer.{k}": v for k, v in self._adapter.leak_state().items()})
            return out

    def shutdown(self) -> None:
        """Drop every request (executor state released), stop the adapter's threads and
        close the connector. Idempotent; wakes a waiting engine thread."""
        with self._cond:
            if self._is_closed:
                return
            self._is_closed = True
            self._inbox.clear()
        self._notify()
        with self._step_lock:
            dropped = list(self._scheduler.requests)
            for iid in dropped:
                request = self._scheduler.abort(iid)
                assert request is not None
                try:
                    self._executor.release(iid)
                except Exception as exc:
                    self._counts["num_release_errors"] += 1
                    self.last_error = f"executor.release({iid!r}): {type(exc).__name__}: {exc}"
            self._live.clear()
            self._sending.clear()
            self._releasing.clear()
            self._released.clear()
            self._deferred_loads.clear()
            self._outputs.clear()
            self._tick = None  # a launched tick's results are dropped with its requests
        if self._adapter is not None:
            self._adapter.shutdown()  # closes the connector: releases what it still owns
        elif self._connector is not None:
            self._connector.close()
        if self._tracer is not None:
            for iid in dropped:  # after the adapter stopped: no commit can follow
                self._tracer.request_done(iid)

    close = shutdown

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    def __enter__(self) -> StageEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

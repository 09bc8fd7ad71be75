"""The send side: admission, send tasks, generations and their cleanup (docs/protocol.md §4.3–§4.5).

* :meth:`SendSide.admit` (scheduler thread, via ``save_async``) — decide under the lock,
  queue a task on the external id's lane; never any I/O.
* :meth:`SendSide._run` (a send worker) — build the payload, wait for budget, put, apply
  the result; connector I/O and the processor never run under the lock.
* :meth:`SendSide.cleanup_sender` — cancel the external id's generation (docs/protocol.md §4.5 rows).
* Retirement is reported as data: the external id goes to the event box (drained by
  ``poll_events`` as ``retired_senders``) once the retired generation's keys are
  reclaimed — at the end of its exact-key cleanup task, or at retirement when it has
  nothing to clean — and after the processor was told to release its state of the id
  (:class:`~omnirelay.transfer.processor.ReleaseScope` ``REQUEST``).
* :class:`SendOwner` — what the send side asks of the adapter that owns it.

Ordering: every task of one external id — data tasks of every generation and the cleanup
task of a retiring generation — goes to the same lane of a :class:`LaneExecutor`, which
runs a lane's tasks one at a time in submission order. A generation is retired (its cleanup
queued, its token dropped) under the sender lock, and a later generation can only be
admitted after the token is gone, also under the lock; so its puts queue behind the
cleanup, and a put already started has finished before the cleanup runs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from omnirelay.connectors.base import Connector, PutResult
from omnirelay.ids import request_id_problem
from omnirelay.transfer.budget import ByteBudget, edge_name
from omnirelay.transfer.envelope import ChunkEnvelope, check_envelope
from omnirelay.transfer.events import EventBox, FailureKind, SaveResult, TransferFailure
from omnirelay.transfer.generation import CancelAction, SenderGeneration
from omnirelay.transfer.keys import make_key
from omnirelay.transfer.lanes import LaneExecutor
from omnirelay.transfer.processor import BuildRequest, ChunkProcessor, ReleaseScope
from omnirelay.transfer.transfer_config import TransferConfig
from omnirelay.transfer.wakeup import Parker, wake_all

__all__ = ["SendOwner", "SendSide"]


class SendOwner(Protocol):
    """What the send side asks of the adapter that owns it."""

    @property
    def is_stopping(self) -> bool:
        """The adapter is shutting down: a chunk waiting for budget gives up."""
        ...

    def cleanup(self, internal_id: str, external_id: str | None = None) -> None:
        """The request's terminal chunk was sent: release the request (docs/protocol.md §4.4 step 9)."""
        ...

    def housekeep(self, blocking: bool) -> None:
        """One reap pass and budget reconciliation (waiting for the reap lock when ``blocking``)."""
        ...


_Failure = tuple[FailureKind, str]
_SKIP: _Failure = (FailureKind.SEND_FAILED, "")  # sentinel: the task lost its right to run


class _Refused(NamedTuple):
    """The processor raised: the chunk has no body, for this reason."""

    reason: str


class _SendTask(NamedTuple):
    gen: SenderGeneration
    internal_id: str
    external_id: str
    output: Any
    context: Any
    is_terminal: bool
    is_segment_end: bool


class SendSide:
    """Sender generations of one adapter; see the module docstring."""

    def __init__(
        self,
        *,
        connector: Connector,
        config: TransferConfig,
        lanes: LaneExecutor,
        budget: ByteBudget,
        box: EventBox,
        clock: Callable[[], float],
        processor: ChunkProcessor | None,
        owner: SendOwner,
    ) -> None:
        assert config.send_to_stage is not None
        self._connector = connector
        self._config = config
        self._stage = config.stage_id
        self._to_stage = config.send_to_stage
        self._edge = (config.stage_id, config.send_to_stage)
        self._lanes = lanes
        self._budget = budget
        self._box = box
        self._clock = clock
        #: None: the output given to save_async is the body (no BuildRequest is made).
        self._processor = processor
        self._owner = owner
        self._lock = threading.Lock()
        self._gens: dict[str, SenderGeneration] = {}
        self._counts: dict[str, int] = dict.fromkeys(
            ("num_admitted", "num_dropped", "num_rejected", "num_puts", "num_put_failures",
             "num_discarded", "num_cleanup_tasks", "num_keys_cleaned", "num_cleanup_errors"),
            0,
        )  # fmt: skip
        self.last_error: str | None = None

    # ----------------------------------------------------------------- admission

    def admit(
        self,
        internal_id: str,
        external_id: str,
        output: Any,
        *,
        context: Any,
        is_finished: bool,
        is_segment_finished: bool,
        num_confirmed_tokens: int | None,
        segment_generation: int | None,
        to_replica: int = 0,
        wakes: list[Parker] | None = None,
    ) -> SaveResult:
        """docs/protocol.md §4.3 step 4, under the sender lock; queues the task on the id's lane.
        ``to_replica``: the next stage's replica the request is bound to (read when its
        generation begins). ``wakes``: where a caller that admits several chunks in a
        row collects the workers to wake, to wake them (``wake_all``) once, after the
        last; without it, a worker is woken here."""
        if type(external_id) is not str or external_id not in self._gens:  # checked when its generation began
            problem = request_id_problem(external_id, "external request id")
            if problem is not None:
                self._record(internal_id, str(external_id), FailureKind.SEND_FAILED, problem)
                return SaveResult.REJECTED
        failure: _Failure | None = None
        to_wake: list[Parker] = [] if wakes is None else wakes
        with self._lock:
            g = self._gens.get(external_id)
            if g is not None:
                refusal = self._refusal(
                    g, internal_id, is_segment_finished, num_confirmed_tokens, segment_generation
                )
                if refusal is SaveResult.DROPPED:
                    self._counts["num_dropped"] += 1
                    return SaveResult.DROPPED
                failure = refusal if isinstance(refusal, tuple) else None
            if failure is None:
                if g is None:
                    g = self._gens[external_id] = SenderGeneration(external_id, internal_id, to_replica)
                if segment_generation is not None and segment_generation > g.segment_generation:
                    g.segment_generation = segment_generation
                g.admit(
                    is_terminal=is_finished,
                    is_segment_end=is_segment_finished,
                    confirmed=num_confirmed_tokens,
                )
                task = _SendTask(
                    g, internal_id, external_id, output, context, is_finished, is_segment_finished
                )
                self._lanes.submit(external_id, functools.partial(self._run, task), wakes=to_wake)
                self._counts["num_admitted"] += 1
            else:
                self._counts["num_rejected"] += 1
        if wakes is None:
            wake_all(to_wake)  # outside the lock, which the woken worker's task takes first
        if failure is not None:
            self._record(internal_id, external_id, *failure)
            return SaveResult.REJECTED
        return SaveResult.ENQUEUED

    def _refusal(
        self,
        g: SenderGeneration,
        internal_id: str,
        is_segment_finished: bool,
        num_confirmed_tokens: int | None,
        segment_generation: int | None,
    ) -> _Failure | SaveResult | None:
        """Why the id's live generation ``g`` takes no chunk of ``internal_id`` (a failure),
        :attr:`SaveResult.DROPPED` for a chunk superseded by a later segment or a recompute,
        or None: it takes it."""
        external_id = g.external_id
        if g.cancelled:
            return (
                FailureKind.REUSE_REJECTED,
                f"external id {external_id!r} was reused while the previous sender generation "
                f"(request {g.internal_id!r}) still drains; resubmit once it is released",
            )
        if g.internal_id != internal_id:
            return (
                FailureKind.REUSE_REJECTED,
                f"external id {external_id!r} is in use by request {g.internal_id!r}",
            )
        if g.has_failed:
            return (FailureKind.SEND_FAILED, "an earlier chunk of this request failed to send")
        if g.is_terminal_admitted:
            return (FailureKind.SEND_FAILED, "a chunk was saved after the request's terminal chunk")
        if segment_generation is not None and segment_generation < g.segment_generation:
            return SaveResult.DROPPED
        if (
            not is_segment_finished
            and num_confirmed_tokens is not None
            and g.watermark is not None
            and num_confirmed_tokens < g.watermark
        ):
            return SaveResult.DROPPED  # preempted request recomputing sent tokens
        return None

    def has_active_sender(self, external_id: str) -> bool:
        with self._lock:
            g = self._gens.get(external_id)
            return g is not None and g.is_active

    def is_draining(self, external_id: str) -> bool:
        """A cancelled generation still owns the id: a new request with it is refused."""
        with self._lock:
            g = self._gens.get(external_id)
            return g is not None and g.cancelled

    def owner(self, external_id: str) -> str | None:
        """The internal id of ``external_id``'s generation; None when it has none."""
        with self._lock:
            g = self._gens.get(external_id)
            return None if g is None else g.internal_id

    # ----------------------------------------------------------------- send task

    def _is_current_locked(self, task: _SendTask) -> bool:
        return self._gens.get(task.external_id) is task.gen

    def _run(self, task: _SendTask) -> None:
        """One data task, on a send worker (docs/protocol.md §4.4)."""
        g = task.gen
        with self._lock:
            may_run = self._gens.get(task.external_id) is g and g.may_run(is_terminal=task.is_terminal)
            chunk_id = g.num_sent
            if may_run:
                g.start()
            else:
                self._counts["num_discarded"] += 1
        if not may_run:
            self._finish_task(task)
            return
        try:
            try:
                failure, delivered = self._send(task, chunk_id)
            except Exception as exc:  # a bug below: fail the request with the reason, keep the worker
                failure, delivered = (
                    (FailureKind.SEND_FAILED, f"send task raised {type(exc).__name__}: {exc}"),
                    False,
                )
            if failure is not None:
                with self._lock:
                    g.fail()
                self._record(task.internal_id, task.external_id, *failure)
            elif delivered:
                self._owner.cleanup(task.internal_id, task.external_id)  # docs/protocol.md §4.4 step 9
        finally:  # whatever happened (even BaseException), restore the token's invariants
            self._finish_task(task)

    def _send(self, task: _SendTask, chunk_id: int) -> tuple[_Failure | None, bool]:
        """Build, wait for budget, put. Returns (failure, terminal delivered)."""
        g = task.gen
        built = task.output if self._processor is None else self._build(task, chunk_id)
        if type(built) is _Refused:
            return (FailureKind.SEND_FAILED, built.reason), False
        if type(built) is ChunkEnvelope:
            # The processor decided its own flags: put them as they are, if well-formed.
            problem = check_envelope(built)
            if problem is not None:
                return (
                    FailureKind.SEND_FAILED,
                    f"the processor's chunk envelope is malformed: {problem}",
                ), False
            envelope = built
        elif built is None and not (task.is_terminal or task.is_segment_end):
            return None, False  # nothing to send this step
        else:
            # docs/protocol.md §4.4 steps 4-5. No body at a boundary is no reason to stay
            # silent: the finish flags are the downstream's only end-of-stream signal.
            envelope = ChunkEnvelope(
                body=built, is_finished=task.is_terminal, is_segment_finished=task.is_segment_end
            )
        waited = self._wait_for_budget(task)
        if waited is _SKIP:
            return None, False
        if waited is not None:
            return waited, False
        with self._lock:
            if not (self._gens.get(task.external_id) is g and g.may_run(is_terminal=task.is_terminal)):
                return None, False  # cancelled while building (docs/protocol.md §4.4 step 6)
            put_id = g.before_put()
        key = make_key(task.external_id, self._stage, put_id)
        try:
            result = self._connector.put(self._stage, self._to_stage, key, envelope, g.to_replica)
        except Exception as exc:  # the contract says put never raises; treat it as a failed put
            result = PutResult(ok=False, error=f"connector.put raised {type(exc).__name__}: {exc}")
        if not result.ok:
            with self._lock:
                self._counts["num_put_failures"] += 1
            return (
                FailureKind.SEND_FAILED,
                f"put of {key!r} failed: {result.error or 'no reason given'}",
            ), False
        self._budget.add(key, self._edge, result.nbytes)
        with self._lock:
            self._counts["num_puts"] += 1
            honored = g.put_succeeded(is_terminal=task.is_terminal)
        if task.is_segment_end and self._processor is not None:
            self._processor.release(task.external_id, ReleaseScope.SEGMENT)
        return None, honored and task.is_terminal and envelope.is_finished

    def _build(self, task: _SendTask, chunk_id: int) -> Any:
        """The processor's body for this chunk (outside every lock), or why it has none."""
        assert self._processor is not None
        request = BuildRequest(
            task.internal_id,
            task.external_id,
            task.output,
            task.context,
            task.is_terminal or task.is_segment_end,
            task.is_terminal,
            task.is_segment_end,
            chunk_id,
        )
        try:
            return self._processor.build(request)
        except Exception as exc:
            return _Refused(f"the processor raised {type(exc).__name__}: {exc}")

    def _wait_for_budget(self, task: _SendTask) -> _Failure | None:
        """Wait (bounded) while the edge holds more unconsumed bytes than its budget."""
        if not self._budget.is_over(self._edge):
            return None
        deadline = self._clock() + self._config.backpressure_wait_s
        while True:
            self._owner.housekeep(True)  # learn about consumption now, not at the next idle pass
            if not self._budget.is_over(self._edge):
                return None
            with self._lock:
                if not (self._is_current_locked(task) and task.gen.may_run(is_terminal=task.is_terminal)):
                    return _SKIP
            if self._owner.is_stopping:
                return (FailureKind.SEND_FAILED, "the adapter shut down while the chunk waited for budget")
            if self._clock() >= deadline:
                used = self._budget.used(self._edge)
                return (
                    FailureKind.BACKPRESSURE,
                    f"edge {edge_name(self._edge)} held {used} unconsumed bytes (budget "
                    f"{self._budget.limit_bytes}) for {self._config.backpressure_wait_s:g} s; "
                    "the consumer is not keeping up",
                )
            self._budget.wait(self._config.reap_interval_s)

    def _finish_task(self, task: _SendTask) -> None:
        """docs/protocol.md §4.4 step 10: the 'terminal task ends' row, then the 'any task finally' row."""
        g = task.gen
        retired: list[str] = []
        wakes: list[Parker] = []
        with self._lock:
            if task.is_terminal and g.end_terminal() and self._is_current_locked(task):
                self._cancel_locked(g, retired, wakes)  # the deferred cleanup_sender
            if self._is_current_locked(task) and g.end_task():
                self._retire_locked(g, retired, wakes)
        wake_all(wakes)
        self._report_retired(retired)

    # ----------------------------------------------------------------- cleanup

    def cleanup_sender(self, external_id: str, internal_id: str | None = None) -> None:
        """Cancel ``external_id``'s generation (docs/protocol.md §4.5). Never waits for I/O.

        With ``internal_id``, a generation owned by another request (a newer one that
        reuses the id) is left alone.
        """
        retired: list[str] = []
        wakes: list[Parker] = []
        has_generation = True
        with self._lock:
            g = self._gens.get(external_id)
            if g is None:
                has_generation = False
            elif internal_id is None or g.internal_id == internal_id:
                self._cancel_locked(g, retired, wakes)
        wake_all(wakes)
        if not has_generation:
            self._call_release(external_id)  # no token: clear the sender maps only
        self._report_retired(retired)

    def _cancel_locked(self, g: SenderGeneration, retired: list[str], wakes: list[Parker]) -> None:
        if g.cancel() is CancelAction.RETIRE:
            self._retire_locked(g, retired, wakes)

    def _retire_locked(self, g: SenderGeneration, retired: list[str], wakes: list[Parker]) -> None:
        """Drop the token. With keys to clean, queue the cleanup task (the worker to wake
        goes to ``wakes``), which reports the retirement when it is done; else ``g``'s id
        goes to ``retired``, reported by the caller after the lock."""
        # Invariant: the cleanup task is queued on the id's lane before the token is dropped,
        # so any later generation's put of this id queues behind it.
        assert self._gens.get(g.external_id) is g
        n = g.keys_to_clean()
        if n:
            self._lanes.submit(
                g.external_id, functools.partial(self._run_cleanup, g.external_id, n), wakes=wakes
            )
        else:
            retired.append(g.external_id)
        del self._gens[g.external_id]

    def _report_retired(self, external_ids: list[str]) -> None:
        """After the lock: drop each id's processor state, then report it retired (in
        that order: a later generation of the id must find no state of this one)."""
        for ext in external_ids:
            self._call_release(ext)
            self._box.record_retired(ext)

    def _run_cleanup(self, external_id: str, num_keys: int) -> None:
        """Remove the exact keys ``{ext}_{stage}_{0..n-1}`` of a retired generation, then
        report the retirement (on the id's lane: a later generation's puts wait for it)."""
        keys = [make_key(external_id, self._stage, i) for i in range(num_keys)]
        errors: list[str] = []
        for key in keys:
            try:
                self._connector.cleanup(key)
            except Exception as exc:
                errors.append(f"cleanup of {key!r} raised {type(exc).__name__}: {exc}")
        self._budget.release(keys)
        with self._lock:
            self._counts["num_cleanup_tasks"] += 1
            self._counts["num_keys_cleaned"] += num_keys
            self._counts["num_cleanup_errors"] += len(errors)
            if errors:
                self.last_error = errors[-1]
        self._report_retired([external_id])

    def _call_release(self, external_id: str) -> None:
        if self._processor is not None:
            self._processor.release(external_id, ReleaseScope.REQUEST)

    def _record(self, internal_id: str, external_id: str, kind: FailureKind, reason: str) -> None:
        self._box.record(TransferFailure(internal_id, external_id, kind, reason, self._stage))

    # ----------------------------------------------------------------- introspection

    def generation(self, external_id: str) -> dict[str, Any] | None:
        """A copy of the generation's fields (tests, debugging)."""
        with self._lock:
            g = self._gens.get(external_id)
            if g is None:
                return None
            return {name: getattr(g, name) for name in SenderGeneration.__slots__}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "num_generations": len(self._gens),
                "num_in_flight": sum(1 for g in self._gens.values() if g.in_flight),
                **self._counts,
                "last_error": self.last_error,
            }

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            return {"sender_generations": {k: repr(g) for k, g in self._gens.items()}} if self._gens else {}

    def clear(self) -> None:
        with self._lock:
            self._gens.clear()

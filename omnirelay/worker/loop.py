"""The stage worker's loop: one stage engine driven by control messages.

:class:`WorkerLoop` runs on the worker process's engine thread (see
:mod:`omnirelay.worker.main` for the process around it). One iteration
(:meth:`WorkerLoop.run_once`):

* take every control message the receive thread queued; add / abort / release go to
  the engine, queries wait for the tick;
* one ``engine.step()`` when the engine has work, a command was just posted, or a wait
  just ended (the engine collects stall timeouts in ``step``); outputs go out as one
  :class:`Outputs` message — except the progress outputs of an intermediate stage (see
  below);
* after every step, a :class:`Released` for each id the engine reports released
  (``engine.take_released()``): the front's fence against a reused request id. It goes
  out exactly when the engine's release is complete — at once for an engine with nothing
  to drain, after the last sender generation of the id retired for the stage engine;
* then answer health / leak-state queries;
* otherwise wait without spinning: ``engine.wait_for_work(idle_wait_s)``, which the
  receive thread ends early through ``engine.wake()``. For an engine without ``wake``
  (optional in the protocol): with no request in the engine, block on the inbox;
  with requests parked, wait in ``wait_slice_s`` slices and look at the inbox between.

Progress outputs of an intermediate stage (one whose ``final_output`` is false, a
Talker: its per-step outputs reach no client, only the front's observers and books) are
held and sent with a later message instead of one message per step: at the latest
``progress_flush_s`` after the first one held (or once ``progress_flush_count`` are
held), with any other output of the stage (a finished or failed output goes out right
behind what is held, so a request's outputs stay in order), and before the loop waits.
A release drops what is held for its id (nobody reads it, and nothing of a released id
may follow its :class:`Released`). This saves the stage a message, and the front a
wake-up, per step — on the critical path of a Talker, whose next step waits for it.

:func:`leak_paths` finds the non-empty places of a leak-state tree (audits).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from omnirelay.engine.interfaces import StageEngineProtocol, StageOutput
from omnirelay.errors import PipelineError
from omnirelay.worker.messages import (
    Abort,
    HealthReply,
    HealthRequest,
    LeakStateReply,
    LeakStateRequest,
    Outputs,
    Release,
    Released,
    RequestFailed,
    Shutdown,
    StageFatal,
    Submit,
    ToFront,
    ToWorker,
    WireOutput,
    stage_request,
    wire_output,
)
from omnirelay.worker.spec import WorkerSpec
from omnirelay.worker.worker_control import CommandInbox

__all__ = ["WorkerLoop", "leak_paths"]


def leak_paths(state: Any, path: str = "") -> list[str]:
    """Where a leak-state tree is not empty: non-zero numbers and non-empty containers.

    Booleans, strings and ``None`` describe; they are not state. Keys ending in
    ``_total`` are cumulative counters and are skipped.
    """
    found: list[str] = []
    if isinstance(state, dict):
        for k, v in state.items():
            key = str(k)
            if not key.endswith("_total"):
                found.extend(leak_paths(v, f"{path}.{key}" if path else key))
    elif isinstance(state, list | tuple | set | frozenset):
        if state:
            found.append(f"{path}={list(state)[:5]!r}")
    elif isinstance(state, bool) or state is None or isinstance(state, str):
        pass
    elif isinstance(state, int | float) and state != 0:
        found.append(f"{path}={state}")
    return found


class WorkerLoop:
    """Drive one engine from control messages; see the module docstring.

    ``send`` delivers a message to the front (the engine thread's socket). Runs on one
    thread; only the :class:`CommandInbox` is shared with the receive thread.
    """

    def __init__(
        self,
        engine: StageEngineProtocol,
        inbox: CommandInbox,
        send: Callable[[ToFront], None],
        spec: WorkerSpec,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self._clock = clock
        self.inbox = inbox
        self.send = send
        self.spec = spec
        self.stage_id = spec.stage_id
        wake = getattr(engine, "wake", None)
        self.engine_wake: Callable[[], None] | None = wake if callable(wake) else None
        self.is_stopping = False
        self._num_posted = 0  # commands posted since the last step
        self._needs_tick = False
        stage = next((s for s in spec.pipeline.stages if s.id == spec.stage_id), None)
        #: progress outputs are held (see the module docstring): an intermediate stage
        self.holds_progress = spec.progress_flush_s > 0 and stage is not None and not stage.final_output
        self._held: list[WireOutput] = []
        self._held_since = 0.0

    def wake(self) -> None:
        """Called by the receive thread after it queued messages."""
        if self.engine_wake is not None:
            self.engine_wake()

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Run until Shutdown (or SIGTERM)."""
        while not self.is_stopping:
            self.run_once()
        self._flush()

    def run_once(self) -> None:
        """One iteration: apply control messages, tick, report releases, answer, or wait."""
        messages = self.inbox.take_all()
        queries: list[ToWorker] = []
        for message in messages:
            self._apply(message, queries)
        if self._num_posted or self._needs_tick or self.engine.has_work():
            self._step()
        for query in queries:
            self._answer(query)
        if self.is_stopping or messages or self.engine.has_work():
            return
        self._wait()

    def _wait(self) -> None:
        self._flush()
        self._needs_tick = True
        if self.engine_wake is not None:
            self.engine.wait_for_work(self.spec.idle_wait_s)
        elif not self.engine.num_requests():
            self.inbox.wait(self.spec.idle_wait_s)
        else:
            self.engine.wait_for_work(self.spec.wait_slice_s)

    def _step(self) -> None:
        """One engine step; its outputs go out (or are held), then its completed releases."""
        self._num_posted = 0
        self._needs_tick = False
        try:
            outputs = self.engine.step()
            released = self.engine.take_released()
        except Exception as exc:
            self._fatal(exc)
            raise
        self._send_step(outputs, released)

    def _fatal(self, exc: Exception) -> None:
        self.send(StageFatal(self.stage_id, f"engine step failed: {exc!r}\n{traceback.format_exc()}"))

    def _send_step(self, outputs: list[StageOutput], released: list[str]) -> None:
        self._send_outputs(outputs)
        for rid in released:
            self.send(Released(self.stage_id, rid))

    # -- driven by a device group's loop (omnirelay.worker.group) ---------------------------

    def take_messages(self) -> tuple[bool, list[ToWorker]]:
        """Apply the queued control messages: (whether there were any, the queries)."""
        messages = self.inbox.take_all()
        queries: list[ToWorker] = []
        for message in messages:
            self._apply(message, queries)
        return bool(messages), queries

    def wants_step(self) -> bool:
        """Would a step do anything (or is one due: a command, a wait just ended)?"""
        return bool(self._num_posted or self._needs_tick or self.engine.has_work())

    def launch(self) -> bool:
        """Start a step; True while it runs on (see :meth:`complete`). An engine without
        ``launch_step`` runs its whole step in :meth:`complete`."""
        launch_step = getattr(self.engine, "launch_step", None)
        if not callable(launch_step):
            return False
        self._num_posted = 0
        self._needs_tick = False
        try:
            return bool(launch_step())
        except Exception as exc:
            self._fatal(exc)
            raise

    def is_step_done(self) -> bool:
        """Has the launched step ended? (Polls; never blocks.)"""
        is_done = getattr(self.engine, "is_step_done", None)
        return not callable(is_done) or bool(is_done())

    def complete(self) -> None:
        """End the launched step (an engine without ``launch_step``: run it): its outputs
        and completed releases go out."""
        complete_step = getattr(self.engine, "complete_step", None)
        if not callable(complete_step) or not callable(getattr(self.engine, "launch_step", None)):
            self._step()
        else:
            try:
                outputs = complete_step()
                released = self.engine.take_released()
            except Exception as exc:
                self._fatal(exc)
                raise
            self._send_step(outputs, released)
        # The chunk loads the step deferred are registered now, its outputs out: a stage's
        # own loop does it in wait_for_work, which a group's loop never calls, and a chunk
        # that arrives unregistered wakes nothing (the stage would idle until another
        # reason to step it, or the group's idle timer).
        load_deferred = getattr(self.engine, "load_deferred", None)
        if callable(load_deferred):
            load_deferred()

    def answer(self, queries: list[ToWorker]) -> None:
        for query in queries:
            self._answer(query)

    def before_wait(self) -> None:
        """The group's loop is about to wait: held outputs go out, and the next
        iteration steps once (stall timeouts are collected then)."""
        self._flush()
        self._needs_tick = True

    def flush(self) -> None:
        self._flush()

    def _send_outputs(self, outputs: list[StageOutput]) -> None:
        if not outputs:
            if self._held and self._clock() - self._held_since >= self.spec.progress_flush_s:
                self._flush()
            return
        is_progress = self.holds_progress
        for out in outputs:
            if out.finished or out.error is not None:
                is_progress = False
        wires = [wire_output(o) for o in outputs]
        now = self._clock()
        if is_progress:
            if not self._held:
                self._held_since = now
            self._held.extend(wires)
            if (
                now - self._held_since < self.spec.progress_flush_s
                and len(self._held) < self.spec.progress_flush_count
            ):
                return
            wires = []
        if self._held:
            wires = self._held + wires
            self._held = []
        self.send(Outputs(self.stage_id, wires))

    def _flush(self) -> None:
        """Send the held progress outputs now."""
        if self._held:
            held, self._held = self._held, []
            self.send(Outputs(self.stage_id, held))

    # -- control messages ---------------------------------------------------------------

    def _apply(self, message: ToWorker, queries: list[ToWorker]) -> None:
        if isinstance(message, Submit):
            rid = message.request.request_id
            try:
                self.engine.add_request(stage_request(message.request))
            except Exception as exc:
                self.send(RequestFailed(self.stage_id, rid, f"add_request failed: {exc!r}"))
                return
            self._num_posted += 1
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id)
            self._num_posted += 1
        elif isinstance(message, Release):
            if self._held:
                self._held = [w for w in self._held if w.request_id != message.request_id]
            self.engine.release(message.request_id)  # Released once the engine says so
            self._num_posted += 1
        elif isinstance(message, HealthRequest | LeakStateRequest):
            queries.append(message)
        elif isinstance(message, Shutdown):
            self.is_stopping = True
        else:  # pragma: no cover - the decoder only yields the union's members
            raise PipelineError(f"unknown control message {message!r}")

    def _answer(self, query: ToWorker) -> None:
        if isinstance(query, HealthRequest):
            engine = dict(self.engine.health())
            engine.setdefault("num_bad_control_messages", self.inbox.num_bad_messages)
            self.send(
                HealthReply(
                    seq=query.seq,
                    stage_id=self.stage_id,
                    pid=os.getpid(),
                    num_requests=self.engine.num_requests(),
                    engine=engine,
                )
            )
        elif isinstance(query, LeakStateRequest):
            self.send(
                LeakStateReply(seq=query.seq, stage_id=self.stage_id, state=self._settled_leak_state(query))
            )

    def _settled_leak_state(self, query: LeakStateRequest) -> dict[str, Any]:
        """The books, once in-flight cleanup settled (or ``settle_s`` passed).

        Cleanup that follows an abort or release partly runs on the engine's transfer
        threads (a cancelled sender finishes its put, then removes it): an audit waits
        for that, bounded, instead of reporting a transient state as a leak.
        """
        deadline = time.monotonic() + query.settle_s
        while True:
            self._flush()  # held progress outputs go out anyway before the loop waits
            state = {
                "worker": {"num_held_outputs": len(self._held)},
                "engine": dict(self.engine.leak_state()),
            }
            remaining = deadline - time.monotonic()
            if not leak_paths(state) or remaining <= 0:
                return state
            flush = getattr(self.engine, "flush", None)
            if callable(flush):
                flush(min(remaining, 0.5))
            else:
                self.engine.wait_for_work(min(remaining, 0.05))
            self._step()

"""A device group: several stage engines in one worker process, driven by one loop.

The stages of a pipeline that share a CUDA device run in one process (``device_groups:
auto``, the default; :mod:`omnirelay.pipeline.groups` says which; docs/design.md §12):
one CUDA context, one caching allocator, no time slices between processes, and one loop that decides whose
step goes next. To the front each stage is still a worker of its own — its own control
sockets, hello, outputs, releases, health and leak-state answers (a
:class:`~omnirelay.worker.loop.WorkerLoop` per stage) — and they share one process, so
its death is each stage's death and its restart restarts them all.

:class:`GroupLoop` (one thread, the process's main thread). One iteration:

1. each stage takes its queued control messages (add / abort / release go to its
   engine; queries wait);
2. each stage whose launched step ended is completed: the step's results go to its
   scheduler, its outputs and completed releases go out, then the chunk loads the step
   deferred are registered (a chunk that arrives unregistered wakes nothing) — looked at
   again after every synchronous step of step 3, so a launched stage's outputs do not
   wait for the rest;
3. in priority order — the stage nearest the client first (Code2Wav, then the Talker,
   then the Thinker: the streams short of playback headroom are theirs) — each stage
   with work and no step in flight launches one (``StageEngine.launch_step``): an
   executor with ``launch`` enqueues its kernels on the stage's own stream and returns
   (see :class:`~omnirelay.engine.interfaces.PendingStep`); any other executor runs its
   whole step there (the synchronous fallback: launch and completion in one); with
   ``OMNIRELAY_GROUP_BY_NEED=1`` a stage's scheduler puts new requests and streams behind
   real time in a step of their own (:mod:`omnirelay.engine.need`);
4. queries are answered (a stage's leak state once its step completed);
5. then, with a step in flight, the loop waits on its waker at most ``poll_s`` and polls
   the steps again; with none and nothing to do, it waits on the waker up to
   ``idle_wait_s`` (every engine tells the waker when it may have work: a command, a
   ready chunk, a transfer failure; ``StageEngine.set_wake_listener``). An engine
   without that hook is looked at with ``wait_for_work(0)`` each iteration, and while
   it holds requests the loop waits in ``wait_slice_s`` slices.

Why this loop cannot hang the way two threads replaying two stages' graphs did (both
blocked in a step's device→host copy): there is one thread, and it never blocks on the
device — it polls each launched step's ``is_done()`` (a CUDA event's ``query()``) and
takes the results only once they are there; a stage without ``launch`` runs its step to
the end before the loop goes on, exactly as a stage's own process would. Nothing waits
for another stage's work while holding the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from omnirelay.worker.loop import WorkerLoop
from omnirelay.worker.messages import ToWorker

__all__ = ["GroupLoop", "GroupWaker"]


class GroupWaker:
    """Where the group's loop waits for any of its stages: a sticky flag, so a wake that
    comes between the loop's last look and its wait is not lost."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._is_pending = False
        self.num_wakes = 0

    def wake(self) -> None:
        with self._cond:
            self._is_pending = True
            self.num_wakes += 1
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Until woken (True) or ``timeout`` s passed (False); clears the flag."""
        with self._cond:
            woke = self._cond.wait_for(lambda: self._is_pending, timeout)
            self._is_pending = False
            return woke


class GroupLoop:
    """Drive the stages of one process (see the module docstring).

    ``members`` are the stages' loops; their launch order is by ``priority`` (default:
    the higher stage id first).
    """

    def __init__(
        self,
        members: Sequence[WorkerLoop],
        waker: GroupWaker | None = None,
        *,
        idle_wait_s: float = 1.0,
        poll_s: float = 0.0002,
        priority: Callable[[WorkerLoop], float] | None = None,
    ) -> None:
        if not members:
            raise ValueError("a device group has at least one stage")
        key = priority if priority is not None else (lambda m: -m.stage_id)
        self.members = sorted(members, key=key)
        self.waker = waker if waker is not None else GroupWaker()
        self.idle_wait_s = idle_wait_s
        self.poll_s = poll_s
        self._in_flight: set[int] = set()  # ids of members with a launched step
        #: launches in order, per stage id (tests, health)
        self.num_launches: dict[int, int] = {m.stage_id: 0 for m in members}
        self.num_overlapped = 0  # launches made while another stage's step was in flight
        self.num_iterations = 0
        #: engines that cannot tell the waker: each iteration looks at them with a
        #: ``wait_for_work(0)`` (where such an engine takes in what arrived)
        self._polled: list[WorkerLoop] = []
        for member in self.members:
            listen = getattr(member.engine, "set_wake_listener", None)
            if callable(listen):
                listen(self.waker.wake)
            else:
                self._polled.append(member)

    def wake(self, member: WorkerLoop) -> Callable[[], None]:
        """What a stage's receive thread calls after it queued messages."""

        def wake() -> None:
            member.wake()
            self.waker.wake()

        return wake

    @property
    def is_stopping(self) -> bool:
        return all(m.is_stopping for m in self.members)

    def run(self) -> None:
        """Until every stage was told to stop (or SIGTERM)."""
        while not self.is_stopping:
            self.run_once()
        for member in self.members:
            if id(member) in self._in_flight:
                self._complete(member)
            member.flush()

    def run_once(self) -> None:
        """One iteration (see the module docstring)."""
        self.num_iterations += 1
        has_messages = False
        queries: list[tuple[WorkerLoop, list[ToWorker]]] = []
        for member in self.members:
            got, asked = member.take_messages()
            has_messages |= got
            if asked:
                queries.append((member, asked))
        self._complete_done()
        for member in self._polled:
            if id(member) not in self._in_flight and not member.is_stopping:
                member.engine.wait_for_work(0.0)
        for member in self.members:
            if member.is_stopping or id(member) in self._in_flight or not member.wants_step():
                continue
            self.num_launches[member.stage_id] += 1
            if self._in_flight:
                self.num_overlapped += 1
            if member.launch():
                self._in_flight.add(id(member))
            else:
                member.complete()
                self._complete_done()  # what ended meanwhile goes out now, not after the rest
        for member, asked in queries:
            if id(member) in self._in_flight:
                self._complete(member)  # a leak audit looks at a settled stage
            member.answer(asked)
        if self._in_flight:
            self.waker.wait(self.poll_s)
            return
        if has_messages or self.is_stopping or any(m.engine.has_work() for m in self.members):
            return
        for member in self.members:
            member.before_wait()
        self.waker.wait(self._idle_wait())

    def _idle_wait(self) -> float:
        """How long to wait idle: ``idle_wait_s``, or a stage's ``wait_slice_s`` while an
        engine that cannot tell the waker (no ``set_wake_listener``) holds requests."""
        slices = [m.spec.wait_slice_s for m in self._polled if m.engine.num_requests()]
        return min([self.idle_wait_s, *slices])

    def _complete_done(self) -> None:
        """Complete every launched step whose work ended."""
        if not self._in_flight:
            return
        for member in self.members:
            if id(member) in self._in_flight and member.is_step_done():
                self._complete(member)

    def _complete(self, member: WorkerLoop) -> None:
        self._in_flight.discard(id(member))
        member.complete()

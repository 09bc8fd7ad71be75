"""Per-lane FIFO work over a small pool of threads (docs/protocol.md §10.15: order per request only).

A *lane* is a key (an external id on the send side, an internal id on the receive side).
Tasks of one lane run one at a time, in submission order; tasks of different lanes run in
parallel on up to ``num_workers`` threads. So one request's 64 MB put occupies one worker
while another request's codec chunk goes out on the next.

Invariants (under ``_lock``):

* a lane is in ``_lanes`` iff it has queued tasks or a worker is running one of its tasks;
* a lane is in ``_owned`` iff a worker is running one of its tasks; it is in the run queue
  iff it has queued tasks and is not owned — each lane at most once, so a lane is owned by
  at most one worker, which is what makes each lane serial;
* an owner takes one task per turn and re-queues the lane at the tail (round robin).

Ready lanes wait in a FIFO under the executor's one lock; idle workers park, each on its
own :class:`~omnirelay.transfer.wakeup.Parker`, most recently parked first. Queuing work pops
one parked worker under the lock and wakes it once the lock is released, with the GIL
released too (``wakeup.py`` says why): the worker takes the GIL at once instead of
preempting its waker for nothing and waiting for the waker's next GIL release
(docs/performance.md has the hand-off's cost both ways). One parker per worker wakes exactly one of
them (no thundering herd on the GIL), the most recently parked, whose cache is warm — except
the worker with the idle duty (``on_idle``), which parks at the bottom: its park waits with a
timeout (a poll, then a read), and were it the one woken every time, its idle timer would
never run out (a worker woken each few ms keeps the task and parks on top again).

With a ``source`` (the receive side's arrival wait), the pool works leader/follower: one
worker at a time holds the *lead* (a token in the run queue) and runs the source, which
blocks for arrivals and submits polls. Lanes the leader submits from its source are kept
back; when the source returns, the leader queues all but the first, hands the lead on,
and runs the first itself. So a chunk's poll costs no extra thread hand-off, and a big
decode never stops arrivals from being dispatched while another worker is free. A leader
whose source returned nothing keeps the lead.

For work known to be short (a small chunk's get) the source calls :meth:`run_now`: the
leader runs it on the spot, *without* handing the lead on, so no follower is woken for
it — on this class of machine a woken follower's context switches and GIL hand-offs cost
about as much as the short task itself. The leader listens again right after.

Because a generation's cleanup task is submitted to the lane of its external id, it runs
after every task of that id submitted before it and before every task submitted after it.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from omnirelay.transfer.wakeup import Parker, wake_all

__all__ = ["LaneExecutor"]

Task = Callable[[], None]


class _Token:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_LEAD = _Token("lead")  # run the source
_STOP = _Token("stop")  # one per worker at stop()
_IDLE = _Token("idle")  # a parked worker's idle timeout passed


class LaneExecutor:
    """Serial per lane, parallel across lanes. ``start()`` launches the worker threads."""

    def __init__(
        self,
        name: str,
        num_workers: int,
        *,
        on_error: Callable[[BaseException], None],
        after_task: Callable[[], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        idle_interval_s: float = 0.1,
        source: Callable[[], None] | None = None,
        parker: Callable[[], Parker] = Parker,
    ) -> None:
        assert num_workers >= 1
        self._new_parker = parker  # injectable: tests force the park/wake interleavings
        self._name = name
        self._num_workers = num_workers
        self._on_error = on_error
        self._after_task = after_task
        self._on_idle = on_idle
        self._idle_interval_s = idle_interval_s
        self._source = source
        self._lock = threading.Lock()
        self._is_idle = threading.Condition(self._lock)
        self._num_idle_waiters = 0
        #: The run queue (lanes and tokens) and the parked workers, both under ``_lock``.
        self._ready: deque[Hashable] = deque()
        self._parked: list[Parker] = []
        self._lanes: dict[Hashable, deque[Task]] = {}
        self._owned: set[Hashable] = set()
        #: The thread running the source now, and the lanes it submitted meanwhile.
        self._leader_ident: int | None = None
        self._held: list[Hashable] = []
        self._num_running = 0
        self._is_stopped = False
        self._threads: list[threading.Thread] = []
        self.num_dropped_at_stop = 0

    def start(self) -> None:
        if self._source is not None:
            self._ready.append(_LEAD)  # no worker parked yet
        for i in range(self._num_workers):
            t = threading.Thread(target=self._work, args=(i,), name=f"{self._name}-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def submit(self, lane: Hashable, task: Task, *, wakes: list[Parker] | None = None) -> bool:
        """Queue ``task`` at the tail of ``lane``. Never blocks on I/O; False once stopped.

        Where it wakes a worker, the worker may run before this returns (on a CPU shared
        with the caller): see the module docstring. A caller that holds a lock of its own
        passes ``wakes``: the worker to wake is appended there instead, for the caller to
        wake (:func:`~omnirelay.transfer.wakeup.wake_all`) once its lock is released. A
        worker woken inside that lock would run into it on its task's first step."""
        with self._lock:
            if self._is_stopped:
                return False
            tasks = self._lanes.get(lane)
            if tasks is not None:
                tasks.append(task)  # its owner or its place in the run queue picks it up
                return True
            self._lanes[lane] = deque((task,))
            if self._leader_ident is not None and self._leader_ident == threading.get_ident():
                self._held.append(lane)  # the leader runs or queues it when its source returns
                return True
            self._ready.append(lane)
            parker = self._parked.pop() if self._parked else None
        if parker is not None:
            if wakes is None:
                parker.wake()
            else:
                wakes.append(parker)
        return True

    def _queue_locked(self, items: list[Hashable]) -> list[Parker]:
        """Append ``items`` to the run queue; returns the parked workers to wake (one per
        item, as many as are parked) once the lock is released."""
        self._ready.extend(items)
        parked = self._parked
        n = min(len(items), len(parked))
        if not n:
            return []
        woken = parked[-n:]
        del parked[-n:]
        return woken

    def run_now(self, lane: Hashable, fn: Callable[[Any], None], arg: Any) -> bool:
        """For the source: run ``fn(arg)`` on the calling thread now if ``lane`` is idle,
        keeping the lead meanwhile; queue it behind the lane's tasks otherwise. Lanes the
        source submitted before are queued first, so a follower can take them meanwhile.
        False once stopped."""
        with self._lock:
            if self._is_stopped:
                return False
            tasks = self._lanes.get(lane)
            if tasks is not None:
                tasks.append(functools.partial(fn, arg))  # keep the lane's order
                return True
            woken = self._queue_locked(self._held)
            self._held.clear()
            self._lanes[lane] = deque()
            self._owned.add(lane)
            self._num_running += 1
        wake_all(woken)
        try:
            fn(arg)
        except Exception as exc:  # tasks report their own failures; this is the last net
            self._on_error(exc)
        self._release(lane)
        return True

    # ----------------------------------------------------------------- workers

    def _work(self, index: int) -> None:
        # Only worker 0 wakes up when idle, so an idle pool costs one wakeup per interval.
        idle_timeout = self._idle_interval_s if (index == 0 and self._on_idle is not None) else None
        me = self._new_parker()
        try:
            while True:
                item, task = self._next(me, idle_timeout)
                if task is not None:
                    self._run_task(item, task)
                    continue
                if item is _IDLE:
                    if not self._is_stopped:
                        self._call(self._on_idle)
                    continue
                if item is _STOP:
                    return
                lane = self._lead()  # item is _LEAD
                if lane is not None:
                    self._run_one(lane)
                elif self._is_stopped:
                    return
        finally:
            me.close()

    def _next(self, me: Parker, timeout: float | None) -> tuple[Hashable, Task | None]:
        """The next run-queue item for the worker parked on ``me``: a lane with its next
        task, already claimed (one lock section from wake-up to task), a token with None,
        or ``_IDLE`` after ``timeout`` seconds with nothing to do."""
        while True:
            with self._lock:
                while self._ready:
                    item = self._ready.popleft()
                    if isinstance(item, _Token):
                        return item, None
                    task = self._claim_locked(item)
                    if task is not None:
                        return item, task
                    # else: dropped by stop(); look at the next item
                if timeout is None:
                    self._parked.append(me)
                else:
                    # The idle-duty worker parks at the bottom: woken last, so the hot
                    # worker is one whose park is one blocking read (a timed park is a
                    # poll and a read), and its idle timer runs while the others work.
                    self._parked.insert(0, me)
            if me.wait(timeout):
                continue
            with self._lock:
                if me in self._parked:
                    self._parked.remove(me)
                    return _IDLE, None
            # A waker popped us just as the timeout passed: take its wake-up (it is written
            # right after the waker's lock section), or a later park would see it as a new one.
            me.wait(None)

    def _lead(self) -> Hashable | None:
        """Run the source while holding the lead; returns the lane to run now, if any.

        The lead is handed on (queued after the other held lanes) only when this worker
        goes off to run a task; otherwise the leader keeps it and listens again.
        """
        me = threading.get_ident()
        while True:
            with self._lock:
                if self._is_stopped:
                    return None
                self._leader_ident = me
            self._call(self._source)
            with self._lock:
                self._leader_ident = None
                held, self._held = self._held, []
                if self._is_stopped:
                    return None
                if not held:
                    # Let queued lanes of other submitters go first, then lead again.
                    if self._ready:
                        self._ready.append(_LEAD)  # behind them: no worker to wake for it
                        return None
                    continue
                mine = held[0]
                woken = self._queue_locked([*held[1:], _LEAD])
            wake_all(woken)
            return mine

    def _claim_locked(self, lane: Hashable) -> Task | None:
        """Take ``lane``'s next task and own the lane; None if stop() dropped its tasks."""
        tasks = self._lanes.get(lane)
        if not tasks:
            return None
        task = tasks.popleft()
        self._owned.add(lane)
        self._num_running += 1
        return task

    def _run_one(self, lane: Hashable) -> None:
        with self._lock:
            task = self._claim_locked(lane)
        if task is not None:
            self._run_task(lane, task)

    def _run_task(self, lane: Hashable, task: Task) -> None:
        try:
            task()
        except Exception as exc:  # tasks report their own failures; this is the last net
            self._on_error(exc)
        self._release(lane)
        self._call(self._after_task)

    def _release(self, lane: Hashable) -> None:
        """The owner of ``lane`` finished a task: queue the lane again or drop it."""
        woken: list[Parker] = []
        with self._lock:
            self._num_running -= 1
            self._owned.discard(lane)
            if self._lanes[lane]:
                woken = self._queue_locked([lane])  # round robin: back at the tail
            else:
                del self._lanes[lane]
                if not self._lanes and self._num_idle_waiters:
                    self._is_idle.notify_all()
        wake_all(woken)

    def _call(self, fn: Callable[[], None] | None) -> None:
        if fn is None:
            return
        try:
            fn()
        except Exception as exc:  # tasks report their own failures; this is the last net
            self._on_error(exc)

    # ----------------------------------------------------------------- control

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no lane has work and no task runs; False on timeout."""
        with self._lock:
            self._num_idle_waiters += 1
            try:
                return self._is_idle.wait_for(lambda: not self._lanes or self._is_stopped, timeout)
            finally:
                self._num_idle_waiters -= 1

    def stop(self, join_timeout_s: float) -> list[str]:
        """Stop taking work, let running tasks finish, drop queued ones; idempotent.

        Returns the names of threads still alive after the join timeout.
        """
        woken: list[Parker] = []
        with self._lock:
            if not self._is_stopped:
                self._is_stopped = True
                self.num_dropped_at_stop += sum(len(q) for q in self._lanes.values())
                for lane in [lane for lane in self._lanes if lane not in self._owned]:
                    del self._lanes[lane]  # queued or held: nobody will remove them
                for q in self._lanes.values():  # owned: the owner removes the lane when done
                    q.clear()
                self._held.clear()
                # In front of what is queued: those lanes are gone (their entries are no-ops).
                self._ready.clear()
                woken = self._queue_locked([_STOP] * len(self._threads))
            self._is_idle.notify_all()
        wake_all(woken)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(join_timeout_s)
        return [t.name for t in self._threads if t.is_alive() and t is not me]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_lanes": len(self._lanes),
                "num_queued": sum(len(q) for q in self._lanes.values()),
                "num_running": self._num_running,
                "num_workers": self._num_workers,
            }

    def lanes(self) -> list[Hashable]:
        with self._lock:
            return list(self._lanes)

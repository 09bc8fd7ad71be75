"""Per-lane FIFO work over a small pool of threads (SPEC §10.15: order per request only).

A *lane* is a key (an external id on the send side, an internal id on the receive side).
Tasks of one lane run one at a time, in submission order; tasks of different lanes run in
parallel on up to ``num_workers`` threads. So one request's 64 MB put occupies one worker
while another request's codec chunk goes out on the next.

Invariants (under ``_lock``):

* a lane is in ``_lanes`` iff it has queued tasks or a worker is running one of its tasks;
* a lane is in ``_ready`` iff it has queued tasks and no worker owns it — so a lane is owned
  by at most one worker, which is what makes each lane serial;
* an owner takes one task per turn and re-queues the lane at the tail (round robin).

With a ``source`` (the receive side's arrival wait), the pool works leader/follower: one
idle worker at a time runs the source, which blocks for arrivals and submits polls; it
then runs the first of them itself while a follower takes over listening. So a chunk's
poll costs no extra thread hand-off, and a big decode never stops arrivals from being
dispatched while another worker is free.

Because a generation's cleanup task is submitted to the lane of its external id, it runs
after every task of that id submitted before it and before every task submitted after it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable

__all__ = ["LaneExecutor"]

Task = Callable[[], None]


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
    ) -> None:
        assert num_workers >= 1
        self._name = name
        self._num_workers = num_workers
        self._on_error = on_error
        self._after_task = after_task
        self._on_idle = on_idle
        self._idle_interval_s = idle_interval_s
        self._source = source
        self._has_leader = False
        self._leader_ident: int | None = None  # thread running the source now
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._is_idle = threading.Condition(self._lock)
        self._lanes: dict[Hashable, deque[Task]] = {}
        self._ready: deque[Hashable] = deque()
        self._num_running = 0
        self._is_stopped = False
        self._threads: list[threading.Thread] = []
        self.num_dropped_at_stop = 0

    def start(self) -> None:
        for i in range(self._num_workers):
            t = threading.Thread(target=self._work, args=(i,), name=f"{self._name}-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def submit(self, lane: Hashable, task: Task) -> bool:
        """Queue ``task`` at the tail of ``lane``. Never blocks on I/O; False once stopped."""
        with self._lock:
            if self._is_stopped:
                return False
            queue = self._lanes.get(lane)
            if queue is None:
                self._lanes[lane] = deque((task,))
                self._ready.append(lane)
                # The leader submitting from its source takes the first ready lane itself
                # right after: waking a follower for it would only contend for the GIL.
                if not (len(self._ready) == 1 and self._leader_ident == threading.get_ident()):
                    self._has_work.notify()
            else:
                queue.append(task)  # its owner or its place in _ready picks it up
            return True

    def _work(self, index: int) -> None:
        # Only worker 0 wakes up when idle, so an idle pool costs one wakeup per interval.
        idle_timeout = self._idle_interval_s if (index == 0 and self._on_idle is not None) else None
        while True:
            with self._lock:
                role = self._next_role_locked(idle_timeout)
                if role is None:
                    return
                if role == "task":
                    lane = self._ready.popleft()
                    task = self._lanes[lane].popleft()
                    self._num_running += 1
                    if self._source is not None and not self._has_leader:
                        self._has_work.notify()  # a follower takes over listening
            if role == "lead":
                self._leader_ident = threading.get_ident()
                self._call(self._source)
                with self._lock:
                    self._has_leader = False
                    self._leader_ident = None
                continue
            if role == "idle":
                self._call(self._on_idle)
                continue
            self._call(task)
            with self._lock:
                self._num_running -= 1
                if self._lanes[lane]:
                    self._ready.append(lane)
                    self._has_work.notify()
                else:
                    del self._lanes[lane]
                    if not self._lanes:
                        self._is_idle.notify_all()
            self._call(self._after_task)

    def _next_role_locked(self, idle_timeout: float | None) -> str | None:
        """What this worker does next: a "task", "lead" (run the source), "idle", or stop (None)."""
        while True:
            if self._is_stopped:
                return None
            if self._ready:
                return "task"
            if self._source is not None and not self._has_leader:
                self._has_leader = True
                return "lead"
            if not self._has_work.wait(idle_timeout) and idle_timeout is not None:
                return "idle"

    def _call(self, fn: Callable[[], None] | None) -> None:
        if fn is None:
            return
        try:
            fn()
        except Exception as exc:  # tasks report their own failures; this is the last net
            self._on_error(exc)

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no lane has work and no task runs; False on timeout."""
        with self._lock:
            return self._is_idle.wait_for(lambda: not self._lanes or self._is_stopped, timeout)

    def stop(self, join_timeout_s: float) -> list[str]:
        """Stop taking work, let running tasks finish, drop queued ones; idempotent.

        Returns the names of threads still alive after the join timeout.
        """
        with self._lock:
            if not self._is_stopped:
                self._is_stopped = True
                self.num_dropped_at_stop += sum(len(q) for q in self._lanes.values())
                for lane in self._ready:  # not owned: nobody will remove them
                    del self._lanes[lane]
                self._ready.clear()
                for q in self._lanes.values():  # owned: the owner removes the lane when done
                    q.clear()
            self._has_work.notify_all()
            self._is_idle.notify_all()
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

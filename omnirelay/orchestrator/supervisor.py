"""Stage worker processes: spawning, watching and restarting them (docs/design.md §10).

:class:`StageSupervisor` owns the worker processes and the front's control sockets; the
orchestrator owns requests. Everything runs on the orchestrator's event loop thread.

* :meth:`StageSupervisor.start` — bind the control sockets, spawn one worker per stage
  (one per replica of a replicated stage; the supervisor knows workers by their index,
  :meth:`PipelineConfig.workers`, and supervises each alike)
  (forked from the front's fork server with the models' imports done,
  :mod:`omnirelay.worker.processes`), wait for every hello; a failure raises :class:`StageDiedError`
  naming the stage (a stage that cannot start at all is not restarted: that is a
  configuration or model error, and retrying it would only hide it).
* The workers of a device group (docs/design.md §12: the stages on one CUDA device) share
  one process (:func:`omnirelay.worker.group_main`): each keeps its own entry, control
  sockets and hello; their process is watched once, its death is each one's (one restart
  budget entry, one backoff, one sweep) and they restart together.
* Each worker's event socket is watched with ``loop.add_reader``: what it queued is read
  a bounded batch per loop callback and handed to :attr:`SupervisorHooks.route`.
* Each process's sentinel is watched with ``loop.add_reader``, so a dead worker is seen
  as soon as the kernel closes it — not when a request next trips on it. Then, in order:

  1. the worker's last queued messages are routed (its real reason may be among them);
  2. :attr:`SupervisorHooks.stage_down` fails at once every request that needed the
     stage, with ``stage_unavailable`` (docs/protocol.md §2.8: release by id everywhere,
     the dead stage's fences dropped);
  3. the connectors reclaim what the dead process owned (shm: slots, published keys,
     claim records; docs/protocol.md §3.5) — *before* any new process of the stage
     exists, so a reused id never meets a dead incarnation's key — on this host, and on
     a Ray-placed worker's node through its host actor; then :attr:`SupervisorHooks.swept`
     lifts its fences (a node no host could sweep: at the restarted worker's hello, its
     connector having swept the node as it started);
  4. :class:`RestartBook` decides: wait the backoff and spawn a new worker on fresh
     control sockets, or give up (``failed``, with the reason) when the policy's budget
     of restarts in its window is spent or restarts are off;
  5. the new worker's hello brings the stage back (:attr:`SupervisorHooks.stage_up`).
     A worker that dies while starting goes through the same path again.

* :meth:`StageSupervisor.stop` — ask every worker to stop, wait (then SIGTERM, then
  SIGKILL), close the sockets. The orchestrator reclaims the namespace after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from omnirelay.connectors import reclaim_namespace
from omnirelay.errors import StageDiedError
from omnirelay.orchestrator.front_control import FrontControl
from omnirelay.orchestrator.stage_processes import StageProcess, StageState, describe_exit
from omnirelay.pipeline.groups import process_groups
from omnirelay.pipeline.restart import RestartPolicy
from omnirelay.worker import WorkerSpec, group_main, worker_main
from omnirelay.worker.messages import Shutdown, ToFront
from omnirelay.worker.processes import worker_context
from omnirelay.worker.worker_control import ControlPaths

__all__ = ["RestartBook", "StageSupervisor", "SupervisorHooks"]

#: Messages of one worker routed per loop callback (:meth:`StageSupervisor._read`).
_READ_BATCH = 64


class RestartBook:
    """The restart budget of one pipeline under its :class:`RestartPolicy` (pure; the clock
    is passed in): ``max_restarts`` in ``window_s`` for all its workers together (every
    stage, every replica) — a pipeline whose processes keep dying stops being restarted,
    whichever of them dies — while each worker's backoff doubles with its own restarts
    in the window."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: deque[tuple[float, int]] = deque()  # (when, worker) of each restart

    def next_delay(self, worker: int, now: float) -> float | None:
        """A worker died at ``now``: the wait before its restart (booked as done now), or
        None when the policy gives up (restarts off, or the window's budget spent)."""
        times = self._times
        while times and times[0][0] <= now - self.policy.window_s:
            times.popleft()
        if len(times) >= self.policy.max_restarts:
            return None
        delay = self.policy.backoff(self.num_recent(worker))
        times.append((now, worker))
        return delay

    def num_recent(self, worker: int | None = None) -> int:
        """Restarts in the window (of ``worker`` alone, when given)."""
        return sum(1 for _, w in self._times if worker is None or w == worker)


@dataclass(frozen=True, slots=True)
class SupervisorHooks:
    """What the supervisor tells the orchestrator (each called on the loop thread, with
    the worker's index)."""

    #: a stage's process died: refuse new requests that need it with the second reason,
    #: fail the in-flight ones with the first; (stage, reason, unavailable, retry-after)
    stage_down: Callable[[int, str, str, float | None], None]
    #: what requests needing the down stage are told from now on
    stage_unavailable: Callable[[int, str, float | None], None]
    #: a restarted stage said hello: it takes requests again
    stage_up: Callable[[int], None]
    #: route one message a worker sent
    route: Callable[[int, ToFront], None]
    #: a worker said hello during the pipeline's start (its index)
    stage_ready: Callable[[int], None] | None = None
    #: the objects of a dead worker's process were reclaimed (after ``stage_down``)
    swept: Callable[[int], None] | None = None


class StageSupervisor:
    """The stage worker processes of one pipeline; see the module docstring."""

    def __init__(
        self,
        *,
        namespace: str,
        stages: list[StageProcess],
        make_spec: Callable[[int, ControlPaths], WorkerSpec],
        policy: RestartPolicy,
        startup_timeout_s: float,
        hooks: SupervisorHooks,
        spawn: Callable[[int, WorkerSpec], Any] | None = None,
        tcp_host: str | None = None,
        preload: Iterable[str] = (),
        groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.namespace = namespace
        self.stages = stages
        #: worker index -> the workers of its process (itself alone, or its device group);
        #: None: from the pipeline (:func:`omnirelay.pipeline.groups.process_groups`) at start
        self._groups: dict[int, tuple[int, ...]] | None = None
        if groups is not None:
            self._set_groups(groups)
        self._make_spec = make_spec
        self.book = RestartBook(policy)
        self._startup_timeout_s = startup_timeout_s
        self._hooks = hooks
        self.control: FrontControl | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: local workers start from the fork server, which imports ``preload`` once
        self._ctx = worker_context(preload)
        #: builds a stage's worker process (placement on Ray); None: a spawned local process
        self._spawn_process = spawn
        #: the front's address when workers run on other hosts (control plane over TCP)
        self._tcp_host = tcp_host
        self._tasks: set[asyncio.Future[Any]] = set()
        #: dead workers whose node no host could sweep: their fences wait for the hello of
        #: the restarted worker, whose connector sweeps the node as it starts
        self._swept_at_hello: set[int] = set()
        self.is_started = False
        self.is_closing = False
        #: undecodable messages from workers (skipped)
        self.num_bad_messages = 0

    def use_placement(self, spawn: Callable[[int, WorkerSpec], Any], tcp_host: str | None) -> None:
        """Start workers through ``spawn`` (placed on Ray nodes), control plane over TCP."""
        self._spawn_process, self._tcp_host = spawn, tcp_host

    @property
    def policy(self) -> RestartPolicy:
        return self.book.policy

    def _set_groups(self, groups: Sequence[Sequence[int]]) -> None:
        self._groups = {i: tuple(g) for g in groups for i in g}

    def group_of(self, worker: int) -> tuple[int, ...]:
        """The workers that share ``worker``'s process (started ones; itself included)."""
        group = self._groups.get(worker, (worker,)) if self._groups is not None else (worker,)
        return tuple(i for i in group if not self.stages[i].is_off) or (worker,)

    # -- first start ----------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn every worker and wait for its hello (see the module docstring)."""
        loop = self._loop = asyncio.get_running_loop()
        # Objects of dead owners in this namespace (an earlier crashed deployment).
        await loop.run_in_executor(None, lambda: reclaim_namespace(self.namespace))
        paths = ControlPaths.create(len(self.stages), self._tcp_host)
        try:
            self.control = FrontControl(paths)
        except BaseException:
            paths.remove()
            raise
        if self._groups is None:
            if self._spawn_process is None:
                self._set_groups(process_groups(self._make_spec(0, paths).pipeline))
            else:  # placed on Ray nodes: a process each
                self._set_groups([(st.index,) for st in self.stages])
        spawned: set[int] = set()
        for st in self.stages:
            if not st.is_off and st.index not in spawned:
                group = self.group_of(st.index)
                spawned.update(group)
                self._spawn(group, {i: paths for i in group})
        hellos = [st.hello for st in self.stages if st.hello is not None]
        done, pending = await asyncio.wait(
            hellos, timeout=self._startup_timeout_s, return_when=asyncio.FIRST_EXCEPTION
        )
        for fut in done:
            fut.result()  # raises the first StageDiedError
        if pending:
            late = ", ".join(st.label for st in self.stages if not st.is_ready and not st.is_off)
            raise StageDiedError(
                f"{late} did not start within {self._startup_timeout_s:g} s (building the engine took too long)"
            )
        # Every worker is connected: the socket files are not needed any more, and
        # without them a front that dies (SIGKILL) leaves nothing on disk.
        paths.remove()
        self.is_started = True

    def _spawn(self, group: tuple[int, ...], paths: dict[int, ControlPaths]) -> None:
        """Start the process of ``group`` (one worker, or a device group's workers)."""
        loop, control = self._loop, self.control
        assert loop is not None and control is not None
        members = [self.stages[i] for i in group]
        specs = [self._make_spec(st.index, paths[st.index]) for st in members]
        if self._spawn_process is not None:
            assert len(group) == 1, "workers placed on Ray run a process each"
            proc = self._spawn_process(group[0], specs[0])
        else:  # the environment as it is now, not as the fork server found it
            environ = dict(os.environ)
            specs = [dataclasses.replace(spec, environ=environ) for spec in specs]
            proc = self._ctx.Process(
                target=worker_main if len(specs) == 1 else group_main,
                args=(specs[0],) if len(specs) == 1 else (tuple(specs),),
                name=f"omnirelay-{self.namespace}-{'+'.join(st.process_name for st in members)}",
                daemon=True,
            )
        for st in members:
            st.hello = loop.create_future()
        proc.start()
        for st in members:
            st.new_process(proc)
            st.startup_began = time.monotonic()
        loop.add_reader(proc.sentinel, self._on_exit, group[0])
        for st in members:
            st.reader_fd = control.fileno(st.index)
            loop.add_reader(st.reader_fd, self._read, st.index)
            loop.call_soon(self._read, st.index)  # anything queued before the watch

    def on_hello(self, st: StageProcess) -> None:
        """The stage's worker said hello (routed by the orchestrator)."""
        st.is_ready = True
        st.startup_s = time.monotonic() - st.startup_began
        if st.hello is not None and not st.hello.done():
            st.hello.set_result(None)
        if st.index in self._swept_at_hello:
            self._report_swept([st])
        if not self.is_started:
            st.state = StageState.HEALTHY
            if self._hooks.stage_ready is not None:
                self._hooks.stage_ready(st.index)

    def _read(self, worker: int) -> None:
        """The worker's event socket may have messages: route the ones queued, a bounded
        batch at a time (the other workers' messages and the clients' calls get their
        turn in between)."""
        loop, control = self._loop, self.control
        if loop is None or control is None:
            return
        try:
            messages, num_bad, has_more = control.recv_ready(worker, _READ_BATCH)
        except zmq.ZMQError:  # the context was terminated at shutdown
            return
        if has_more:
            loop.call_soon(self._read, worker)
        self.num_bad_messages += num_bad
        for message in messages:
            try:
                self._hooks.route(worker, message)
            except Exception as exc:  # a bug: report it, and still route the rest of the burst
                label = self.stages[worker].label
                loop.call_exception_handler(
                    {"message": f"routing a message of {label} failed", "exception": exc}
                )

    def fail_hello(self, st: StageProcess, reason: str) -> None:
        if st.hello is not None and not st.hello.done():
            st.hello.set_exception(StageDiedError(reason))
            st.hello.exception()  # read by whoever waits for it; not an unretrieved error

    # -- a worker exited ----------------------------------------------------------------------

    def _on_exit(self, worker: int) -> None:
        """The process sentinel of ``worker``'s group became readable: it exited, and with
        it each stage it hosted (one restart of the group, one backoff, one budget entry)."""
        group = self.group_of(worker)
        loop, proc = self._loop, self.stages[group[0]].process
        assert loop is not None and proc is not None
        loop.remove_reader(proc.sentinel)
        # The sentinel closes as the process exits, a moment before it can be reaped.
        proc.join(timeout=1.0)
        down: list[tuple[StageProcess, str]] = []
        for index in group:
            reason = self._worker_exited(self.stages[index], proc)
            if reason is not None:
                down.append((self.stages[index], reason))
        if not down:
            return
        if self.is_closing or not self.is_started:
            for st, reason in down:
                message = f"{reason}; its requests were failed"
                self._hooks.stage_down(st.index, message, message, None)
                self._track(asyncio.ensure_future(self._sweep([st])))
            return
        delay = self.book.next_delay(group[0], time.monotonic())
        for st, reason in down:
            if delay is None:
                st.state = StageState.FAILED
                st.expected_back = None
                failed = f"{reason}; {self._give_up_note(st.index)}"
                self._hooks.stage_down(st.index, failed, failed, None)
            else:
                st.state = StageState.RESTARTING
                back_in = delay + st.startup_s
                st.expected_back = time.monotonic() + back_in
                shared = f" (with {self._shared_note(st, group)})" if len(group) > 1 else ""
                message = f"{reason}; its requests were failed, it is being restarted{shared}"
                restarting = f"{st.label} is restarting after its worker process died ({st.last_exit})"
                self._hooks.stage_down(st.index, message, restarting, back_in)
        self._track(asyncio.ensure_future(self._recover([st for st, _ in down], delay)))

    def _shared_note(self, st: StageProcess, group: tuple[int, ...]) -> str:
        return ", ".join(self.stages[i].label for i in group if i != st.index)

    def _worker_exited(self, st: StageProcess, proc: Any) -> str | None:
        """Books for one worker whose process exited; why it went down (None: it said
        goodbye while the pipeline shuts down)."""
        st.exitcode = proc.exitcode
        st.is_exited = True
        st.exited.set()
        st.last_exit = describe_exit(proc.exitcode)
        # Its last messages (a StartupFailed with the real reason, final outputs) may be
        # queued but not read yet: handle them before reporting the death.
        if self.control is not None:
            for message in self.control.recv_nowait(st.index):
                self._hooks.route(st.index, message)
        if self.is_closing and st.said_goodbye:
            return None
        where = (
            f" on node {proc.node['node_ip']} ({proc.node['node_id'][:12]})" if hasattr(proc, "node") else ""
        )
        if st.pid is None:  # a Ray-placed worker that died before its hello
            st.pid = proc.pid
        lost = getattr(proc, "lost", None)
        if lost:
            st.last_exit = lost
        reason = f"{st.label} worker process (pid {st.pid}{where}) died ({st.last_exit})"
        if st.cause is not None:  # it said why before it exited
            reason = f"{st.cause}; its worker process (pid {st.pid}) exited ({st.last_exit})"
        self.fail_hello(st, reason)
        return reason

    def _give_up_note(self, worker: int) -> str:
        if not self.policy.is_enabled:
            return "restarts are off (max_restarts: 0)"
        return (
            f"not restarted: the pipeline's workers were restarted {self.book.num_recent()} times within "
            f"{self.policy.window_s:g} s already (restart policy: {self.policy.describe()})"
        )

    async def _sweep(self, members: list[StageProcess], *, restarting: bool = False) -> None:
        """Reclaim the dead process's objects — on this host, and on its Ray node through
        its host actor — then tell the orchestrator (its fences). A node no host could
        sweep (the actor or the node was lost) is swept by the restarted worker's connector
        as it starts: with ``restarting`` the fences wait for that worker's hello."""
        loop = asyncio.get_running_loop()
        swept = False
        try:
            await loop.run_in_executor(None, lambda: reclaim_namespace(self.namespace))
            sweep_node = getattr(members[0].process, "sweep_node", None)  # placed on a Ray node
            swept = sweep_node is None or await loop.run_in_executor(None, sweep_node, self.namespace)
        finally:  # a sweep that failed must not fence the dead worker's ids for ever
            if swept or not restarting:
                self._report_swept(members)
            else:
                self._swept_at_hello.update(st.index for st in members)

    def _report_swept(self, members: list[StageProcess]) -> None:
        for st in members:
            self._swept_at_hello.discard(st.index)
            if self._hooks.swept is not None:
                self._hooks.swept(st.index)

    def _stop_waiting_for_hello(self, members: list[StageProcess]) -> None:
        """No restarted worker will sweep (given up, shutting down): lift the fences now."""
        self._report_swept([st for st in members if st.index in self._swept_at_hello])

    async def _recover(self, members: list[StageProcess], delay: float | None) -> None:
        """Reclaim the dead process's objects, then restart its stages (unless given up)."""
        # Before any new process of the stage can put, and before an id the dead process
        # held is admitted again: a reused id must not find a dead incarnation's object
        # (docs/protocol.md §3.5 crash safety).
        await self._sweep(members, restarting=delay is not None and not self.is_closing)
        if self.is_closing or delay is None:
            self._stop_waiting_for_hello(members)
            return
        await asyncio.sleep(delay)
        if self.is_closing:
            self._stop_waiting_for_hello(members)
            return
        try:
            await self._restart(members)
        except Exception as exc:  # no new process (sockets, fork): nothing will bring it back
            self._stop_waiting_for_hello(members)
            for st in members:
                st.state = StageState.FAILED
                st.expected_back = None
                self._hooks.stage_unavailable(st.index, f"{st.label} could not be restarted: {exc!r}", None)

    async def _restart(self, members: list[StageProcess]) -> None:
        loop, control = self._loop, self.control
        assert loop is not None and control is not None
        old = members[0].process
        for st in members:
            if st.reader_fd is not None:
                loop.remove_reader(st.reader_fd)
                st.reader_fd = None
            st.process = None
        if old is not None:
            old.close()
        paths: dict[int, ControlPaths] = {}
        try:
            for st in members:
                paths[st.index] = control.rebind(st.index)
            for st in members:
                st.num_restarts += 1
            self._spawn(tuple(st.index for st in members), paths)
            for st in members:
                st.expected_back = time.monotonic() + st.startup_s
                restarting = st.death_reason or f"{st.label} is restarting"
                self._hooks.stage_unavailable(st.index, restarting, st.startup_s)
            hellos = [asyncio.shield(st.hello) for st in members if st.hello is not None]
            try:
                await asyncio.wait_for(asyncio.gather(*hellos), self._startup_timeout_s)
            except StageDiedError:
                return  # its exit is being handled: the next restart or the give-up
            except TimeoutError:
                proc = members[0].process
                if proc is not None and not members[0].is_exited:
                    proc.kill()  # its exit takes the usual path
                return
        finally:
            for p in paths.values():
                p.remove()
        for st in members:
            st.state = StageState.HEALTHY
            st.expected_back = None
            st.is_dead = False
            st.death_reason = None
            self._hooks.stage_up(st.index)

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    def retry_after(self, st: StageProcess) -> float | None:
        """Seconds until the stage is expected back (None: not expected)."""
        if st.expected_back is None:
            return None
        return max(0.0, st.expected_back - time.monotonic())

    # -- stop -------------------------------------------------------------------------------

    def send(self, worker: int, message: Any) -> bool:
        st = self.stages[worker]
        if st.is_dead or st.is_exited or self.control is None:
            return False
        return self.control.send(worker, message)

    async def stop(self, timeout_s: float) -> int:
        """Stop every worker (Shutdown, then SIGTERM, then SIGKILL), end supervision and
        close the control plane; returns how many workers had to be signalled."""
        self.is_closing = True
        for st in self.stages:
            if st.process is None or st.is_exited:
                continue
            if st.is_ready:
                self.send(st.index, Shutdown())
            else:  # still building its engine: it reads no messages yet
                st.process.terminate()
        num_killed = await self._reap_processes(timeout_s)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for st in self.stages:
            if st.reader_fd is not None:
                loop.remove_reader(st.reader_fd)
                st.reader_fd = None
        if self.control is not None:
            self.control.close()
        closed: set[int] = set()
        for st in self.stages:
            if st.process is not None and id(st.process) not in closed:
                closed.add(id(st.process))  # a device group's workers share one
                st.process.close()
        return num_killed

    async def _reap_processes(self, timeout_s: float) -> int:
        """Wait for every worker to exit; SIGTERM, then SIGKILL, the ones that do not."""
        running = [st for st in self.stages if st.process is not None and not st.is_exited]
        num_killed = 0
        for sig_timeout, escalate in ((timeout_s, "terminate"), (3.0, "kill"), (5.0, None)):
            if running:
                waits = [asyncio.ensure_future(st.exited.wait()) for st in running]
                await asyncio.wait(waits, timeout=sig_timeout)
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
            running = [st for st in running if not st.is_exited]
            if not running or escalate is None:
                break
            signalled: set[int] = set()
            for st in running:
                assert st.process is not None
                if id(st.process) not in signalled:  # a device group's workers share one
                    signalled.add(id(st.process))
                    getattr(st.process, escalate)()
                num_killed += 1
        for st in running:  # the sentinel never fired (should not happen): join directly
            assert st.process is not None and self._loop is not None
            self._loop.remove_reader(st.process.sentinel)
            st.process.join(timeout=1.0)
            st.exitcode = st.process.exitcode
            st.is_exited = True
        return num_killed

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
* Each process's sentinel is watched with ``loop.add_reader``, so a dead worker is seen
  as soon as the kernel closes it — not when a request next trips on it. Then, in order:

  1. the worker's last queued messages are routed (its real reason may be among them);
  2. :attr:`SupervisorHooks.stage_down` fails at once every request that needed the
     stage, with ``stage_unavailable`` (docs/protocol.md §2.8: release by id everywhere,
     the dead stage's fences dropped);
  3. the connectors reclaim what the dead process owned (shm: slots, published keys,
     claim records; docs/protocol.md §3.5) — *before* any new process of the stage
     exists, so a reused id never meets a dead incarnation's key;
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omnirelay.connectors import reclaim_namespace
from omnirelay.errors import StageDiedError
from omnirelay.orchestrator.front_control import FrontControl
from omnirelay.orchestrator.stage_processes import StageProcess, StageState, describe_exit
from omnirelay.pipeline.restart import RestartPolicy
from omnirelay.worker import WorkerSpec, worker_main
from omnirelay.worker.messages import Shutdown, ToFront
from omnirelay.worker.processes import worker_context
from omnirelay.worker.worker_control import ControlPaths

__all__ = ["RestartBook", "StageSupervisor", "SupervisorHooks"]


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
    #: the stage's event socket may be readable
    read: Callable[[int], None]
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
    ) -> None:
        self.namespace = namespace
        self.stages = stages
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
        self.is_started = False
        self.is_closing = False

    def use_placement(self, spawn: Callable[[int, WorkerSpec], Any], tcp_host: str | None) -> None:
        """Start workers through ``spawn`` (placed on Ray nodes), control plane over TCP."""
        self._spawn_process, self._tcp_host = spawn, tcp_host

    @property
    def policy(self) -> RestartPolicy:
        return self.book.policy

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
        for st in self.stages:
            if not st.is_off:
                self._spawn(st, paths)
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

    def _spawn(self, st: StageProcess, paths: ControlPaths) -> None:
        loop, control = self._loop, self.control
        assert loop is not None and control is not None
        st.hello = loop.create_future()
        spec = self._make_spec(st.index, paths)
        if self._spawn_process is not None:
            proc = self._spawn_process(st.index, spec)
        else:  # the environment as it is now, not as the fork server found it
            proc = self._ctx.Process(
                target=worker_main,
                args=(dataclasses.replace(spec, environ=dict(os.environ)),),
                name=f"omnirelay-{self.namespace}-{st.process_name}",
                daemon=True,
            )
        proc.start()
        st.new_process(proc)
        st.startup_began = time.monotonic()
        loop.add_reader(proc.sentinel, self._on_exit, st.index)
        st.reader_fd = control.fileno(st.index)
        loop.add_reader(st.reader_fd, self._hooks.read, st.index)
        loop.call_soon(self._hooks.read, st.index)  # anything queued before the watch

    def on_hello(self, st: StageProcess) -> None:
        """The stage's worker said hello (routed by the orchestrator)."""
        st.is_ready = True
        st.startup_s = time.monotonic() - st.startup_began
        if st.hello is not None and not st.hello.done():
            st.hello.set_result(None)
        if not self.is_started:
            st.state = StageState.HEALTHY
            if self._hooks.stage_ready is not None:
                self._hooks.stage_ready(st.index)

    def fail_hello(self, st: StageProcess, reason: str) -> None:
        if st.hello is not None and not st.hello.done():
            st.hello.set_exception(StageDiedError(reason))
            st.hello.exception()  # read by whoever waits for it; not an unretrieved error

    # -- a worker exited ----------------------------------------------------------------------

    def _on_exit(self, worker: int) -> None:
        """The worker's process sentinel became readable: it exited."""
        st = self.stages[worker]
        loop, proc = self._loop, st.process
        assert loop is not None and proc is not None
        loop.remove_reader(proc.sentinel)
        # The sentinel closes as the process exits, a moment before it can be reaped.
        proc.join(timeout=1.0)
        st.exitcode = proc.exitcode
        st.is_exited = True
        st.exited.set()
        st.last_exit = describe_exit(proc.exitcode)
        # Its last messages (a StartupFailed with the real reason, final outputs) may be
        # queued but not read yet: handle them before reporting the death.
        if self.control is not None:
            for message in self.control.recv_nowait(worker):
                self._hooks.route(worker, message)
        if self.is_closing and st.said_goodbye:
            return
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
        if self.is_closing or not self.is_started:
            down = f"{reason}; its requests were failed"
            self._hooks.stage_down(worker, down, down, None)
            self._track(asyncio.ensure_future(self._sweep(st)))
            return
        delay = self.book.next_delay(worker, time.monotonic())
        if delay is None:
            st.state = StageState.FAILED
            st.expected_back = None
            failed = f"{reason}; {self._give_up_note(worker)}"
            self._hooks.stage_down(worker, failed, failed, None)
        else:
            st.state = StageState.RESTARTING
            back_in = delay + st.startup_s
            st.expected_back = time.monotonic() + back_in
            down = f"{reason}; its requests were failed, it is being restarted"
            restarting = f"{st.label} is restarting after its worker process died ({st.last_exit})"
            self._hooks.stage_down(worker, down, restarting, back_in)
        self._track(asyncio.ensure_future(self._recover(st, delay)))

    def _give_up_note(self, worker: int) -> str:
        if not self.policy.is_enabled:
            return "restarts are off (max_restarts: 0)"
        return (
            f"not restarted: the pipeline's workers were restarted {self.book.num_recent()} times within "
            f"{self.policy.window_s:g} s already (restart policy: {self.policy.describe()})"
        )

    async def _sweep(self, st: StageProcess) -> None:
        """Reclaim the dead process's objects, then tell the orchestrator (its fences)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, lambda: reclaim_namespace(self.namespace))
        finally:  # a sweep that failed must not fence the dead worker's ids for ever
            if self._hooks.swept is not None:
                self._hooks.swept(st.index)

    async def _recover(self, st: StageProcess, delay: float | None) -> None:
        """Reclaim the dead process's objects, then restart the stage (unless given up)."""
        # Before any new process of the stage can put, and before an id the dead process
        # held is admitted again: a reused id must not find a dead incarnation's object
        # (docs/protocol.md §3.5 crash safety).
        await self._sweep(st)
        if self.is_closing or delay is None:
            return
        await asyncio.sleep(delay)
        if self.is_closing:
            return
        try:
            await self._restart(st, st.death_reason or f"{st.label} is restarting")
        except Exception as exc:  # no new process (sockets, fork): nothing will bring it back
            st.state = StageState.FAILED
            st.expected_back = None
            self._hooks.stage_unavailable(st.index, f"{st.label} could not be restarted: {exc!r}", None)

    async def _restart(self, st: StageProcess, restarting: str) -> None:
        loop, control = self._loop, self.control
        assert loop is not None and control is not None
        if st.reader_fd is not None:
            loop.remove_reader(st.reader_fd)
            st.reader_fd = None
        if st.process is not None:
            st.process.close()
            st.process = None
        paths = control.rebind(st.index)
        try:
            st.num_restarts += 1
            self._spawn(st, paths)
            st.expected_back = time.monotonic() + st.startup_s
            self._hooks.stage_unavailable(st.index, restarting, st.startup_s)
            assert st.hello is not None
            try:
                await asyncio.wait_for(asyncio.shield(st.hello), self._startup_timeout_s)
            except StageDiedError:
                return  # its exit is being handled: the next restart or the give-up
            except TimeoutError:
                if st.process is not None and not st.is_exited:
                    st.process.kill()  # its exit takes the usual path
                return
        finally:
            paths.remove()
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
        for st in self.stages:
            if st.process is not None:
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
            for st in running:
                assert st.process is not None
                getattr(st.process, escalate)()
                num_killed += 1
        for st in running:  # the sentinel never fired (should not happen): join directly
            assert st.process is not None and self._loop is not None
            self._loop.remove_reader(st.process.sentinel)
            st.process.join(timeout=1.0)
            st.exitcode = st.process.exitcode
            st.is_exited = True
        return num_killed

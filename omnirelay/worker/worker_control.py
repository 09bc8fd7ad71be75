"""The control plane, worker side: ZeroMQ sockets between a stage worker and the front.

Topology (docs/design.md, processes): per worker process (a stage, or each of its
replicas), one PUSH/PULL pair each way over
``ipc://`` sockets in a private directory of the deployment (``mkdtemp``, mode 0700,
removed at close):

* ``w{i}.cmd`` — front PUSH (bound) → worker PULL (connected): :data:`ToWorker`;
* ``w{i}.evt`` — worker PUSH (connected) → front PULL (bound): :data:`ToFront`.

The front binds everything before it spawns the workers, so a worker only connects.

* :class:`ControlPaths` — the directory and the per-stage addresses (plain data, sent to
  the workers; the front side, :class:`omnirelay.orchestrator.front_control.FrontControl`,
  binds them).
* :class:`WorkerControl` — worker side, plain blocking zmq: a receive thread feeds an
  :class:`CommandInbox` and wakes the engine; ``send(message)`` from the engine thread.

Every socket has ``LINGER 0``: at shutdown nothing waits for an unread message (the
peer is going away too). A PUSH socket with no live peer cannot send; both sides turn
that into a value (``False`` / a :class:`PipelineError`) instead of blocking.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from omnirelay.errors import PipelineError
from omnirelay.worker.messages import Shutdown, ToFront, ToWorker, decode_to_worker, encode_message

__all__ = ["CommandInbox", "ControlPaths", "WorkerControl"]

#: ``sun_path`` holds 108 bytes; leave room for ``ipc://`` parsing and the file name.
_MAX_IPC_DIR = 80


@dataclass(frozen=True, slots=True)
class ControlPaths:
    """Where a deployment's control sockets live.

    With ``tcp_host`` (stages on other hosts), ``tcp://<tcp_host>:<port>`` instead, the
    ports chosen by the system when the front binds and recorded in ``bound`` (before the
    paths are sent to the workers)."""

    directory: str
    #: worker processes (a stage's replicas each have a pair; :meth:`PipelineConfig.workers`)
    num_workers: int
    tcp_host: str | None = None
    bound: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, num_workers: int, tcp_host: str | None = None) -> ControlPaths:
        """Make a fresh private directory (short enough for ``ipc://`` paths)."""
        base = tempfile.gettempdir()
        if len(base) > _MAX_IPC_DIR - 30:
            base = "/tmp"
        directory = tempfile.mkdtemp(prefix="omnirelay-ctl-", dir=base)
        return cls(directory=directory, num_workers=num_workers, tcp_host=tcp_host)

    def _addr(self, name: str) -> str:
        if self.tcp_host is None:
            return f"ipc://{self.directory}/{name}"
        return self.bound.get(name, f"tcp://{self.tcp_host}:0")

    def cmd_addr(self, worker: int) -> str:
        return self._addr(f"w{worker}.cmd")

    def evt_addr(self, worker: int) -> str:
        return self._addr(f"w{worker}.evt")

    def record(self, worker: int, cmd: str, evt: str) -> None:
        """The addresses the front bound (a ``:0`` port resolved)."""
        if self.tcp_host is not None:
            self.bound[f"w{worker}.cmd"], self.bound[f"w{worker}.evt"] = cmd, evt

    def remove(self) -> None:
        """Remove the directory and the socket files in it (idempotent)."""
        shutil.rmtree(self.directory, ignore_errors=True)


class CommandInbox:
    """Control messages the worker's receive thread hands to its engine thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[ToWorker] = deque()
        self.num_bad_messages = 0  # undecodable frames (counted, reported in health)

    def put(self, message: ToWorker) -> None:
        with self._cond:
            self._items.append(message)
            self._cond.notify_all()

    def take_all(self) -> list[ToWorker]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a message; True if one is waiting."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._items), timeout)


class WorkerControl:
    """The worker side of one stage's control pair.

    Two threads, one socket each (zmq sockets are not thread-safe): the **receive
    thread** (:meth:`start_receiving`) owns the command socket, decodes what arrives into
    a :class:`CommandInbox` and calls ``wake`` — so the engine thread, blocked in
    ``engine.wait_for_work``, sees a command at once; it also watches the parent process
    and posts a :class:`Shutdown` when the parent is gone. The **engine thread** owns the
    event socket (:meth:`send`) and calls :meth:`close`.
    """

    def __init__(self, paths: ControlPaths, worker: int) -> None:
        self.worker = worker
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._is_closed = False
        self._cmd = self._ctx.socket(zmq.PULL)
        self._evt = self._ctx.socket(zmq.PUSH)
        for sock in (self._cmd, self._evt):
            sock.setsockopt(zmq.LINGER, 0)
        self._cmd.setsockopt(zmq.RCVHWM, 0)
        self._evt.setsockopt(zmq.SNDHWM, 0)
        self._cmd.connect(paths.cmd_addr(worker))
        self._evt.connect(paths.evt_addr(worker))
        self._reader: threading.Thread | None = None

    def start_receiving(
        self,
        inbox: CommandInbox,
        *,
        wake: Callable[[], None],
        is_parent_alive: Callable[[], bool],
        parent_check_s: float = 0.5,
    ) -> None:
        """Start the receive thread (once)."""
        assert self._reader is None, "already receiving"
        self._reader = threading.Thread(
            target=self._receive,
            args=(inbox, wake, is_parent_alive, parent_check_s),
            name=f"omnirelay-control-w{self.worker}",
            daemon=True,
        )
        self._reader.start()

    def _receive(
        self,
        inbox: CommandInbox,
        wake: Callable[[], None],
        is_parent_alive: Callable[[], bool],
        parent_check_s: float,
    ) -> None:
        poller = zmq.Poller()
        poller.register(self._cmd, zmq.POLLIN)
        is_orphan = False
        try:
            while True:
                if not poller.poll(int(parent_check_s * 1000)):
                    if not is_orphan and not is_parent_alive():
                        is_orphan = True
                        inbox.put(Shutdown())
                        wake()
                    continue
                while True:
                    try:
                        data = self._cmd.recv(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        inbox.put(decode_to_worker(data))
                    except PipelineError:
                        inbox.num_bad_messages += 1
                wake()
        except zmq.ZMQError:
            return  # the context was terminated: close() is running
        finally:
            self._cmd.close(linger=0)

    def send(
        self, message: ToFront, *, is_peer_alive: Callable[[], bool] = lambda: True, timeout_s: float = 30.0
    ) -> None:
        """Send one message; waits while the front is not connected (it is, normally).

        Raises :class:`PipelineError` when the front stays unreachable for ``timeout_s``
        or ``is_peer_alive`` says it is gone: then nobody would ever read the message.
        """
        data = encode_message(message)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._evt.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if not is_peer_alive() or time.monotonic() > deadline:
                raise PipelineError(f"worker {self.worker}: the front process is unreachable")
            self._evt.poll(100, zmq.POLLOUT)

    def close(self) -> None:
        """Close both sockets and the context, stop the receive thread; idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        # Flush what is queued (a StartupFailed, the last outputs, Goodbye): linger 0 would
        # drop it. Bounded, so a dead front costs at most this at exit.
        self._evt.close(linger=1000)
        if self._reader is None:
            self._cmd.close(linger=0)
        # term() interrupts the receive thread's poll (ETERM); the thread closes its
        # socket, which lets term() return.
        self._ctx.term()
        if self._reader is not None:
            self._reader.join()

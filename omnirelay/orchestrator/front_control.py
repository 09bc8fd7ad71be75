"""The control plane, front side: the orchestrator's ends of every worker's socket pair.

:class:`FrontControl` binds the addresses of :class:`~omnirelay.worker.worker_control.ControlPaths`
(the topology is described in :mod:`omnirelay.worker.worker_control`) before the workers are
spawned. Plain zmq sockets used from the orchestrator's event-loop thread only:
non-blocking sends; the loop watches each event socket's descriptor
(:meth:`FrontControl.fileno`) and takes what is queued with
:meth:`FrontControl.recv_ready` — one wake-up per burst, no future per message.

A restarted worker gets a fresh socket pair (:meth:`FrontControl.rebind`): nothing the
dead worker queued can be read as the new worker's.

Every socket has ``LINGER 0``: at shutdown nothing waits for an unread message (the
peer is going away too). A PUSH socket with no live peer cannot send; that is a value
(``False``), not a blocked call.
"""

from __future__ import annotations

from typing import cast

import zmq

from omnirelay.errors import PipelineError
from omnirelay.worker.messages import ToFront, ToWorker, decode_to_front, encode_message
from omnirelay.worker.worker_control import ControlPaths

__all__ = ["FrontControl"]


class FrontControl:
    """The front side of every worker's control pair (a stage, or each of its replicas).

    Owned by the orchestrator's event-loop thread: every method is called from that
    thread only (zmq sockets are not thread-safe).
    """

    def __init__(self, paths: ControlPaths) -> None:
        self.paths = paths
        # Sends are synchronous non-blocking calls: no await, so one routing decision
        # sends all its messages in order. Receives never wait either (recv_ready).
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._cmd: list[zmq.Socket[bytes]] = []
        self._evt: list[zmq.Socket[bytes]] = []
        #: directories of restarted stages' sockets (removed once the worker connected)
        self._restart_paths: list[ControlPaths] = []
        self._is_closed = False
        try:
            for worker in range(paths.num_workers):
                cmd, evt = self._bind_pair(paths, worker)
                self._cmd.append(cmd)
                self._evt.append(evt)
        except BaseException:
            self.close()
            raise

    def _bind_pair(self, paths: ControlPaths, worker: int) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        cmd = self._ctx.socket(zmq.PUSH)
        cmd.setsockopt(zmq.LINGER, 0)
        cmd.setsockopt(zmq.SNDHWM, 0)  # bounded by the requests in flight
        evt = self._ctx.socket(zmq.PULL)
        evt.setsockopt(zmq.LINGER, 0)
        evt.setsockopt(zmq.RCVHWM, 0)
        try:
            cmd.bind(paths.cmd_addr(worker))
            evt.bind(paths.evt_addr(worker))
            paths.record(
                worker, cmd.getsockopt_string(zmq.LAST_ENDPOINT), evt.getsockopt_string(zmq.LAST_ENDPOINT)
            )
        except BaseException:
            cmd.close(linger=0)
            evt.close(linger=0)
            raise
        return cmd, evt

    def rebind(self, worker: int) -> ControlPaths:
        """Fresh sockets for a restarted worker, in a new private directory (the old socket
        files were removed once the first worker connected). Whatever the dead worker
        left unread goes with its old sockets: read it first (:meth:`recv_nowait`). The
        caller removes the returned directory once the new worker said hello."""
        if self._is_closed:
            raise PipelineError("the control plane is closed")
        paths = ControlPaths.create(self.paths.num_workers, self.paths.tcp_host)
        try:
            cmd, evt = self._bind_pair(paths, worker)
        except BaseException:
            paths.remove()
            raise
        self._cmd[worker].close(linger=0)
        self._evt[worker].close(linger=0)
        self._cmd[worker], self._evt[worker] = cmd, evt
        self._restart_paths.append(paths)
        return paths

    def send(self, worker: int, message: ToWorker) -> bool:
        """Queue ``message`` for the worker; False when no worker is connected (it died)."""
        if self._is_closed:
            return False
        try:
            self._cmd[worker].send(encode_message(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def fileno(self, worker: int) -> int:
        """The descriptor that turns readable when the worker's event socket may have
        messages (``loop.add_reader``). ZMQ signals it per burst of events, not per
        message: whoever sees it readable must call :meth:`recv_ready`."""
        return cast(int, self._evt[worker].getsockopt(zmq.FD))

    def recv_ready(self, worker: int, limit: int | None = None) -> tuple[list[ToFront], int, bool]:
        """The messages of the worker queued now (at most ``limit``), without waiting; the
        number of undecodable ones skipped; and whether more are queued (then the caller
        must come back without waiting for :meth:`fileno`: it is only re-armed once
        ``EVENTS`` shows no input left)."""
        if self._is_closed:
            return [], 0, False
        sock = self._evt[worker]
        out: list[ToFront] = []
        num_bad = 0
        while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            if limit is not None and len(out) + num_bad >= limit:
                return out, num_bad, True
            try:
                data = sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(decode_to_front(data))
            except PipelineError:
                num_bad += 1
        return out, num_bad, False

    def recv_nowait(self, worker: int) -> list[ToFront]:
        """Every message of the worker already queued here, without waiting (used when a
        worker exits, so its last words are read before its death is reported). Bad
        messages are skipped."""
        return self.recv_ready(worker)[0]

    def close(self) -> None:
        """Close every socket, the context and the directory; idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        for sock in [*self._cmd, *self._evt]:
            sock.close(linger=0)
        self._cmd.clear()
        self._evt.clear()
        self._ctx.term()
        self.paths.remove()
        for paths in self._restart_paths:
            paths.remove()

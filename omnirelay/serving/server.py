"""Running the app under uvicorn: :class:`ServerThread` (tests, bench) and :func:`serve_forever`.

``ServerThread`` runs one uvicorn server on an event loop in a thread of its own,
bound to ``host:port`` (``port=0``: a free port, read back as :attr:`ServerThread.port`),
and stops it cleanly (in-flight responses finish or are cancelled, the lifespan ends).
Sockets bind to the address given; the default is the loopback address.

:func:`bind_socket` binds the listening socket up front, so ``omnirelay serve`` fails at
once on a port it cannot have, before it starts any stage; :func:`serve_forever` then
serves on that socket.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from omnirelay.errors import OmniRelayError

__all__ = ["ServerThread", "bind_socket", "serve_forever", "uvicorn_config"]

_BIND_ADVICE = {
    errno.EADDRINUSE: "the address is already in use: another server listens there (stop it, or pick "
    "another --port)",
    errno.EACCES: "permission denied: ports below 1024 need root or CAP_NET_BIND_SERVICE (pick a port "
    "of 1024 or more)",
    errno.EADDRNOTAVAIL: "the address is not one of this host's (check --host; 0.0.0.0 is every interface)",
}


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, not listening yet (until the server starts,
    a client is refused rather than left waiting); :class:`OmniRelayError` that says why
    when it cannot be bound."""
    where = f"{host}:{port}"
    if not 0 <= port <= 65535:
        raise OmniRelayError(f"cannot listen on {where}: the port must be 0-65535 (0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise OmniRelayError(f"cannot listen on {where}: the host does not resolve ({exc})") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a restarted server may take the port while old connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        problem = _BIND_ADVICE.get(exc.errno or 0, exc.strerror or str(exc))
        raise OmniRelayError(f"cannot listen on {where}: {problem}") from exc
    return sock


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        ws="websockets-sansio",
        # The server answers with its own X-Request-Id; no Server/Date noise.
        server_header=False,
        timeout_graceful_shutdown=5,
    )


class ServerThread:
    """One uvicorn server in a background thread; a context manager."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning"
    ) -> None:
        self.host = host
        self._server = uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level))
        self._thread = threading.Thread(target=self._server.run, name="omnirelay-uvicorn", daemon=True)
        self.port = port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise OmniRelayError(
                    f"the HTTP server on {self.host}:{self.port} did not start (see its log)"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise OmniRelayError(f"the HTTP server did not start within {timeout_s} s")
            time.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Ask the server to exit and wait for its thread (idempotent)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Terminated(Exception):
    """SIGTERM arrived (raised by the handler :func:`serve_forever` installs)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def serve_forever(
    app: Any,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    sock: socket.socket | None = None,
    on_server: Callable[[uvicorn.Server], None] | None = None,
) -> None:
    """Run the server in this thread (on ``sock`` when given: one from :func:`bind_socket`)
    until SIGINT (then ``KeyboardInterrupt``) or SIGTERM (then it returns).

    uvicorn stops gracefully on either, then raises the signal again for the handler it
    found. SIGTERM's default action would end the process there, before the caller's
    cleanup (the stage processes, their shared memory); the handler installed here turns
    it into a normal return instead, so a service manager's stop is an orderly one.
    ``on_server`` is given the server before it runs (another thread may stop it through
    its ``should_exit``)."""
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if is_main else None
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level))
    if on_server is not None:
        on_server(server)
    try:
        server.run(sockets=None if sock is None else [sock])
    except _Terminated:
        pass
    finally:
        if is_main:
            signal.signal(signal.SIGTERM, previous)

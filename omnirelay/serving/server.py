"""Running the app under uvicorn: :class:`ServerThread` (tests, bench) and :func:`serve_forever`.

``ServerThread`` runs one uvicorn server on an event loop in a thread of its own,
bound to ``host:port`` (``port=0``: a free port, read back as :attr:`ServerThread.port`),
and stops it cleanly (in-flight responses finish or are cancelled, the lifespan ends).
Sockets bind to the address given; the default is the loopback address.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from omnirelay.errors import OmniRelayError

__all__ = ["ServerThread", "serve_forever", "uvicorn_config"]


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


def serve_forever(app: Any, host: str, port: int, *, log_level: str = "info") -> None:
    """Run the server in this thread until SIGINT/SIGTERM."""
    uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level)).run()

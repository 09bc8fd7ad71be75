"""A stage engine driven on a thread of the test process: the worker loop, minus the
control plane (the worker process's loop is :class:`omnirelay.worker.WorkerLoop`).

:func:`run_stage_loop` is the whole loop::

    while not should_stop():
        outputs = engine.step()            # commands, chunk events, one tick
        if outputs:
            emit(outputs)                  # to the test
        released = engine.take_released()  # completed releases, after the outputs
        if released:
            on_released(released)
        if not engine.has_work():
            engine.wait_for_work(idle_wait_s)   # blocks: no polling while idle

Commands (``add_request`` / ``abort`` / ``release``) come from another thread (the
test's) and wake the wait. ``idle_wait_s`` bounds how late a stall timeout is
noticed (``step`` collects them); with 1 s an idle stage wakes once a second.

:class:`StageLoopThread` runs the loop on a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from omnirelay.engine.interfaces import StageEngineProtocol, StageOutput

__all__ = ["DEFAULT_IDLE_WAIT_S", "StageLoopThread", "run_stage_loop"]

DEFAULT_IDLE_WAIT_S = 1.0


def run_stage_loop(
    engine: StageEngineProtocol,
    emit: Callable[[list[StageOutput]], None],
    *,
    should_stop: Callable[[], bool],
    on_released: Callable[[list[str]], None] = lambda ids: None,
    idle_wait_s: float = DEFAULT_IDLE_WAIT_S,
) -> None:
    """Drive ``engine`` until ``should_stop()`` or the engine is shut down; call
    ``engine.wake()`` after setting the stop condition so a waiting loop sees it at once."""

    def is_over() -> bool:
        return should_stop() or bool(getattr(engine, "is_closed", False))

    while not is_over():
        outputs = engine.step()
        if outputs:
            emit(outputs)
        released = engine.take_released()
        if released:
            on_released(released)
        if not is_over() and not engine.has_work():
            engine.wait_for_work(idle_wait_s)


class StageLoopThread:
    """:func:`run_stage_loop` on a daemon thread. ``stop()`` ends it; ``join()`` re-raises
    an exception the loop died of."""

    def __init__(
        self,
        engine: StageEngineProtocol,
        emit: Callable[[list[StageOutput]], None],
        *,
        on_released: Callable[[list[str]], None] = lambda ids: None,
        idle_wait_s: float = DEFAULT_IDLE_WAIT_S,
        name: str | None = None,
    ) -> None:
        self.engine = engine
        self._emit = emit
        self._on_released = on_released
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=name or f"omnirelay-stage-{engine.stage_id}", daemon=True
        )

    def start(self) -> StageLoopThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            run_stage_loop(
                self.engine,
                self._emit,
                should_stop=self._stop.is_set,
                on_released=self._on_released,
                idle_wait_s=self._idle_wait_s,
            )
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        wake = getattr(self.engine, "wake", None)
        if callable(wake):
            wake()

    def join(self, timeout: float | None = 10.0) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} did not stop within {timeout} s")
        if self.error is not None:
            raise self.error

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

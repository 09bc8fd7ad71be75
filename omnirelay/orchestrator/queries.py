"""Questions the front asks every live stage worker over the control plane, with a timeout.

:class:`WorkerQueries` numbers each question (``seq``), sends it to every worker that is
alive, and resolves the answers as the orchestrator routes them back (:meth:`answer`);
a worker that does not answer in time is simply missing from the result. Everything runs
on the orchestrator's event loop thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from omnirelay.orchestrator.stage_processes import StageProcess

__all__ = ["WorkerQueries"]


class WorkerQueries:
    """Pending questions to stage workers, by sequence number."""

    def __init__(self, send: Callable[[int, Any], bool]) -> None:
        self._send = send
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}

    async def ask(
        self, workers: Iterable[StageProcess], make: Callable[[int], Any], timeout_s: float
    ) -> dict[int, Any]:
        """Send ``make(seq)`` to every live worker; the replies by worker index (those in
        time only)."""
        loop = asyncio.get_running_loop()
        futures: dict[int, asyncio.Future[Any]] = {}
        for st in workers:
            if st.is_dead or st.is_exited:
                continue
            seq = next(self._seq)
            fut: asyncio.Future[Any] = loop.create_future()
            self._pending[seq] = fut
            if self._send(st.index, make(seq)):
                futures[st.index] = fut
            else:
                del self._pending[seq]
        if futures:
            await asyncio.wait(list(futures.values()), timeout=timeout_s)
        replies: dict[int, Any] = {}
        for index, fut in futures.items():
            if fut.done():
                replies[index] = fut.result()
            else:
                fut.cancel()
        for seq in [s for s, f in self._pending.items() if f.done()]:
            del self._pending[seq]
        return replies

    def answer(self, seq: int, reply: Any) -> None:
        """A worker's reply to question ``seq`` (late or unknown ones are dropped)."""
        fut = self._pending.pop(seq, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def cancel_all(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()

"""A request's async iterator yields its event loop a turn per output, so a consumer
that is behind (many outputs already queued) stays cancellable and fair: the loop runs
other tasks between its outputs, and a cancellation stops it at the next one."""

from __future__ import annotations

import asyncio

from omnirelay.orchestrator import RequestHandle
from omnirelay.orchestrator.requests import RequestOutput


def _handle_with_backlog(n: int) -> RequestHandle:
    handle = RequestHandle("r", abort=lambda rid: None)
    for i in range(n):
        handle.deliver(RequestOutput(request_id="r", stage_id=0, modality="text", token_ids=[i]))
    return handle


def test_a_consumer_behind_its_outputs_is_cancelled_at_the_next_one() -> None:
    async def main() -> int:
        handle = _handle_with_backlog(1000)
        seen = 0
        first = asyncio.Event()

        async def consume() -> None:
            nonlocal seen
            async for _ in handle:  # no await of its own: only the iterator can suspend
                seen += 1
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return seen

    assert asyncio.run(main()) <= 2  # not the whole backlog of 1,000


def test_two_consumers_behind_take_turns() -> None:
    async def main() -> list[str]:
        order: list[str] = []

        async def consume(name: str, handle: RequestHandle) -> None:
            async for _ in handle:
                order.append(name)
                if len(order) >= 6:
                    return

        a, b = _handle_with_backlog(100), _handle_with_backlog(100)
        await asyncio.gather(consume("a", a), consume("b", b))
        return order

    order = asyncio.run(main())
    assert order[:4] in (["a", "b", "a", "b"], ["b", "a", "b", "a"]), order

"""Many concurrent requests with seeded random aborts (the suite's reduced soak).

:func:`run_concurrent` plans ``num_requests`` requests (prompt, max_tokens, and for
``abort_fraction`` of them the number of outputs after which the client aborts), runs
them at once from one event loop, and checks every request that was not aborted against
``expect(prompt, max_tokens) -> (text token ids, waveform)``.

A request planned to be aborted asks for :data:`UNENDING` tokens, so it cannot end
before its client's abort arrives, however the threads are scheduled: every planned
abort lands (a short one would race its own completion, and an abort that arrives after
the end is a no-op), and the aborted ones' text so far is checked as a prefix.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from omnirelay.api import Pipeline
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.orchestrator.requests import RequestOutput

Expect = Callable[[list[int], int], tuple[list[int], torch.Tensor]]

#: max_tokens of a request planned to be aborted: far more outputs than any abort point
UNENDING = 1_000_000_000


@dataclass
class LoadReport:
    num_requests: int
    num_completed: int
    num_aborted: int
    num_abort_planned: int


def run_concurrent(
    pipe: Pipeline,
    expect: Expect,
    *,
    num_requests: int,
    abort_fraction: float,
    seed: int,
    max_tokens: tuple[int, int] = (1, 8),
    prefix: str = "c",
) -> LoadReport:
    rng = random.Random(seed)
    plan: list[tuple[list[int], int, int | None]] = []
    for i in range(num_requests):
        n = rng.randint(*max_tokens)
        abort_after = rng.randint(0, 2 * n) if rng.random() < abort_fraction else None
        plan.append(([rng.randint(0, 999), i % 997], n, abort_after))

    async def one(i: int, prompt: list[int], n: int, abort_after: int | None) -> list[RequestOutput]:
        handle = pipe.submit(
            prompt,
            modalities=["text", "audio"],
            sampling=SamplingParams(max_tokens=n if abort_after is None else UNENDING),
            request_id=f"{prefix}{i}",
        )
        outs: list[RequestOutput] = []
        if abort_after == 0:
            handle.abort()
        async for o in handle:
            outs.append(o)
            if abort_after is not None and len(outs) == abort_after:
                handle.abort()
        return outs

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan)))

    results = asyncio.run(main())
    report = LoadReport(num_requests, 0, 0, sum(1 for p in plan if p[2] is not None))
    for outs, (prompt, n, abort_after) in zip(results, plan):
        last = outs[-1]
        assert last.finished
        got_text = [t for o in outs if o.modality == "text" for t in o.token_ids]
        if last.finish_reason == "abort":
            assert abort_after is not None, "an abort nobody asked for"
            if got_text:  # what came before the abort is the request's own text
                assert got_text == expect(prompt, len(got_text))[0], (prompt, "aborted")
            report.num_aborted += 1
            continue
        assert abort_after is None, (prompt, "a planned abort was lost")
        text, wave = expect(prompt, n)
        pieces = [o.audio.reshape(-1) for o in outs if o.modality == "audio" and o.audio is not None]
        assert got_text == text, (prompt, n)
        assert pieces and torch.equal(torch.cat(pieces), wave), (prompt, n)
        report.num_completed += 1
    return report

"""The server's leak audit, ``GET /health?audit=1``: what the pipeline still holds.

:func:`leak_audit` reports, for a server with no request in flight, whether every request
that ended left nothing behind: per-request state in any stage's books (the pipeline's
:meth:`~omnirelay.api.Pipeline.leaks_async`, taken once in-flight cleanup settled),
requests the orchestrator still tracks, and transfer objects of the pipeline's namespace
(:meth:`~omnirelay.api.Pipeline.transfer_objects`: every connector backend's; pooled
slots, which live as long as the stages, are not counted). It asks every stage, so it
runs only when asked for, never on a plain health probe. Under load its numbers describe
the moment, not a leak.
"""

from __future__ import annotations

import asyncio
from typing import Any

from omnirelay.api import Pipeline

__all__ = ["leak_audit"]

#: At most this many leak lines are listed (the count is always whole).
MAX_LINES = 20


async def leak_audit(pipeline: Pipeline, num_in_flight: int) -> dict[str, Any]:
    """``{"clean", "num_in_flight", "pipeline_requests", "num_leaks", "leaks",
    "transfer_objects"}``; ``clean`` when all of them are zero."""
    leaks = await pipeline.leaks_async()
    objects = await asyncio.to_thread(pipeline.transfer_objects)
    pipeline_requests = pipeline.num_active
    return {
        "clean": not (leaks or objects or pipeline_requests or num_in_flight),
        "num_in_flight": num_in_flight,
        "pipeline_requests": pipeline_requests,
        "num_leaks": len(leaks),
        "leaks": leaks[:MAX_LINES],
        "transfer_objects": len(objects),
    }

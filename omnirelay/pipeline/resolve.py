"""The one resolver of a stage's ``async_chunk`` mode (docs/protocol.md §1.2).

Every consumer of the flag — scheduler choice, processor choice (§1.6), the
orchestrator's prewarm and forwarding rules (§1.5, §2.3, §2.5), edge validation (§1.3)
— goes through :func:`resolve_stage_async_chunk`, usually via
:meth:`PipelineConfig.resolved_async_chunk`. Two resolvers that disagree are how the
reference hung requests (a scheduler waiting for chunks while the processor built full
inputs), so there is no second one.
"""

from __future__ import annotations

__all__ = ["explain_stage_async_chunk", "resolve_stage_async_chunk"]


def resolve_stage_async_chunk(
    pipeline_async_chunk: bool, stage_async_chunk: bool | None, *, num_stages: int
) -> bool:
    """Resolved mode = pipeline flag AND (stage value is not False); off for ≤ 1 stage.

    ============  ==================  ========
    pipeline      stage               resolved
    ============  ==================  ========
    False         None / False / True False (a stage cannot turn it on)
    True          None / True         True
    True          False               False (opt-out)
    ============  ==================  ========
    """
    if num_stages <= 1:
        return False
    return pipeline_async_chunk and stage_async_chunk is not False


def explain_stage_async_chunk(
    pipeline_async_chunk: bool, stage_async_chunk: bool | None, *, num_stages: int, pipeline_origin: str
) -> str:
    """One line saying why :func:`resolve_stage_async_chunk` gave its answer.

    ``pipeline_origin`` says where the pipeline flag came from (``"default"``, ``"file"``
    or ``"override"``).
    """
    flag = f"pipeline async_chunk={str(pipeline_async_chunk).lower()}, {_ORIGIN_TEXT.get(pipeline_origin, pipeline_origin)}"
    if num_stages <= 1:
        return "off (forced: a pipeline with one stage has no edge to chunk)"
    if not pipeline_async_chunk:
        if stage_async_chunk is True:
            return f"off ({flag}; the stage's async_chunk: true cannot turn it on)"
        return f"off ({flag})"
    if stage_async_chunk is False:
        return f"off (the stage opts out with async_chunk: false; {flag})"
    if stage_async_chunk is True:
        return f"on (the stage sets async_chunk: true; {flag})"
    return f"on (inherits {flag})"


_ORIGIN_TEXT = {
    "default": "the default",
    "file": "set in the file",
    "override": "overridden on the command line",
}

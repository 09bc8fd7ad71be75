"""What a stage checks and fills in when a :class:`StageRequest` arrives (pure functions).

* :func:`stage_sampling` — the stage's sampling constraints and defaults applied to a
  request's :class:`SamplingParams`.
* :func:`admission_problem` — why a request cannot be admitted (None: it can). A refused
  request is answered with an error output, never an exception on the control path.
"""

from __future__ import annotations

import msgspec

from omnirelay.engine.interfaces import SamplingParams, StageRequest
from omnirelay.engine.stage_roles import StageRoles
from omnirelay.ids import request_id_problem
from omnirelay.pipeline.config import ExecutionType, StageConfig

__all__ = ["admission_problem", "stage_sampling"]

_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens")


def stage_sampling(stage: StageConfig, sampling: SamplingParams) -> SamplingParams:
    """The stage's stop tokens always apply (sampling constraints, docs/protocol.md §1.1, e.g. the
    Talker's codec stop 2150); its other settings fill a request that left its sampling
    at the default ``SamplingParams()``."""
    cfg = stage.sampling
    if sampling == SamplingParams():
        fields = {k: v for k in _DEFAULT_FIELDS if (v := getattr(cfg, k)) is not None}
        sampling = msgspec.structs.replace(sampling, **fields)
    stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *cfg.stop_token_ids)))
    if stops != sampling.stop_token_ids:
        sampling = msgspec.structs.replace(sampling, stop_token_ids=stops)
    return sampling


def admission_problem(
    request: StageRequest,
    sampling: SamplingParams,
    *,
    stage: StageConfig,
    roles: StageRoles,
    is_active: bool,
) -> str | None:
    """Why ``request`` (with its effective ``sampling``) cannot be admitted, or None."""
    ext = request.request_id
    problem = request_id_problem(ext, "request id")
    if problem is not None:
        return problem
    if is_active:
        return f"request id {ext!r} is already active at stage {stage.id}"
    if stage.execution_type is ExecutionType.AR:
        if sampling.max_tokens < 1:
            return f"max_tokens must be >= 1, got {sampling.max_tokens}"
        if not roles.is_receiver and not request.prompt_token_ids and request.inputs is None:
            return "the prompt is empty (no prompt_token_ids and no inputs)"
    return None

"""The external request id: one rule (:func:`omnirelay.ids.request_id_problem`), applied
at every boundary an id crosses — the API, a stage's admission, the sender, the receiver."""

from __future__ import annotations

from typing import Any

import pytest

from omnirelay.api import validate_request_id
from omnirelay.engine.intake import admission_problem
from omnirelay.engine.interfaces import SamplingParams, StageRequest
from omnirelay.engine.stage_roles import resolve_stage_roles
from omnirelay.errors import InvalidRequestError
from omnirelay.ids import MAX_REQUEST_ID_LEN, request_id_problem
from omnirelay.models.testing.toy import toy_pipeline_config
from omnirelay.transfer import SaveResult
from tests.transfer_fakes import collect, failed_for, make_pipeline

BAD_IDS = ["", "x" * (MAX_REQUEST_ID_LEN + 1), "a\nb", "nul\x00", "del\x7f", "c1\x85", "\ud800", 5, None]
GOOD_IDS = ["a", "x" * MAX_REQUEST_ID_LEN, "../../etc/passwd", "résumé 👍", "task_1_0", "a b", "nbsp\u00a0"]


def test_every_boundary_applies_the_one_external_id_rule() -> None:
    """The API raises, a stage's admission answers with the problem, the sender and the
    receiver record a failure: each with the reason of :func:`request_id_problem`."""
    pipeline = toy_pipeline_config()
    stage = pipeline.stage(1)
    roles = resolve_stage_roles(pipeline, stage)

    def admission(rid: Any) -> str | None:
        request = StageRequest(request_id=rid, prompt_token_ids=[1])
        return admission_problem(request, SamplingParams(), stage=stage, roles=roles, is_active=False)

    with make_pipeline() as p:
        for i, rid in enumerate(BAD_IDS):
            problem = request_id_problem(rid)
            assert problem is not None, rid
            with pytest.raises(InvalidRequestError, match="request_id"):
                validate_request_id(rid)
            assert admission(rid) == request_id_problem(rid, "request id")
            assert p.sender.save_async(f"s{i}", rid, {"c": 0}) is SaveResult.REJECTED
            assert not p.receiver.load_async(f"r{i}", rid)
        want = request_id_problem("", "external request id")
        sent = collect(p.sender, failed_for("s0")).failed
        got = collect(p.receiver, failed_for("r0")).failed
        assert [f.reason for f in sent if f.internal_id == "s0"] == [want]
        assert [f.reason for f in got if f.internal_id == "r0"] == [want]
        for rid in GOOD_IDS:
            assert request_id_problem(rid) is None and validate_request_id(rid) == rid
            assert admission(rid) is None
        for i in range(len(BAD_IDS)):  # what a scheduler does with a failed request
            p.sender.cleanup(f"s{i}")
            p.receiver.cleanup(f"r{i}")
        p.sender.take_external_failures()
        p.receiver.take_external_failures()
        p.audit()

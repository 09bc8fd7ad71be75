"""A pipeline started without audio input (``PipelineOptions.audio_input=False``: what
``omnirelay run`` does, its requests being text) does not start the stage only audio input
enters — voice-cpu's speech recognizer — serves text as usual, and refuses a request with
audio at once with a reason, starting nothing for it.
"""

from __future__ import annotations

import numpy as np
import pytest

from omnirelay import Pipeline, SamplingParams
from omnirelay.errors import InvalidRequestError
from omnirelay.models.inputs import audio_inputs
from tests.orchestrator_audit import audit_running, audit_stopped


def test_voice_cpu_without_audio_input_starts_no_recognizer() -> None:
    pipe = Pipeline.start("voice-cpu", audio_input=False, tokenizer=None)
    try:
        health = pipe.health()
        assert [(s.stage_id, s.state) for s in health.stages] == [
            (0, "off"),
            (1, "healthy"),
            (2, "healthy"),
            (3, "healthy"),
        ]
        assert health.is_healthy and health.status == "healthy" and health.stages[0].pid is None
        assert pipe.pids()[0] is None
        with pytest.raises(InvalidRequestError, match="without audio input"):
            pipe.submit(
                [0],
                modalities=["text"],
                inputs=audio_inputs([np.zeros(1600, dtype=np.int16)]),
                entry_stage_id=0,
            )
        assert pipe.num_active == 0
        res = pipe.submit([1, 2, 3], modalities=["text"], sampling=SamplingParams(max_tokens=2)).result(120)
        assert res.finish_reason in ("stop", "length")
        audit_running(pipe)
    finally:
        audit_stopped(pipe)

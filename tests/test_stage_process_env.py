"""Per-stage process settings: ``env``, ``gpu_share`` and ``gpu_priority`` in a pipeline
file, validated, shown by ``omnirelay check``, and in place in the stage's worker before
its engine is built (the CUDA driver reads MPS settings at context creation)."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest

from omnirelay.api import Pipeline, RuntimeHooks
from omnirelay.cli.check import build_report, render_report
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import PipelineConfigError
from omnirelay.pipeline import PipelineConfig, parse_pipeline
from omnirelay.pipeline.config import GpuPriority
from tests.orchestrator_audit import audit_running, audit_stopped
from tests.orchestrator_fakes import expected_text_tokens

FACTORY = "tests.orchestrator_fakes:build_env_checked_engine"


def _config(**stage1: Any) -> PipelineConfig:
    def stage(sid: int, name: str, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"id": sid, "name": name, "execution_type": "ar", "executor": f"fake.{name}"}
        if sid:
            out["input_sources"] = [sid - 1]
        out.update(kw)
        return out

    return parse_pipeline(
        {
            "name": "env-3stage",
            "stages": [
                stage(0, "thinker", chunk_processor="c0", final_output=True, final_output_type="text"),
                stage(1, "talker", chunk_processor="c1", **stage1),
                stage(
                    2, "code2wav", execution_type="generation", final_output=True, final_output_type="audio"
                ),
            ],
        }
    )


def test_settings_parse_into_the_process_environment() -> None:
    cfg = _config(env={"OMP_NUM_THREADS": 4, "MY_FLAG": "on"}, gpu_share=40, gpu_priority="low")
    talker = cfg.stages[1]
    assert talker.env == {"OMP_NUM_THREADS": "4", "MY_FLAG": "on"}  # numbers become strings
    assert talker.gpu_share == 40 and talker.gpu_priority is GpuPriority.LOW
    assert talker.process_env() == {
        "OMP_NUM_THREADS": "4",
        "MY_FLAG": "on",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_CLIENT_PRIORITY": "1",
    }
    assert cfg.stages[0].process_env() == {}
    assert _config(gpu_priority="normal").stages[1].process_env() == {"CUDA_MPS_CLIENT_PRIORITY": "0"}


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"gpu_share": 0}, "1..100"),
        ({"gpu_share": 101}, "1..100"),
        ({"gpu_share": 50.5}, "expected an int"),
        ({"gpu_priority": "high"}, "normal, low"),
        ({"env": {"1BAD": "x"}}, "not an environment variable name"),
        ({"env": {"A-B": "x"}}, "not an environment variable name"),
        ({"env": {"FLAG": True}}, "expected a string or a number"),
        ({"env": {"FLAG": None}}, "expected a string or a number"),
        ({"env": {"FLAG": [1]}}, "expected a string or a number"),
        ({"env": ["FLAG=1"]}, "expected a mapping"),
        ({"env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}, "gpu_share": 20}, "keep one of"),
        ({"env": {"CUDA_MPS_CLIENT_PRIORITY": "1"}, "gpu_priority": "low"}, "keep one of"),
    ],
)
def test_bad_settings_are_clear_errors(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(PipelineConfigError) as info:
        _config(**settings)
    assert words in str(info.value)
    assert "talker" in str(info.value)


def test_check_shows_the_process_environment() -> None:
    report = build_report(_config(gpu_share=60, env={"X": "1"}))
    assert report["stages"][1]["process_env"] == {"X": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}
    assert report["stages"][0]["process_env"] == {}
    out = io.StringIO()
    render_report(report, out)
    assert "process environment: X=1 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60" in out.getvalue()
    assert out.getvalue().count("process environment") == 1


def test_the_worker_sets_the_environment_before_building_its_engine() -> None:
    name = "OMNIRELAY_TEST_STAGE_FLAG"
    assert name not in os.environ
    cfg = _config(env={name: "talker-only"}, gpu_share=35, gpu_priority="low")
    # The factory refuses to build where a variable is missing: a started pipeline proves
    # each worker had its own settings before its engine existed.
    pipe = Pipeline.start(cfg, runtime=RuntimeHooks(engine_factory=FACTORY))
    try:
        res = pipe.submit([5], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=2)).result(
            timeout=30
        )
        assert res.token_ids("text") == expected_text_tokens([5], 2)
        assert name not in os.environ  # the front's environment is untouched
        audit_running(pipe)
    finally:
        audit_stopped(pipe)


def test_a_worker_forked_from_the_fork_server_has_the_fronts_environment_of_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing.forkserver

    from tests.orchestrator_fakes import FRONT_FLAG

    multiprocessing.forkserver.ensure_running()  # its environment is the front's before the flag
    monkeypatch.setenv(FRONT_FLAG, "front-now")
    pipe = Pipeline.start(
        _config(),
        runtime=RuntimeHooks(engine_factory="tests.orchestrator_fakes:build_front_env_checked_engine"),
    )
    try:
        res = pipe.submit([3], modalities=["text"], sampling=SamplingParams(max_tokens=2)).result(timeout=30)
        assert res.token_ids("text") == expected_text_tokens([3], 2)
        audit_running(pipe)
    finally:
        audit_stopped(pipe)

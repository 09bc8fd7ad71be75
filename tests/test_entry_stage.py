"""A speech-recognition stage in front of the prompt stage (docs/protocol.md §1.9): the
pipeline file's ``entry_input: audio``, its checks, and the router's two ways in — a
request with audio enters at the recognizer, whose transcript is shown to the client and
forwarded to the prompt stage; a request without audio enters at the prompt stage and
never touches the recognizer. Pure: no processes."""

from __future__ import annotations

from typing import Any

import pytest

from omnirelay.engine.interfaces import StageOutput
from omnirelay.errors import InvalidRequestError, PipelineConfigError
from omnirelay.orchestrator.requests import ForwardedInput, PipelineRequest, SourceOutput
from omnirelay.orchestrator.router import ClientOutput, Router, StageRelease, StageSubmit
from omnirelay.pipeline import PipelineConfig, StageConfig, load_pipeline, parse_pipeline


def _stage(sid: int, name: str, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": sid, "name": name, "execution_type": "ar", "executor": f"fake.{name}"}
    if sid > 0:
        out["input_sources"] = [sid - 1]
    out.update(kw)
    return out


def voice(**asr: Any) -> dict[str, Any]:
    return {
        "name": "voice",
        "stages": [
            _stage(0, "asr", execution_type="generation", entry_input="audio", async_chunk=False, **asr),
            _stage(
                1,
                "thinker",
                chunk_processor="c1",
                connector_role="sender",
                input_builder="asr_to_thinker",
                final_output=True,
                final_output_type="text",
            ),
            _stage(2, "voice", execution_type="generation", final_output=True, final_output_type="audio"),
        ],
    }


def _builder(source: SourceOutput, request: PipelineRequest, stage: StageConfig) -> ForwardedInput:
    return ForwardedInput(prompt_token_ids=[len(source.text)], extras={"transcript": source.text})


def test_the_shipped_voice_pipeline_hears_first() -> None:
    cfg = load_pipeline("voice-cpu")
    assert (cfg.audio_entry_stage_id, cfg.prompt_stage_id) == (0, 1)
    assert [s.name for s in cfg.stages] == ["asr", "thinker", "voice", "aligner"]
    tiny = load_pipeline("qwen3-omni-tiny")
    assert (tiny.audio_entry_stage_id, tiny.prompt_stage_id) == (None, 0)


def test_check_prints_the_recognizer_and_its_contract(capsys: pytest.CaptureFixture[str]) -> None:
    from omnirelay.cli.main import main

    assert main(["check", "voice-cpu"]) == 0
    out = capsys.readouterr().out
    assert "[0] asr: generation, executor asr.pocketsphinx" in out
    assert "entry: requests that carry audio (contract: the complete utterance in, 16 kHz mono; its " in out
    assert "entry: requests without audio (the prompt stage; audio is heard first by stage 0)" in out
    assert (
        "0 -> 1  asr -> thinker: complete input\n      connector default (shm); input builder asr_to_thinker"
        in out
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["stages"][0].update(final_output=True, final_output_type="text"),
            "feeds the next stage",
        ),
        (lambda d: d["stages"][0].update(chunk_processor="c0"), "handed over complete"),
        (lambda d: d["stages"][1].update(entry_input="audio"), "only stage 0 may take"),
        (lambda d: d["stages"][0].update(entry_input="video"), "expected one of audio"),
    ],
)
def test_entry_input_is_checked(change: Any, message: str) -> None:
    data = voice()
    change(data)
    with pytest.raises(PipelineConfigError, match=message):
        parse_pipeline(data)


def _router(cfg: PipelineConfig) -> Router:
    return Router(cfg, input_builders={1: _builder})


def test_a_request_without_audio_skips_the_recognizer() -> None:
    router = _router(parse_pipeline(voice()))
    actions = router.admit(
        PipelineRequest(request_id="t", prompt_token_ids=[5, 6], modalities=("text", "audio"))
    )
    submits = [a for a in actions if isinstance(a, StageSubmit)]
    assert [(a.stage_id, a.request.is_placeholder) for a in submits] == [(1, False), (2, True)]
    assert router.holders("t") == [1, 2]
    router.on_output(StageOutput(request_id="t", stage_id=1, token_ids=[9], text="hi", finished=True))
    done = router.on_output(StageOutput(request_id="t", stage_id=2, finished=True))
    assert any(isinstance(a, ClientOutput) and a.output.finished for a in done)
    assert {a.stage_id for a in done if isinstance(a, StageRelease)} == {0, 1, 2}
    assert router.num_requests == 0


def test_a_request_with_audio_is_heard_then_prompted() -> None:
    router = _router(parse_pipeline(voice()))
    clip = {"audio": [[0.0]], "sample_rate": 16000}
    actions = router.admit(
        PipelineRequest(
            request_id="a", prompt_token_ids=[0], modalities=("text",), inputs=clip, entry_stage_id=0
        )
    )
    assert [(a.stage_id, a.request.inputs) for a in actions if isinstance(a, StageSubmit)] == [(0, clip)]
    actions = router.on_output(StageOutput(request_id="a", stage_id=0, text="what is it", finished=True))
    (heard,) = [a.output for a in actions if isinstance(a, ClientOutput)]
    assert (heard.modality, heard.text, heard.finished) == ("transcript", "what is it", False)
    (forward,) = [a for a in actions if isinstance(a, StageSubmit)]
    assert forward.stage_id == 1 and forward.request.prompt_token_ids == [10]
    assert forward.request.extras["transcript"] == "what is it"
    done = router.on_output(StageOutput(request_id="a", stage_id=1, token_ids=[3], text="x", finished=True))
    assert [a.output.finished for a in done if isinstance(a, ClientOutput)] == [True]
    assert router.num_requests == 0


def test_only_the_two_entries_are_allowed() -> None:
    router = _router(parse_pipeline(voice()))
    for entry in (2, True, -1):
        with pytest.raises(InvalidRequestError, match=r"requests enter at stage 0 or 1"):
            router.admit(PipelineRequest(request_id="x", prompt_token_ids=[1], entry_stage_id=entry))
    assert router.num_requests == 0

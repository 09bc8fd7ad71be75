"""The orchestrator-side builders of forwarded (complete) inputs (docs/protocol.md §1.6, §2.5).

* :func:`build_input_builders` ``(pipeline) -> {stage_id: InputBuilder}`` — called in
  the front process: each stage's builder, resolved from its ``stage_input_builder``
  name. Names this table does not know use
  :func:`~omnirelay.orchestrator.requests.default_input_builder`.
* :func:`code2wav_to_aligner_builder` — Code2Wav's finished waveform → the aligner.

The worker side's counterpart (the stage engine factory) is :mod:`omnirelay.worker.factory`.
"""

from __future__ import annotations

import torch

from omnirelay.orchestrator.requests import (
    ForwardedInput,
    InputBuilder,
    PipelineRequest,
    SourceOutput,
    default_input_builder,
)
from omnirelay.pipeline import PipelineConfig, StageConfig

__all__ = ["build_input_builders", "code2wav_to_aligner_builder"]


def code2wav_to_aligner_builder(
    source: SourceOutput, request: PipelineRequest, stage: StageConfig
) -> ForwardedInput | None:
    """Code2Wav's finished waveform → the aligner's input (docs/protocol.md §5.4); None: no audio."""
    from omnirelay.processors import build_aligner_input

    if not source.audio:
        return None
    waveform = torch.cat([torch.as_tensor(a).reshape(-1) for a in source.audio])
    prompt = {"additional_information": dict(request.extras.get("additional_information") or {})}
    if "language" in request.extras:
        prompt["language"] = request.extras["language"]
    built = build_aligner_input(
        {"audio": waveform, "sr": source.sample_rate or 24000}, is_finished=source.finished, prompt=prompt
    )
    if built is None:
        return None
    inputs = {
        "prompt": built.prompt,
        "waveform": built.waveform,
        "sample_rate": built.sample_rate,
        "text": built.text,
        "words": list(built.words),
        "language": built.language,
        "audio_duration_ms": built.audio_duration_ms,
    }
    return ForwardedInput(prompt_token_ids=[0], inputs=inputs)


_BUILDERS: dict[str, InputBuilder] = {
    "code2wav_to_aligner": code2wav_to_aligner_builder,
}


def build_input_builders(pipeline: PipelineConfig) -> dict[int, InputBuilder]:
    """The builder of every stage that can receive a forwarded input."""
    out: dict[int, InputBuilder] = {}
    for stage in pipeline.stages:
        if not stage.input_sources:
            continue
        name = pipeline.stage_input_builder(stage)
        out[stage.id] = _BUILDERS.get(name or "", default_input_builder)
    return out

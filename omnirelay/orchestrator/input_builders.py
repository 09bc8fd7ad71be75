"""The orchestrator-side builders of forwarded (complete) inputs (docs/protocol.md §1.6, §2.5).

* :func:`build_input_builders` ``(pipeline) -> {stage_id: InputBuilder}`` — called in
  the front process: each stage's builder, resolved from its ``stage_input_builder``
  name. Names this table does not know use
  :func:`~omnirelay.orchestrator.requests.default_input_builder`.
* :func:`code2wav_to_aligner_builder` — Code2Wav's finished waveform → the aligner.
* :class:`TranscriptToPrompt` (``asr_to_thinker``) — a recognizer's transcript → the
  Thinker's chat prompt.

The worker side's counterpart (the stage engine factory) is :mod:`omnirelay.worker.factory`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnirelay.errors import ConfigError
from omnirelay.models.tools import TOOLS_EXTRA, ToolPrompt
from omnirelay.orchestrator.requests import (
    ForwardedInput,
    InputBuilder,
    PipelineRequest,
    SourceOutput,
    default_input_builder,
)
from omnirelay.pipeline import PipelineConfig, StageConfig

__all__ = [
    "CHAT_TURNS_EXTRA",
    "TranscriptToPrompt",
    "build_input_builders",
    "code2wav_to_aligner_builder",
]


def code2wav_to_aligner_builder(
    source: SourceOutput, request: PipelineRequest, stage: StageConfig
) -> ForwardedInput | None:
    """Code2Wav's finished waveform → the aligner's input (docs/protocol.md §5.4); None: no audio."""
    from omnirelay.processors import build_aligner_input

    if not source.audio:
        return None
    waveform = torch.cat([torch.as_tensor(a).reshape(-1) for a in source.audio])
    info = dict(request.extras.get("additional_information") or {})
    if not info.get("text") and source.answer_text:
        info["text"] = source.answer_text  # a chat answer: the words the voice spoke
    prompt = {"additional_information": info}
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


#: ``extras`` key of a request whose audio a recognizer hears first: its chat turns, each
#: ``[role, [part, ...]]`` with a part a text or ``{"audio": k}`` (the k-th clip).
CHAT_TURNS_EXTRA = "chat_turns"


class TranscriptToPrompt:
    """``asr_to_thinker``: the recognizer's transcripts → the prompt stage's chat prompt
    (docs/protocol.md §1.9). The recognizer's text is one transcript per clip, one line
    each; each ``{"audio": k}`` part of the request's turns becomes the k-th; the request's
    tools (:data:`~omnirelay.models.tools.TOOLS_EXTRA`) go into the model's template
    with them. The stage's
    prompt side (:func:`omnirelay.models.prompt_side`) is loaded when the builder is made
    (the front's startup), not per request."""

    def __init__(self, stage: StageConfig, pipeline: PipelineConfig) -> None:
        from omnirelay.models import prompt_side

        prompts = prompt_side(pipeline, stage)
        if prompts is None:
            raise ConfigError(f"{stage.label}: asr_to_thinker needs a text model with a tokenizer")
        self.prompts = prompts

    def __call__(
        self, source: SourceOutput, request: PipelineRequest, stage: StageConfig
    ) -> ForwardedInput | None:
        transcripts = source.text.split("\n")
        turns = []
        for role, parts in request.extras.get(CHAT_TURNS_EXTRA) or []:
            text = []
            for part in parts:
                if isinstance(part, str):
                    text.append(part)
                else:
                    k = int(part["audio"])
                    if not 0 <= k < len(transcripts):
                        raise ValueError(
                            f"the recognizer gave {len(transcripts)} transcript(s), none for clip {k}"
                        )
                    text.append(transcripts[k])
            turns.append((str(role), "".join(text)))
        if not turns:
            raise ValueError(f"the request has no {CHAT_TURNS_EXTRA!r} to put the transcript into")
        tooling = request.extras.get(TOOLS_EXTRA)
        if tooling is not None:
            ids = self.prompts.encode_chat_tools(turns, ToolPrompt.from_extra(tooling))
        else:
            ids = self.prompts.encode_chat(turns)
        return ForwardedInput(prompt_token_ids=ids, extras={"transcript": source.text})


_BUILDERS: dict[str, InputBuilder] = {
    "code2wav_to_aligner": code2wav_to_aligner_builder,
}
#: builders that need the stage to be made (a tokenizer to load)
_BUILDER_FACTORIES: dict[str, Callable[[StageConfig, PipelineConfig], InputBuilder]] = {
    "asr_to_thinker": TranscriptToPrompt,
}


def build_input_builders(pipeline: PipelineConfig) -> dict[int, InputBuilder]:
    """The builder of every stage that can receive a forwarded input."""
    out: dict[int, InputBuilder] = {}
    for stage in pipeline.stages:
        if not stage.input_sources:
            continue
        name = pipeline.stage_input_builder(stage) or ""
        factory = _BUILDER_FACTORIES.get(name)
        out[stage.id] = (
            factory(stage, pipeline) if factory is not None else _BUILDERS.get(name, default_input_builder)
        )
    return out

"""What a request is to the front: the client's request, the outputs it gets back, and
the contract of a forwarded (complete) input.

* :class:`PipelineRequest` — a validated client request, as the router sees it;
* :class:`RequestOutput` — what the client sees: one output of a final-output stage, or
  the request's end;
* :class:`RequestPlan` — which stages a request touches; :func:`stage_sampling_defaults`,
  :func:`requested_modalities` — a stage's sampling defaults, a client's modalities;
* :class:`SourceOutput` / :class:`ForwardedInput` / :class:`InputBuilder` — a finished
  stage's output, the next stage's input built from it, and the builder's signature
  (docs/protocol.md §2.5); :func:`default_input_builder` forwards tokens, text and audio.

The router (:mod:`omnirelay.orchestrator.router`) decides with these; the API, the
serving layer and the input builders exchange them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import InvalidRequestError
from omnirelay.pipeline import StageConfig

__all__ = [
    "ForwardedInput",
    "InputBuilder",
    "PipelineRequest",
    "RequestOutput",
    "RequestPlan",
    "SourceOutput",
    "default_input_builder",
    "requested_modalities",
    "stage_sampling_defaults",
]


class PipelineRequest(msgspec.Struct, kw_only=True, frozen=True):
    """A validated client request, as the router sees it.

    ``sampling`` holds the parameters of every stage (client values merged over the
    stage config's defaults by the API). ``prompt_token_ids`` may be ``None`` for an
    embeds-only prompt (carried in ``inputs``); such a request cannot be prewarmed.
    ``entry_stage_id``: the stage the request enters at, given ``prompt_token_ids`` and
    ``inputs`` (None: the pipeline's prompt stage; its ``entry_input`` stage for a request
    that carries audio, docs/protocol.md §1.9). ``session``: requests of one conversation
    or realtime session share it, so a replicated stage serves them on one replica where
    that helps (docs/design.md §11); None: no affinity. ``buffered``: the consumer holds
    the outputs until the answer is whole (a non-streamed response), so the client has
    nothing of it before its last output: losing a replica runs it again however much
    the pipeline had produced, and its consumer gets a :attr:`RequestOutput.restarted`
    output first (docs/protocol.md §2.9).
    """

    request_id: str
    prompt_token_ids: list[int] | None
    modalities: tuple[str, ...] | None = None
    sampling: dict[int, SamplingParams] = {}
    inputs: Any = None
    extras: dict[str, Any] = {}
    entry_stage_id: int | None = None
    session: str | None = None
    buffered: bool = False


class RequestOutput(msgspec.Struct, kw_only=True):
    """What the client sees: one output of a final-output stage, or the request's end.

    ``stage_finished`` is the stage's own flag; ``finished`` is the request-level flag
    (every requested final output is done), set on exactly one output per request, the
    last one. A failed request ends with ``finish_reason == "error"`` and ``error`` set;
    an aborted one with ``finish_reason == "abort"``. A ``restarted`` output carries
    nothing: the request (a buffered one) lost a replica and runs again from the start,
    so every output before it belongs to the failed attempt and is to be dropped.
    """

    request_id: str
    stage_id: int
    #: "text" | "audio" | "timestamps" | "transcript" (what an ``entry_input: audio`` stage
    #: heard: one line per clip; never the request's last output) | "" (a terminal not tied
    #: to a stage)
    modality: str
    token_ids: list[int] = []
    text: str | None = None
    audio: Any = None  # 1-D float32 tensor of new samples
    sample_rate: int | None = None
    stage_finished: bool = False
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    #: a failure's kind for clients: ``"stage_unavailable"`` (a stage it needs is down;
    #: servers answer 503) or None (the request itself failed)
    error_code: str | None = None
    #: with ``stage_unavailable``: seconds until the stage is expected back (None: not expected)
    retry_after_s: float | None = None
    metrics: dict[str, float] = {}
    restarted: bool = False


@dataclass(frozen=True, slots=True)
class SourceOutput:
    """Everything a finished stage produced for one request (client-visible parts):
    what an input builder sees when the orchestrator forwards it (docs/protocol.md §2.5)."""

    stage_id: int
    token_ids: list[int]
    text: str
    audio: list[Any]  # the waveform pieces, in order
    sample_rate: int | None
    finished: bool
    #: the request's answer as its prompt stage wrote it (what a voice spoke from it), when
    #: that stage is not this one: an aligner's text when the request carries none
    answer_text: str = ""


@dataclass(frozen=True, slots=True)
class ForwardedInput:
    """What an input builder returns: the next stage's prompt and full input."""

    prompt_token_ids: list[int]
    inputs: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


class InputBuilder(Protocol):
    """A stage's orchestrator-side input builder (docs/protocol.md §1.6, §2.5).

    Called once, when the source stage finished the request; returns ``None`` when there
    is nothing to build (then the request ends with an empty terminal output).
    """

    def __call__(
        self, source: SourceOutput, request: PipelineRequest, stage: StageConfig
    ) -> ForwardedInput | None: ...


def default_input_builder(
    source: SourceOutput, request: PipelineRequest, stage: StageConfig
) -> ForwardedInput | None:
    """Forward the source's generated tokens as the prompt and its text/audio as ``inputs``.

    Used for a complete-input edge whose stage names no input builder the orchestrator
    knows. Nothing generated (no tokens, no audio) → ``None``.
    """
    if not source.token_ids and not source.audio:
        return None
    inputs: dict[str, Any] = {"source_stage_id": source.stage_id, "token_ids": list(source.token_ids)}
    if source.text:
        inputs["text"] = source.text
    if source.audio:
        inputs["audio"] = torch.cat([torch.as_tensor(a).reshape(-1) for a in source.audio])
        inputs["sample_rate"] = source.sample_rate
    return ForwardedInput(prompt_token_ids=list(source.token_ids) or [0], inputs=inputs)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Which stages a request touches (docs/protocol.md §2.2, §2.3)."""

    final_output_stage_ids: tuple[int, ...]
    final_stage_id: int
    prewarm_stage_ids: tuple[int, ...]
    #: where the request enters: 0, or the prompt stage when it skips an entry_input stage
    entry_stage_id: int = 0

    @property
    def path(self) -> range:
        """Every stage the request needs: entry..final_stage_id (pipelines are linear)."""
        return range(self.entry_stage_id, self.final_stage_id + 1)


def stage_sampling_defaults(stage: StageConfig) -> SamplingParams:
    """The stage config's sampling values over :class:`SamplingParams`' defaults."""
    cfg = stage.sampling
    values = {
        name: getattr(cfg, name)
        for name in ("temperature", "top_k", "top_p", "seed", "max_tokens")
        if getattr(cfg, name) is not None
    }
    return SamplingParams(**values, stop_token_ids=tuple(cfg.stop_token_ids))


def requested_modalities(modalities: Sequence[str] | str | None) -> tuple[str, ...] | None:
    """Normalize a client's ``modalities`` argument; :class:`InvalidRequestError` on bad types."""
    if modalities is None:
        return None
    if isinstance(modalities, str):
        modalities = (modalities,)
    if not isinstance(modalities, Sequence) or not all(isinstance(m, str) for m in modalities):
        raise InvalidRequestError(
            f"modalities must be a list of strings such as ['text', 'audio'], got {modalities!r}"
        )
    return tuple(modalities)

"""The chunk processors of the Qwen3-Omni stages, as the transfer adapter calls them.

Each is a :class:`~omnirelay.transfer.ChunkProcessor`: the adapter calls ``build`` once
per stage step on a send worker with a :class:`~omnirelay.transfer.BuildRequest` (the
step's output, a snapshot of the request, the chunk id), and ``release`` when a
request's sender state must go (any :class:`~omnirelay.transfer.ReleaseScope`: a stream's
state is the request's). These classes keep the per-request stream state (keyed by external id) around the pure processors of
:mod:`thinker_to_talker` and :mod:`talker_to_code2wav`.

Registered by name with :func:`register_processors` (the names the shipped pipelines use):
``thinker_to_talker`` and ``talker_to_code2wav``, and the text edge of the CPU voice
pipeline, ``thinker_to_voice`` (:mod:`omnirelay.processors.thinker_to_voice`). Factories
take ``(stage, pipeline)``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from omnirelay.errors import PayloadEncodeError
from omnirelay.payload.schema import OmniPayload
from omnirelay.pipeline import PipelineConfig, StageConfig
from omnirelay.processors.talker_to_code2wav import (
    CodecStreamState,
    TalkerToCode2WavConfig,
    TalkerToCode2WavProcessor,
)
from omnirelay.processors.thinker_to_talker import ThinkerStreamState, ThinkerToTalkerProcessor
from omnirelay.processors.thinker_to_voice import register_voice_processors
from omnirelay.transfer import BuildRequest, ReleaseScope

__all__ = ["TalkerToCode2WavStage", "ThinkerToTalkerStage", "register_processors", "request_voice"]


def request_voice(context: Any) -> str | None:
    """The voice the client asked for (the request's ``extras["voice"]``, lower-cased), when
    the request snapshot carries the request's extras; ``None`` otherwise (the Talker then
    speaks with its default speaker).

    The serving layer puts the voice in the request's extras, the orchestrator sends them
    with every :class:`~omnirelay.engine.interfaces.StageRequest`, and the stage engine keeps
    them on its request and in every :class:`~omnirelay.engine.request.RequestSnapshot`.
    """
    extras = getattr(context, "extras", None)
    voice = extras.get("voice") if isinstance(extras, Mapping) else None
    return voice.strip().lower() if isinstance(voice, str) and voice.strip() else None


class ThinkerToTalkerStage:
    """Thinker step outputs → Talker payloads (docs/protocol.md §5.1), one stream state per request.

    The Thinker executor captures exactly the hidden layers ``{0, accept_hidden_layer}``
    (the Talker config's layer), so the accepted layer is read off the first step's
    output rather than configured twice.
    """

    def __init__(self, stage: StageConfig, pipeline: PipelineConfig) -> None:
        self.stage_id = stage.id
        self._lock = threading.Lock()
        self._states: dict[str, ThinkerStreamState] = {}
        self._proc: ThinkerToTalkerProcessor | None = None

    def build(self, req: BuildRequest) -> OmniPayload | None:
        out = req.output
        with self._lock:
            state = self._states.get(req.external_id)
        if out is None:  # a step with no new rows: the adapter's envelope carries the end
            return None
        if not isinstance(out, dict) or "hidden_layers" not in out:
            raise PayloadEncodeError(
                f"thinker_to_talker: stage {self.stage_id} step output must be the Thinker executor's "
                f"mapping with 'hidden_layers', got {type(out).__name__}"
            )
        if self._proc is None:
            layers = [int(k) for k in out["hidden_layers"]]
            self._proc = ThinkerToTalkerProcessor(accept_hidden_layer=max(layers))
        if state is None:
            prompt = list(req.context.prompt_token_ids) if req.context is not None else []
            state = self._proc.new_state(prompt, speaker=request_voice(req.context))
            with self._lock:
                self._states[req.external_id] = state
        return self._proc.step(state, chunk_id=req.chunk_id, finished=req.is_finished, **out)

    def release(self, external_id: str, scope: ReleaseScope) -> None:
        with self._lock:
            self._states.pop(external_id, None)

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            return {"thinker_to_talker_states": sorted(self._states)} if self._states else {}


class TalkerToCode2WavStage:
    """Talker codec frames → Code2Wav decode windows (docs/protocol.md §5.2), one state per request.

    The 4/25/25 schedule comes from the next stage's input connector ``extra``.
    """

    def __init__(self, stage: StageConfig, pipeline: PipelineConfig) -> None:
        self.stage_id = stage.id
        extra: dict[str, Any] = {}
        consumers = pipeline.consumer_ids(stage)
        if consumers:
            name = pipeline.input_connector(consumers[0])
            if name is not None:
                extra = dict(pipeline.connector_spec(name).extra)
        self._proc = TalkerToCode2WavProcessor(
            TalkerToCode2WavConfig.from_extra(extra, reproducible=pipeline.reproducible)
        )
        self._lock = threading.Lock()
        self._states: dict[str, CodecStreamState] = {}

    @property
    def frame_seconds(self) -> float:
        """The audio of one codec frame (the edge's ``codec_frame_ms``), in seconds."""
        return self._proc.config.codec_frame_ms / 1000.0

    def build(self, req: BuildRequest) -> OmniPayload | None:
        with self._lock:
            state = self._states.get(req.external_id)
            if state is None:
                stops = req.context.sampling.stop_token_ids if req.context is not None else ()
                state = self._states[req.external_id] = self._proc.new_state(stop_token_ids=stops)
        return self._proc.step(state, req.output, chunk_id=req.chunk_id, finished=req.is_finished)

    def release(self, external_id: str, scope: ReleaseScope) -> None:
        with self._lock:
            self._states.pop(external_id, None)

    def leak_state(self) -> dict[str, Any]:
        with self._lock:
            return {"talker_to_code2wav_states": sorted(self._states)} if self._states else {}


def register_processors(processors: Any, *, replace: bool = False) -> Any:
    """Register the shipped chunk processors in a processor :class:`Registry`."""
    processors.add("thinker_to_talker", ThinkerToTalkerStage, replace=replace)
    processors.add("talker_to_code2wav", TalkerToCode2WavStage, replace=replace)
    register_voice_processors(processors, replace=replace)
    return processors

"""Turning request updates into :class:`StageOutput` messages (the client-visible part).

* Streaming requests (``stream=True``, the default): one output per step that produced
  something (tokens, text, audio), and a final one (``finished=True``) carrying the last
  step's content, the finish reason and the request's metrics.
* Non-streaming requests: nothing per step; the final output carries every token id, the
  joined text and the concatenated audio.

An aborted request's final output carries what a non-streaming request accumulated so
far (partial output, docs/protocol.md §2.7); a streaming one has already sent it.

A final output's ``metrics`` carry the request's counts and latencies at this stage
(:func:`_metrics`). Per-step timing is no part of it: an engine's optional tracer adds
its own keys (:mod:`omnirelay.engine.tracing`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from omnirelay.engine.interfaces import StageOutput
from omnirelay.engine.request import Request
from omnirelay.engine.scheduler_base import RequestUpdate

__all__ = ["OutputBuilder", "concat_audio"]


@dataclasses.dataclass(slots=True)
class _Accumulated:
    texts: list[str] = dataclasses.field(default_factory=list)
    audio: list[Any] = dataclasses.field(default_factory=list)
    sample_rate: int | None = None


def concat_audio(parts: list[Any]) -> Any:
    """One 1-D waveform from the per-step parts (tensors, arrays or lists)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat([p.reshape(-1) for p in parts])
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate([p.reshape(-1) for p in parts])
    out: list[Any] = []
    for p in parts:
        out.extend(p.reshape(-1).tolist() if hasattr(p, "reshape") else list(p))
    return out


class OutputBuilder:
    """Per-request accumulators of non-streaming requests; builds every output."""

    def __init__(self, stage_id: int) -> None:
        self.stage_id = stage_id
        self._acc: dict[str, _Accumulated] = {}

    def step(self, update: RequestUpdate) -> StageOutput | None:
        """The output of a step of a live request (None: nothing to say now)."""
        request = update.request
        if not (update.new_token_ids or update.text or update.audio is not None):
            return None
        if not request.stream:
            self._accumulate(request.internal_id, update)
            return None
        return StageOutput(
            request_id=request.external_id,
            stage_id=self.stage_id,
            token_ids=list(update.new_token_ids),
            text=update.text,
            audio=update.audio,
            sample_rate=update.sample_rate,
        )

    def final(
        self,
        request: Request,
        update: RequestUpdate | None,
        *,
        error: str | None = None,
    ) -> StageOutput:
        """The request's last output (``finished=True``)."""
        reason = "error" if error is not None else request.status.finish_reason
        assert reason is not None, request
        message = error if error is not None else request.error
        if request.stream:
            token_ids = list(update.new_token_ids) if update is not None else []
            text = update.text if update is not None else None
            audio = update.audio if update is not None else None
            sample_rate = update.sample_rate if update is not None else None
        else:
            if update is not None:
                self._accumulate(request.internal_id, update)
            acc = self._acc.pop(request.internal_id, _Accumulated())
            token_ids = list(request.output_token_ids)
            text = "".join(acc.texts) if acc.texts else None
            audio = concat_audio(acc.audio)
            sample_rate = acc.sample_rate
        return StageOutput(
            request_id=request.external_id,
            stage_id=self.stage_id,
            finished=True,
            finish_reason=reason,
            token_ids=token_ids,
            text=text,
            audio=audio,
            sample_rate=sample_rate,
            error=message if reason == "error" else None,
            metrics=_metrics(request),
        )

    def rejected(self, request_id: str, reason: str) -> StageOutput:
        """A request refused at admission."""
        return StageOutput(
            request_id=request_id,
            stage_id=self.stage_id,
            finished=True,
            finish_reason="error",
            error=f"stage {self.stage_id} refused the request: {reason}",
        )

    def late_error(self, request_id: str, reason: str) -> StageOutput:
        """A request that finished here, whose chunks then failed to reach the next stage."""
        return StageOutput(
            request_id=request_id,
            stage_id=self.stage_id,
            finished=True,
            finish_reason="error",
            error=f"stage {self.stage_id} could not deliver the request's chunks: {reason}",
        )

    def _accumulate(self, internal_id: str, update: RequestUpdate) -> None:
        acc = self._acc.setdefault(internal_id, _Accumulated())
        if update.text:
            acc.texts.append(update.text)
        if update.audio is not None:
            acc.audio.append(update.audio)
        if update.sample_rate is not None:
            acc.sample_rate = update.sample_rate

    def drop(self, internal_id: str) -> None:
        self._acc.pop(internal_id, None)

    def clear(self) -> None:
        self._acc.clear()

    def leak_state(self) -> list[str]:
        return sorted(self._acc)


def _metrics(request: Request) -> dict[str, float]:
    out: dict[str, float] = {
        "num_prompt_tokens": float(len(request.prompt_token_ids)),
        "num_output_tokens": float(len(request.output_token_ids)),
        "num_steps": float(request.num_steps),
        "num_chunks_received": float(request.num_chunks_received),
    }
    end = request.finished_time
    if end is not None:
        out["e2e_s"] = end - request.arrival_time
    if request.first_scheduled_time is not None:
        out["queue_s"] = request.first_scheduled_time - request.arrival_time
    if request.first_token_time is not None:
        out["ttft_s"] = request.first_token_time - request.arrival_time
    return out

"""The generation scheduler: one-shot prefill per input (docs/protocol.md §1.1, §4.9 generation rules).

A generation stage (Code2Wav, an aligner) has no decode loop: each step computes a whole
input in one prefill and emits an output (audio samples).

* **Chunk-receiving** (Code2Wav with ``async_chunk``): the stage's chunk reader (the
  executor's ``read_chunk``, a :data:`~omnirelay.engine.interfaces.ChunkReader`) turns
  every committed chunk into the prompt ids and the runtime info of one prefill (SPEC
  §4.8): the prompt is replaced, ``num_computed_tokens`` resets to 0. After the step the
  request parks for its next chunk, keeping its slot, until the upstream is exhausted; it
  finishes after the step in which the upstream is exhausted **and** its input is
  computed. A placeholder never runs on its placeholder ids: it waits for its first
  chunk. A chunk that leaves nothing to compute is consumed and not run: before the end
  the request parks for the next one (the runtime info it left is kept for it); a
  segment end still runs, on the placeholder ``[0]``; the terminal finishes the request
  with no output — unless the reader gave it a placeholder prompt (Code2Wav: its runtime
  info still holds a ≥2-D codes tensor), which runs once. A chunk the reader rejects
  fails the request with the reader's reason.
* **Complete input** (chunking off, or a stage after a full-payload edge): the request's
  prompt (and ``inputs``) is computed in one step, then it finishes. An empty prompt with
  no ``inputs`` finishes with no output.

Either way the executor's ``finished`` also ends the request (FINISHED_STOPPED).
``max_tokens`` and ``stop_token_ids`` do not apply: a generation step samples no tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from omnirelay.engine.interfaces import BatchItem, ChunkReader, ItemResult
from omnirelay.engine.need import NeedPolicy, audio_seconds
from omnirelay.engine.request import Request, RequestStatus
from omnirelay.engine.scheduler_base import BaseScheduler, RequestUpdate
from omnirelay.errors import ConfigError
from omnirelay.transfer.events import ChunkInput

__all__ = ["GenerationScheduler"]


class GenerationScheduler(BaseScheduler):
    def __init__(
        self,
        *,
        stage_id: int,
        max_num_seqs: int,
        receives_chunks: bool,
        supports_batching: bool,
        max_num_batched_tokens: int | None = None,
        prefetch_chunks: bool = False,
        clock: Callable[[], float],
        chunk_reader: ChunkReader | None = None,
        need: NeedPolicy | None = None,
    ) -> None:
        """``chunk_reader`` is required when the stage receives chunks; the other
        arguments are :class:`BaseScheduler`'s."""
        super().__init__(
            stage_id=stage_id,
            max_num_seqs=max_num_seqs,
            receives_chunks=receives_chunks,
            supports_batching=supports_batching,
            max_num_batched_tokens=max_num_batched_tokens,
            prefetch_chunks=prefetch_chunks,
            clock=clock,
            need=need,
        )
        if receives_chunks and chunk_reader is None:
            raise ConfigError(
                f"stage {self.stage_id} receives chunks as a generation stage: it needs a chunk reader "
                "(the executor's read_chunk(runtime_info, payload) -> (prompt_token_ids, runtime_info), "
                "e.g. omnirelay.processors.read_codec_chunk)"
            )
        self._read_chunk = chunk_reader

    def _attach(self, request: Request, chunk: ChunkInput) -> str | None:
        assert self._read_chunk is not None  # Invariant: a receiving stage has a reader (__init__)
        try:
            prompt, info = self._read_chunk(request.runtime_info, chunk.payload)
        except (TypeError, ValueError) as exc:
            return (
                f"stage {self.stage_id}: chunk {chunk.chunk_id} of {chunk.external_id!r} violates the "
                f"payload contract: {exc}"
            )
        if not prompt and chunk.is_segment_finished:
            prompt = [0]  # the segment boundary still runs
        request.attach_generation_chunk(prompt, info, is_finished=chunk.is_finished)
        if not request.prompt_token_ids:
            request.has_ready_chunk = False  # nothing to compute: wait for more, or finish
        return None

    def _is_done_without_step(self, request: Request) -> bool:
        if request.num_uncomputed_tokens > 0:
            return False
        if self.receives_chunks:
            return request.is_upstream_exhausted
        return request.inputs is None  # complete input: an empty prompt runs only with inputs

    def _make_item(self, request: Request) -> BatchItem:
        prompt = request.prompt_token_ids
        return BatchItem(
            internal_id=request.internal_id,
            external_id=request.external_id,
            input_token_ids=prompt[request.num_computed_tokens :],
            all_token_ids=list(prompt),
            num_computed_tokens=request.num_computed_tokens,
            is_prefill=True,
            sampling=request.sampling,
            additional_information=request.additional_information,
            inputs=request.inputs,
            is_upstream_exhausted=request.is_upstream_exhausted,
        )

    def _apply_result(self, request: Request, item: BatchItem, result: ItemResult) -> RequestUpdate:
        request.num_computed_tokens = len(request.prompt_token_ids)
        now = self._clock()
        if result.audio is not None and request.first_token_time is None:
            request.first_token_time = now
        request.output_seconds += audio_seconds(result.audio, result.sample_rate)
        input_done = not self.receives_chunks or request.is_upstream_exhausted
        if result.finished or input_done:
            request.finish(RequestStatus.FINISHED_STOPPED, now)
        return RequestUpdate(
            request,
            new_token_ids=tuple(int(t) for t in result.token_ids),
            text=result.text,
            audio=result.audio,
            sample_rate=result.sample_rate,
            next_stage_output=result.next_stage_output,
        )

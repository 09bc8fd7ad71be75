"""The generation scheduler: one-shot prefill per input (SPEC §1.1, §4.9 generation rules).

A generation stage (Code2Wav, an aligner) has no decode loop: each step computes a whole
input in one prefill and emits an output (audio samples).

* **Chunk-receiving** (Code2Wav with ``async_chunk``): every committed chunk replaces the
  prompt with the chunk's ids, resets ``num_computed_tokens`` to 0 and carries the merged
  runtime info (SPEC §4.8) → one prefill. After the step the request parks for its next
  chunk, keeping its slot, until the upstream is exhausted; it finishes after the step
  in which the upstream is exhausted **and** its input is computed. A placeholder never
  runs on its placeholder ids: it waits for its first chunk. A chunk that leaves nothing
  to compute (the terminal-only chunk) finishes the request with no output — unless its
  runtime info still holds codec ``audio`` (a ≥2-D codes tensor), which runs once on the
  placeholder ``[0]`` the adapter gave it.
* **Complete input** (chunking off, or a stage after a full-payload edge): the request's
  prompt (and ``inputs``) is computed in one step, then it finishes. An empty prompt with
  no ``inputs`` finishes with no output.

Either way the executor's ``finished`` also ends the request (FINISHED_STOPPED).
``max_tokens`` and ``stop_token_ids`` do not apply: a generation step samples no tokens.
"""

from __future__ import annotations

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.engine.request import Request, RequestStatus
from omnirelay.engine.scheduler_base import BaseScheduler, RequestUpdate
from omnirelay.transfer.events import ChunkInput

__all__ = ["GenerationScheduler"]


class GenerationScheduler(BaseScheduler):
    receiver_kind = "generation"

    def _attach(self, request: Request, chunk: ChunkInput) -> None:
        request.attach_generation_chunk(
            chunk.prompt_token_ids or [], chunk.additional_information, is_finished=chunk.is_finished
        )
        if not request.prompt_token_ids:
            request.has_ready_chunk = False  # nothing to compute: wait for more, or finish

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
        )

    def _apply_result(self, request: Request, item: BatchItem, result: ItemResult) -> RequestUpdate:
        request.num_computed_tokens = len(request.prompt_token_ids)
        now = self._clock()
        if result.audio is not None and request.first_token_time is None:
            request.first_token_time = now
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

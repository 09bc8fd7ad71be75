"""The autoregressive (AR) scheduler: many requests at once, decode steps batched.

Per tick (see :mod:`omnirelay.engine.scheduler_base` for the queues and the tick):

* every RUNNING request that is runnable gets one item — a prefill of its prompt on its
  first step (or of everything after a preemption), then a decode of its last token;
* with ``supports_batching`` all items go in **one** executor call, else one call each;
  at most ``max_num_seqs`` requests hold a slot, and ``max_num_batched_tokens`` (when set)
  bounds the input tokens of one tick (always at least one item);
* with ``max_prefill_piece_tokens`` (when set) a prompt longer than that is prefilled in
  pieces of at most that many tokens, one per tick (``input_token_ids`` the slice,
  ``num_computed_tokens`` its start), so that one long prompt cannot make a step long
  (docs/design.md §12). The request keeps its slot between pieces and the other requests
  decode in the same steps; the executor answers a piece that is not the last with
  ``is_partial_prefill`` and nothing is sampled or emitted until the last piece. A
  recompute after a preemption is split the same way;
* a chunk-receiving stage (a Talker) needs one committed chunk per step until its
  upstream is exhausted (docs/protocol.md §4.9): after each step it parks in WAITING_FOR_CHUNK,
  keeping its slot, and the chunk's payload, as the upstream processor built it, becomes
  the next step's ``additional_information`` (consumed once); ``is_upstream_exhausted``
  says the last one came. Once exhausted it decodes on its own.

Stops (in this order, per sampled token): a token in ``stop_token_ids`` (kept in the
output) → FINISHED_STOPPED; ``max_tokens`` reached → FINISHED_LENGTH; tokens past either
are dropped. Then the executor's own ``finished`` → FINISHED_STOPPED.
"""

from __future__ import annotations

from typing import Any

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.engine.request import Request, RequestStatus
from omnirelay.engine.scheduler_base import BaseScheduler, RequestUpdate
from omnirelay.transfer.events import ChunkInput

__all__ = ["ARScheduler"]


class ARScheduler(BaseScheduler):
    def __init__(self, *, max_prefill_piece_tokens: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert max_prefill_piece_tokens is None or max_prefill_piece_tokens >= 1, max_prefill_piece_tokens
        #: the most prompt tokens one request computes in one step (None: all at once)
        self.max_prefill_piece_tokens = max_prefill_piece_tokens

    def _step_tokens(self, request: Request) -> int:
        cap = self.max_prefill_piece_tokens
        n = max(1, request.num_uncomputed_tokens)
        return n if cap is None else min(n, cap)

    def _attach(self, request: Request, chunk: ChunkInput) -> str | None:
        request.attach_ar_chunk(chunk.payload, is_finished=chunk.is_finished)
        return None  # the executor reads the payload, and says what is wrong with it

    def _make_item(self, request: Request) -> BatchItem:
        all_ids = request.all_token_ids
        is_prefill = request.num_steps == 0 or request.is_recompute
        start = request.num_computed_tokens
        return BatchItem(
            internal_id=request.internal_id,
            external_id=request.external_id,
            input_token_ids=all_ids[start : start + self._step_tokens(request)],
            all_token_ids=all_ids,
            num_computed_tokens=request.num_computed_tokens,
            is_prefill=is_prefill,
            sampling=request.sampling,
            additional_information=request.additional_information,
            inputs=request.inputs,
            is_upstream_exhausted=request.is_upstream_exhausted,
        )

    def _apply_result(self, request: Request, item: BatchItem, result: ItemResult) -> RequestUpdate:
        is_last_piece = item.num_computed_tokens + len(item.input_token_ids) >= len(item.all_token_ids)
        if result.is_partial_prefill or not is_last_piece:
            return self._apply_piece(request, item, result, is_last_piece)
        is_recompute = request.is_recompute
        request.is_recompute = False
        request.num_computed_tokens = request.num_tokens  # every input of the step is computed
        sampling = request.sampling
        kept: list[int] = []
        status: RequestStatus | None = None
        for token in result.token_ids:
            kept.append(int(token))
            if token in sampling.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                break
            if len(request.output_token_ids) + len(kept) >= sampling.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
                break
        if status is None and result.finished:
            status = RequestStatus.FINISHED_STOPPED
        now = self._clock()
        if kept:
            request.output_token_ids.extend(kept)
            if request.first_token_time is None:
                request.first_token_time = now
        if status is not None:
            request.finish(status, now)
        return RequestUpdate(
            request,
            new_token_ids=tuple(kept),
            text=result.text,
            audio=result.audio,
            sample_rate=result.sample_rate,
            next_stage_output=result.next_stage_output,
            is_recompute=is_recompute,
        )

    def _apply_piece(
        self, request: Request, item: BatchItem, result: ItemResult, is_last_piece: bool
    ) -> RequestUpdate:
        """A prefill piece that is not the last: the prompt is computed up to its end, and
        the request continues next tick. An executor that answers otherwise (it sampled,
        emitted, or calls the last piece partial) fails the request: it cannot take pieces."""
        problem = None
        if is_last_piece:
            problem = "called the last piece of a prompt partial"
        elif not result.is_partial_prefill:
            problem = "did not answer a prefill piece with is_partial_prefill"
        elif (
            result.token_ids
            or result.text
            or result.audio is not None
            or result.next_stage_output is not None
        ):
            problem = "sampled or emitted on a prefill piece that is not the last"
        if problem is not None:
            request.finish(
                RequestStatus.FINISHED_ERROR,
                self._clock(),
                f"the executor {problem} (stage {self.stage_id}: max_prefill_piece_tokens needs an "
                "executor that takes a prompt in pieces)",
            )
            return RequestUpdate(request)
        request.num_computed_tokens = item.num_computed_tokens + len(item.input_token_ids)
        return RequestUpdate(request)

    def preempt(self, internal_id: str) -> Request:
        """Take a RUNNING request's slot (between ticks). The engine must then call
        ``executor.release``; the request recomputes everything when readmitted (it goes
        to the front of the waiting queue). Its recompute step sends nothing downstream."""
        request = self._running.pop(internal_id)
        request.preempt()
        self._waiting.appendleft(request)
        return request

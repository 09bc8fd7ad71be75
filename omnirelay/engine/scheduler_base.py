"""What both schedulers share: the per-tick plain data and the queue/slot bookkeeping.

A scheduler is a pure state machine (docs/design.md §7). The engine drives it once per tick::

    sched_out = scheduler.schedule(events)          # events: adapter.poll_events()
    engine: adapter.load_async(...) for sched_out.chunk_loads
    results = [executor.step(list(b)) for b in sched_out.batches]   # or the exception
    update = scheduler.update_from_output(sched_out, results)
    engine: adapter.load_async(...) for update.chunk_loads; save_async / outputs per update

No I/O, no sleeps, no threads: commands (``add_request``, ``abort``, ``fail``,
``preempt``) are called by the engine between ticks only, so an abort always lands at a
step boundary.

Queues (each live request is in exactly one; checked by :meth:`BaseScheduler.check_invariants`):

* ``_new`` — added since the last tick; sorted into the others by the next ``schedule``.
* ``_waiting`` — ready to run, waiting for a batch slot (WAITING or PREEMPTED).
* ``_running`` — holds a slot and is runnable this tick (RUNNING).
* ``_parked`` — WAITING_FOR_CHUNK, registered with the adapter for its next chunk. It is
  never visited by a tick: only its chunk event (or a failure, a timeout, an abort) moves
  it, so 500 parked requests cost nothing per tick (docs/protocol.md §10.5).

Slots: ``len(_running)`` plus the parked requests that parked from RUNNING (they keep
their executor state while they wait) never exceed ``max_num_seqs``.

Chunk prefetch (``prefetch_chunks``, what the stage engine uses): a chunk-receiving
request needs its next chunk after every step until its upstream is exhausted, so the
tick that schedules it also asks for that chunk (``SchedulerOutput.chunk_loads``) —
the adapter's receive thread fetches and commits it while the executor computes the
step, instead of after it. Nothing else changes: the request still parks after its step
(without asking again: :attr:`Request.is_chunk_requested`), and the chunk is applied by
the next tick's events like any other; events are drained only at the start of a tick,
when no request is running. Without the flag a request asks when it parks.
"""

from __future__ import annotations

import abc
import dataclasses
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.engine.need import NeedPolicy
from omnirelay.engine.request import Request, RequestStatus
from omnirelay.transfer.events import ChunkInput, TransferEvents, TransferFailure

__all__ = ["BaseScheduler", "ChunkLoad", "RequestUpdate", "SchedulerOutput", "StepUpdate"]

#: ``(internal_id, external_id)``: register the request for its next chunk.
ChunkLoad = tuple[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One tick's decisions. ``batches``: one executor call each, items in call order."""

    batches: tuple[tuple[BatchItem, ...], ...] = ()
    #: Requests that finished while scheduling (transfer failure, stall timeout, an input
    #: that turned out empty). They are no longer tracked.
    finished: tuple[Request, ...] = ()
    #: Requests that parked this tick: register each with the adapter now.
    chunk_loads: tuple[ChunkLoad, ...] = ()

    @property
    def num_items(self) -> int:
        return sum(len(b) for b in self.batches)

    @property
    def is_empty(self) -> bool:
        return not (self.batches or self.finished or self.chunk_loads)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestUpdate:
    """What one executor step did to one request (client output + next-stage output)."""

    request: Request
    new_token_ids: tuple[int, ...] = ()
    text: str | None = None
    audio: Any = None
    sample_rate: int | None = None
    #: For the next stage's processor (``save_async(output=...)``); None = nothing.
    next_stage_output: Any = None
    #: The step recomputed tokens already sent downstream (after a preemption).
    is_recompute: bool = False

    @property
    def is_finished(self) -> bool:
        return self.request.is_finished


@dataclasses.dataclass(frozen=True, slots=True)
class StepUpdate:
    updates: tuple[RequestUpdate, ...] = ()
    #: Requests that parked after their step: register each with the adapter now.
    chunk_loads: tuple[ChunkLoad, ...] = ()


class BaseScheduler(abc.ABC):
    """Queues, slots, chunk parking and failures; subclasses decide what a step is."""

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
        need: NeedPolicy | None = None,
    ) -> None:
        assert max_num_seqs >= 1, max_num_seqs
        self.stage_id = stage_id
        self.max_num_seqs = max_num_seqs
        self.receives_chunks = receives_chunks
        self.supports_batching = supports_batching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefetch_chunks = prefetch_chunks and receives_chunks
        self._clock = clock
        #: which running requests a tick steps (None: all, within the token budget)
        self.need = need
        self.requests: dict[str, Request] = {}
        self._new: list[Request] = []
        self._waiting: deque[Request] = deque()
        self._running: OrderedDict[str, Request] = OrderedDict()
        self._parked: dict[str, Request] = {}
        self._num_parked_running = 0
        #: Requests of the last ``schedule``'s batches, until ``update_from_output``.
        self._stepping: frozenset[str] = frozenset()
        self.num_ticks = 0
        self.num_items_scheduled = 0
        self.num_chunks_applied = 0
        self.num_stale_chunks = 0

    # ----------------------------------------------------------------- commands

    def add_request(self, request: Request) -> None:
        """Track a new request; sorted into a queue by the next :meth:`schedule`."""
        assert request.status is RequestStatus.WAITING, request
        assert request.internal_id not in self.requests, request.internal_id
        self.requests[request.internal_id] = request
        self._new.append(request)

    def abort(self, internal_id: str) -> Request | None:
        """Finish the request as aborted (between ticks). None if it is not tracked."""
        return self._finish_untracked(internal_id, RequestStatus.FINISHED_ABORTED, None)

    def fail(self, internal_id: str, reason: str) -> Request | None:
        """Finish the request with an error (between ticks). None if it is not tracked."""
        return self._finish_untracked(internal_id, RequestStatus.FINISHED_ERROR, reason)

    def _finish_untracked(self, internal_id: str, status: RequestStatus, error: str | None) -> Request | None:
        request = self.requests.get(internal_id)
        if request is None:
            return None
        self._detach(request)
        request.finish(status, self._clock(), error)
        return request

    # ----------------------------------------------------------------- queries

    @property
    def num_slots_held(self) -> int:
        return len(self._running) + self._num_parked_running

    @property
    def num_free_slots(self) -> int:
        return self.max_num_seqs - self.num_slots_held

    def has_work(self) -> bool:
        """Would :meth:`schedule` do anything without new events? Parked requests don't count."""
        return bool(self._new or self._running or (self._waiting and self.num_free_slots > 0))

    def stats(self) -> dict[str, int]:
        return {
            "num_requests": len(self.requests),
            "num_new": len(self._new),
            "num_waiting": len(self._waiting),
            "num_running": len(self._running),
            "num_parked": len(self._parked),
            "num_slots_held": self.num_slots_held,
            "max_num_seqs": self.max_num_seqs,
            "num_ticks": self.num_ticks,
            "num_items_scheduled": self.num_items_scheduled,
            "num_chunks_applied": self.num_chunks_applied,
            "num_stale_chunks": self.num_stale_chunks,
        }

    def leak_state(self) -> dict[str, Any]:
        maps: dict[str, Any] = {
            "requests": sorted(self.requests),
            "new": [r.internal_id for r in self._new],
            "waiting": [r.internal_id for r in self._waiting],
            "running": list(self._running),
            "parked": sorted(self._parked),
        }
        return {k: v for k, v in maps.items() if v}

    def check_invariants(self) -> None:
        """Every tracked request is in exactly one queue, in a status that matches it."""
        where: dict[str, str] = {}
        for name, reqs in (
            ("new", self._new),
            ("waiting", list(self._waiting)),
            ("running", list(self._running.values())),
            ("parked", list(self._parked.values())),
        ):
            for r in reqs:
                assert r.internal_id not in where, f"{r!r} in {where.get(r.internal_id)} and {name}"
                where[r.internal_id] = name
                assert self.requests.get(r.internal_id) is r, f"{r!r} in {name} but not tracked"
        assert set(where) == set(self.requests), (set(self.requests) - set(where), set(where))
        for r in self._running.values():
            assert r.status is RequestStatus.RUNNING, r
        for r in self._waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
        for r in self._parked.values():
            assert r.status is RequestStatus.WAITING_FOR_CHUNK, r
        for r in self.requests.values():
            # A chunk on order: parked, or prefetched for the step it is in (_build_batches).
            assert (
                not r.is_chunk_requested
                or r.internal_id in self._parked
                or (r.status is RequestStatus.RUNNING and r.internal_id in self._stepping)
            ), r
        parked_running = sum(1 for r in self._parked.values() if r.parked_from is RequestStatus.RUNNING)
        assert parked_running == self._num_parked_running, (parked_running, self._num_parked_running)
        assert self.num_slots_held <= self.max_num_seqs, (self.num_slots_held, self.max_num_seqs)

    # ----------------------------------------------------------------- the tick

    def schedule(self, events: TransferEvents | None = None) -> SchedulerOutput:
        """One tick: apply chunk events, sort new requests, admit, build the batches."""
        self.num_ticks += 1
        finished: list[Request] = []
        loads: list[ChunkLoad] = []
        if events is not None:
            for f in (*events.failed, *events.timed_out):
                self._apply_failure(f, finished)
            for chunk in events.ready:
                self._apply_chunk(chunk, finished, loads)
        new, self._new = self._new, []
        for request in new:
            self._sort_new(request, finished, loads)
        while self._waiting and self.num_free_slots > 0:
            request = self._waiting.popleft()
            request.start_running(self._clock())
            self._running[request.internal_id] = request
        return SchedulerOutput(self._build_batches(loads), tuple(finished), tuple(loads))

    def update_from_output(
        self, sched_out: SchedulerOutput, results: Sequence[Sequence[ItemResult] | BaseException]
    ) -> StepUpdate:
        """Apply each batch's results (or the exception its executor call raised)."""
        assert len(results) == len(sched_out.batches), (len(results), len(sched_out.batches))
        updates: list[RequestUpdate] = []
        loads: list[ChunkLoad] = []
        for batch, batch_results in zip(sched_out.batches, results):
            problem = _check_results(batch, batch_results)
            for i, item in enumerate(batch):
                request = self.requests.get(item.internal_id)
                # Invariant: commands land between ticks, so a scheduled request is still tracked.
                assert request is not None and request.status is RequestStatus.RUNNING, item.internal_id
                if problem is not None:
                    self._detach(request)
                    request.finish(RequestStatus.FINISHED_ERROR, self._clock(), problem)
                    updates.append(RequestUpdate(request))
                    continue
                assert not isinstance(batch_results, BaseException)
                result = batch_results[i]
                if result.is_partial_prefill:
                    request.num_prefill_pieces += 1
                else:
                    request.num_steps += 1
                update = self._apply_result(request, item, result)
                updates.append(update)
                if request.is_finished:
                    self._detach(request, was=RequestStatus.RUNNING)
                elif self._needs_chunk(request):
                    self._park(request, loads)
        self._stepping = frozenset()
        return StepUpdate(tuple(updates), tuple(loads))

    # ----------------------------------------------------------------- subclass hooks

    @abc.abstractmethod
    def _attach(self, request: Request, chunk: ChunkInput) -> str | None:
        """Commit a ready chunk into the request (it is still parked). Returns why the
        chunk breaks the stage's payload contract (the request then fails), or None."""

    @abc.abstractmethod
    def _make_item(self, request: Request) -> BatchItem:
        """The request's share of this tick's step."""

    @abc.abstractmethod
    def _apply_result(self, request: Request, item: BatchItem, result: ItemResult) -> RequestUpdate:
        """Apply one result; finish the request (``request.finish``) when it is done."""

    def _step_tokens(self, request: Request) -> int:
        """The input tokens the request's item of this tick computes (its budget cost)."""
        return max(1, request.num_uncomputed_tokens)

    def _is_done_without_step(self, request: Request) -> bool:
        """A request leaving new/parked with nothing left to compute and nothing more to
        come: it finishes (FINISHED_STOPPED) with no output instead of running."""
        return False

    # ----------------------------------------------------------------- helpers

    def _needs_chunk(self, request: Request) -> bool:
        return self.receives_chunks and not request.has_ready_chunk and not request.is_upstream_exhausted

    def _sort_new(self, request: Request, finished: list[Request], loads: list[ChunkLoad]) -> None:
        """Put a request that is in no queue where it belongs (or finish it)."""
        if self._needs_chunk(request):
            self._park(request, loads)
        elif self._is_done_without_step(request):
            request.finish(RequestStatus.FINISHED_STOPPED, self._clock())
            del self.requests[request.internal_id]
            finished.append(request)
        elif request.status is RequestStatus.RUNNING:
            self._running[request.internal_id] = request
        else:
            self._waiting.append(request)

    def _park(self, request: Request, loads: list[ChunkLoad]) -> None:
        """Park a request that is in no queue, or in ``_running``."""
        if request.status is RequestStatus.RUNNING:
            self._running.pop(request.internal_id, None)
            self._num_parked_running += 1
        request.park_for_chunk()
        self._parked[request.internal_id] = request
        if not request.is_chunk_requested:  # else prefetched when its step was scheduled
            request.is_chunk_requested = True
            loads.append((request.internal_id, request.external_id))

    def _apply_chunk(self, chunk: ChunkInput, finished: list[Request], loads: list[ChunkLoad]) -> None:
        request = self._parked.get(chunk.internal_id)
        if request is None:
            # Released or failed after the commit: the engine cleaned the adapter for it.
            self.num_stale_chunks += 1
            return
        self.num_chunks_applied += 1
        request.is_chunk_requested = False
        del self._parked[request.internal_id]
        if request.parked_from is RequestStatus.RUNNING:
            self._num_parked_running -= 1
        problem = self._attach(request, chunk)
        request.unpark()
        if problem is not None:
            # The chunk was consumed: nothing can retry it, so the request ends here.
            request.finish(RequestStatus.FINISHED_ERROR, self._clock(), problem)
            del self.requests[request.internal_id]
            finished.append(request)
            return
        self._sort_new(request, finished, loads)

    def _apply_failure(self, failure: TransferFailure, finished: list[Request]) -> None:
        request = self.requests.get(failure.internal_id)
        if request is None:
            return  # the engine handles failures of requests it no longer schedules
        self._detach(request)
        request.finish(RequestStatus.FINISHED_ERROR, self._clock(), describe_failure(failure))
        finished.append(request)

    def _detach(self, request: Request, was: RequestStatus | None = None) -> None:
        """Remove a request from whichever queue holds it, and stop tracking it."""
        iid = request.internal_id
        status = was if was is not None else request.status
        if status is RequestStatus.RUNNING:
            self._running.pop(iid, None)
        elif status is RequestStatus.WAITING_FOR_CHUNK:
            del self._parked[iid]
            if request.parked_from is RequestStatus.RUNNING:
                self._num_parked_running -= 1
        elif request in self._new:
            self._new.remove(request)
        else:
            self._waiting.remove(request)
        del self.requests[iid]

    def _build_batches(self, loads: list[ChunkLoad]) -> tuple[tuple[BatchItem, ...], ...]:
        if not self._running:
            self._stepping = frozenset()
            return ()
        chosen: list[Request] = []
        budget = self.max_num_batched_tokens
        candidates: Sequence[Request] = tuple(self._running.values())
        if self.need is not None and not self._waiting:
            # By need: the urgent requests alone, else a capped step. Not while requests
            # wait for a slot: a short step then only holds the slots longer.
            candidates, is_urgent = self.need.select(candidates, self._clock())
            cap = self.need.max_step_tokens
            if not is_urgent and cap is not None:
                budget = cap if budget is None else min(budget, cap)
        used = 0
        for request in candidates:
            cost = self._step_tokens(request)
            if budget is not None and chosen and used + cost > budget:
                continue  # next tick; always at least one item per tick
            chosen.append(request)
            used += cost
        if len(chosen) < len(self._running):
            for r in chosen:  # round robin when the token budget leaves some out
                self._running.move_to_end(r.internal_id)
        items = [self._make_item(r) for r in chosen]
        self._stepping = frozenset(r.internal_id for r in chosen)
        now = self._clock()
        for r in chosen:
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            r.additional_information = None  # consume-once (docs/protocol.md §4.9 postprocess)
            r.has_ready_chunk = False
            if self.prefetch_chunks and not r.is_upstream_exhausted:
                # It parks for its next chunk after this step (_needs_chunk): ask now.
                r.is_chunk_requested = True
                loads.append((r.internal_id, r.external_id))
        self.num_items_scheduled += len(items)
        if self.supports_batching:
            return (tuple(items),)
        return tuple((item,) for item in items)


def describe_failure(failure: TransferFailure) -> str:
    """The reason a request failed in the transfer layer, for its error output."""
    return f"{failure.kind.value} at stage {failure.stage_id}: {failure.reason}"


def _check_results(batch: tuple[BatchItem, ...], results: Sequence[ItemResult] | BaseException) -> str | None:
    """None when ``results`` match ``batch`` one to one, else why the batch failed."""
    if isinstance(results, BaseException):
        return f"executor step raised {type(results).__name__}: {results}"
    if len(results) != len(batch):
        return f"executor returned {len(results)} result(s) for {len(batch)} item(s)"
    for item, result in zip(batch, results):
        if not isinstance(result, ItemResult) or result.internal_id != item.internal_id:
            got = result.internal_id if isinstance(result, ItemResult) else type(result).__name__
            return (
                f"executor result {got!r} does not match item {item.internal_id!r} (results must be in order)"
            )
    return None


def iter_ids(requests: Iterable[Request]) -> list[str]:
    return [r.internal_id for r in requests]

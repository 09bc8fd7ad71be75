"""The schedulers as pure state machines: plain data in, plain data out, no threads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnirelay.engine import (
    ARScheduler,
    BaseScheduler,
    GenerationScheduler,
    ItemResult,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
    StepUpdate,
)
from omnirelay.errors import ConfigError
from omnirelay.models.testing.toy import CountingLM, RelayLM, SampleGenerator, expected_waveform
from omnirelay.payload import Codes, Meta, OmniPayload
from omnirelay.processors import read_codec_chunk
from omnirelay.transfer import ChunkInput, FailureKind, TransferEvents, TransferFailure

S = RequestStatus


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ar(**kw: Any) -> ARScheduler:
    args: dict[str, Any] = {
        "stage_id": 0,
        "max_num_seqs": 64,
        "receives_chunks": False,
        "supports_batching": True,
        "clock": Clock(),
    }
    args.update(kw)
    return ARScheduler(**args)


def _gen(**kw: Any) -> GenerationScheduler:
    args: dict[str, Any] = {
        "stage_id": 2,
        "max_num_seqs": 64,
        "receives_chunks": True,
        "supports_batching": True,
        "clock": Clock(),
        "chunk_reader": read_codec_chunk,
    }
    args.update(kw)
    return GenerationScheduler(**args)


def _req(i: int | str, prompt: list[int] | None = None, *, stage: int = 0, **kw: Any) -> Request:
    sampling = kw.pop("sampling", SamplingParams(max_tokens=kw.pop("max_tokens", 4)))
    return Request(
        internal_id=f"r{i}@s{stage}.1",
        external_id=f"r{i}",
        stage_id=stage,
        prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
        sampling=sampling,
        arrival_time=100.0,
        **kw,
    )


def tick(
    sched: BaseScheduler, executor: Any, events: TransferEvents | None = None
) -> tuple[SchedulerOutput, StepUpdate]:
    out = sched.schedule(events)
    sched.check_invariants()
    results: list[Any] = []
    for batch in out.batches:
        try:
            results.append(executor.step(list(batch)))
        except Exception as exc:
            results.append(exc)
    update = sched.update_from_output(out, results)
    sched.check_invariants()
    return out, update


def codes(ids: list[int] | torch.Tensor, **fields: Any) -> OmniPayload:
    audio = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64)
    return OmniPayload(codes=Codes(audio=audio), **fields)


def ar_chunk(iid: str, rows: list[int], *, finished: bool = False, n: int = 0) -> ChunkInput:
    return ChunkInput(iid, iid.split("@")[0], n, finished, False, payload=codes(rows))


def gen_chunk(
    iid: str, payload: Any, *, finished: bool = False, segment: bool = False, n: int = 0
) -> ChunkInput:
    """A committed chunk as the adapter hands it over; a list of ints is 1-D codes."""
    body = codes(payload) if isinstance(payload, list) else payload
    return ChunkInput(iid, iid.split("@")[0], n, finished, segment, payload=body)


def assert_empty(sched: BaseScheduler) -> None:
    sched.check_invariants()
    assert sched.leak_state() == {} and sched.num_slots_held == 0 and not sched.has_work()


# --------------------------------------------------------------------- AR


def test_concurrent_requests_share_one_executor_call_per_tick() -> None:
    sched, lm = _ar(), CountingLM()
    for i in range(16):
        sched.add_request(_req(i, [i * 10], max_tokens=5))
    ticks = 0
    while sched.requests:
        out, _ = tick(sched, lm)
        ticks += 1
        assert len(out.batches) == 1
    assert ticks == 5 and lm.num_calls == 5 and lm.batch_sizes == {16: 5}
    assert_empty(sched)


def test_a_non_batching_executor_gets_one_item_per_call() -> None:
    sched, lm = _ar(supports_batching=False), CountingLM(supports_batching=False)
    for i in range(3):
        sched.add_request(_req(i, max_tokens=2))
    out, _ = tick(sched, lm)
    assert [len(b) for b in out.batches] == [1, 1, 1]
    tick(sched, lm)
    assert lm.batch_sizes == {1: 6}
    assert_empty(sched)


def test_max_num_seqs_bounds_the_running_set_and_the_rest_wait_fifo() -> None:
    sched, lm = _ar(max_num_seqs=4), CountingLM()
    reqs = [_req(i, max_tokens=2) for i in range(10)]
    for r in reqs:
        sched.add_request(r)
    order: list[list[str]] = []
    while sched.requests:
        out, _ = tick(sched, lm)
        order.append(sorted(item.internal_id for b in out.batches for item in b))
        assert sched.num_slots_held <= 4
    assert lm.max_batch_size == 4
    assert order[0] == order[1] == sorted(r.internal_id for r in reqs[:4])
    assert order[2] == sorted(r.internal_id for r in reqs[4:8])
    assert_empty(sched)


def test_prefill_then_decode_items_and_token_accounting() -> None:
    sched, lm = _ar(), CountingLM()
    r = _req(0, [5, 6, 7], max_tokens=3)
    sched.add_request(r)
    out, update = tick(sched, lm)
    (item,) = out.batches[0]
    assert item.is_prefill and item.input_token_ids == [5, 6, 7] and item.num_computed_tokens == 0
    assert update.updates[0].new_token_ids == (8,) and r.num_computed_tokens == 3
    out, _ = tick(sched, lm)
    (item,) = out.batches[0]
    assert not item.is_prefill and item.input_token_ids == [8] and item.all_token_ids == [5, 6, 7, 8]
    tick(sched, lm)
    assert r.output_token_ids == [8, 9, 10] and r.status is S.FINISHED_LENGTH
    assert_empty(sched)


@pytest.mark.parametrize(
    ("sampling", "executor_kw", "tokens", "status"),
    [
        (SamplingParams(max_tokens=10, stop_token_ids=(7,)), {}, [5, 6, 7], S.FINISHED_STOPPED),
        (SamplingParams(max_tokens=2), {}, [5, 6], S.FINISHED_LENGTH),
        (SamplingParams(max_tokens=10), {"eos_token_id": 6}, [5, 6], S.FINISHED_STOPPED),
    ],
)
def test_stop_conditions(
    sampling: SamplingParams, executor_kw: dict[str, Any], tokens: list[int], status: RequestStatus
) -> None:
    sched, lm = _ar(), CountingLM(**executor_kw)
    r = _req(0, [4], sampling=sampling)
    sched.add_request(r)
    while sched.requests:
        tick(sched, lm)
    assert r.output_token_ids == tokens and r.status is status
    assert_empty(sched)


def test_tokens_past_a_stop_are_dropped() -> None:
    class Burst:
        supports_batching = True

        def step(self, batch: list[Any]) -> list[ItemResult]:
            return [ItemResult(internal_id=b.internal_id, token_ids=[1, 2, 3, 4]) for b in batch]

    sched = _ar()
    a, b = _req("a", sampling=SamplingParams(max_tokens=9, stop_token_ids=(2,))), _req("b", max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    _, update = tick(sched, Burst())
    assert [u.new_token_ids for u in update.updates] == [(1, 2), (1, 2, 3)]
    assert a.status is S.FINISHED_STOPPED and b.status is S.FINISHED_LENGTH
    assert_empty(sched)


def test_an_executor_error_fails_only_its_batch_with_the_reason() -> None:
    class Boom:
        supports_batching = False

        def step(self, batch: list[Any]) -> list[ItemResult]:
            if batch[0].external_id == "rbad":
                raise RuntimeError("CUDA fell over")
            return [ItemResult(internal_id=batch[0].internal_id, token_ids=[9])]

    sched = _ar(supports_batching=False)
    good, bad = _req("good", max_tokens=1), _req("bad")
    sched.add_request(good)
    sched.add_request(bad)
    _, update = tick(sched, Boom())
    assert good.status is S.FINISHED_LENGTH and good.output_token_ids == [9]
    assert bad.status is S.FINISHED_ERROR and bad.error is not None and "CUDA fell over" in bad.error
    assert len(update.updates) == 2
    assert_empty(sched)


def test_results_that_do_not_match_the_batch_fail_it() -> None:
    class Wrong:
        supports_batching = True

        def step(self, batch: list[Any]) -> list[ItemResult]:
            return [ItemResult(internal_id="someone-else")]

    sched = _ar()
    r = _req(0)
    sched.add_request(r)
    tick(sched, Wrong())
    assert r.status is S.FINISHED_ERROR and r.error is not None and "does not match item" in r.error
    assert_empty(sched)


def test_abort_between_ticks_from_every_queue() -> None:
    sched, lm = _ar(max_num_seqs=1, receives_chunks=False), CountingLM()
    running, waiting, new = _req("run", max_tokens=9), _req("wait", max_tokens=9), _req("new")
    sched.add_request(running)
    sched.add_request(waiting)
    tick(sched, lm)
    sched.add_request(new)
    for r in (running, waiting, new):
        assert sched.abort(r.internal_id) is r and r.status is S.FINISHED_ABORTED
    assert sched.abort("unknown") is None
    assert_empty(sched)


def test_preempted_request_recomputes_everything_and_marks_the_step() -> None:
    sched, lm = _ar(max_num_seqs=1), CountingLM()
    r = _req(0, [1], max_tokens=5)
    sched.add_request(r)
    tick(sched, lm)
    tick(sched, lm)
    assert r.output_token_ids == [2, 3]
    assert sched.preempt(r.internal_id) is r and r.status is S.PREEMPTED
    sched.check_invariants()
    out, update = tick(sched, lm)
    (item,) = out.batches[0]
    assert item.is_prefill and item.input_token_ids == [1, 2, 3] and update.updates[0].is_recompute
    _, update = tick(sched, lm)
    assert not update.updates[0].is_recompute
    while sched.requests:
        tick(sched, lm)
    assert r.output_token_ids == [2, 3, 4, 5, 6]
    assert_empty(sched)


def test_token_budget_limits_one_tick_and_rotates() -> None:
    sched, lm = _ar(max_num_batched_tokens=4), CountingLM()
    for i in range(3):
        sched.add_request(_req(i, [1, 2, 3], max_tokens=2))  # 3 prefill tokens each
    seen = []
    while sched.requests:
        out, _ = tick(sched, lm)
        seen.append([it.external_id for b in out.batches for it in b])
    assert seen[0] == ["r0"]  # 3 + 3 > 4: one prefill per tick, always at least one
    assert sorted(x for s in seen for x in s) == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert_empty(sched)


# --------------------------------------------------------------------- AR receiver (docs/protocol.md §4.9)


def test_ar_receiver_runs_one_step_per_chunk_then_finishes_on_the_terminal() -> None:
    sched, relay = _ar(stage_id=1, receives_chunks=True), RelayLM()
    r = _req(0, [0, 0, 0], stage=1, max_tokens=50, is_placeholder=True)
    sched.add_request(r)
    out, _ = tick(sched, relay)
    assert out.chunk_loads == ((r.internal_id, "r0"),) and not out.batches and r.status is S.WAITING_FOR_CHUNK
    out, _ = tick(sched, relay)  # nothing arrived: nothing to do, no re-registration
    assert out.is_empty and relay.num_calls == 0 and not sched.has_work()
    out, update = tick(sched, relay, TransferEvents(ready=(ar_chunk(r.internal_id, [10, 11]),)))
    (item,) = out.batches[0]
    assert item.is_prefill and item.input_token_ids == [0, 0, 0] and not item.is_upstream_exhausted
    assert type(item.additional_information) is OmniPayload  # the chunk's payload, as it came
    assert update.updates[0].new_token_ids == (21, 23) and update.chunk_loads == ((r.internal_id, "r0"),)
    assert r.status is S.WAITING_FOR_CHUNK and r.parked_from is S.RUNNING and sched.num_slots_held == 1
    assert r.additional_information is None  # consumed once
    terminal = ar_chunk(r.internal_id, [12], finished=True, n=1)
    out, update = tick(sched, relay, TransferEvents(ready=(terminal,)))
    assert out.batches[0][0].is_upstream_exhausted  # the executor learns the stream ended
    assert update.updates[0].new_token_ids == (25,) and r.status is S.FINISHED_STOPPED
    assert r.output_token_ids == [21, 23, 25] and r.num_chunks_received == 2
    assert_empty(sched)


def test_prefetch_asks_for_the_next_chunk_when_the_step_is_scheduled() -> None:
    """With ``prefetch_chunks`` the tick that steps a receiver already asks for its next
    chunk (fetched during the step); after the step it parks without asking again, and
    the chunk is applied by the next tick like any other."""
    sched, relay = _ar(stage_id=1, receives_chunks=True, prefetch_chunks=True), RelayLM()
    r = _req(0, [0, 0, 0], stage=1, max_tokens=50, is_placeholder=True)
    sched.add_request(r)
    out, _ = tick(sched, relay)  # no chunk yet: parks and asks for chunk 0, as without prefetch
    assert out.chunk_loads == ((r.internal_id, "r0"),) and r.is_chunk_requested
    out, update = tick(sched, relay, TransferEvents(ready=(ar_chunk(r.internal_id, [10]),)))
    assert out.num_items == 1 and out.chunk_loads == ((r.internal_id, "r0"),)  # chunk 1, during the step
    assert update.chunk_loads == () and r.status is S.WAITING_FOR_CHUNK and r.is_chunk_requested
    out, update = tick(sched, relay)  # chunk 1 not committed yet: nothing runs, nothing is asked again
    assert out.is_empty and update.chunk_loads == ()
    out, update = tick(
        sched, relay, TransferEvents(ready=(ar_chunk(r.internal_id, [11], finished=True, n=1),))
    )
    assert out.num_items == 1 and out.chunk_loads == ()  # the terminal: no chunk follows it
    assert update.updates[0].new_token_ids == (23,) and r.status is S.FINISHED_STOPPED
    assert r.output_token_ids == [21, 23] and r.num_chunks_received == 2
    assert_empty(sched)


def test_prefetch_of_a_request_that_ends_in_its_step_or_fails_parked() -> None:
    """A prefetched request that finishes in its step is simply gone (the engine cleans
    its registration); one that parked with a chunk on order fails (or is aborted) like
    any parked request; a stage that receives no chunks never prefetches."""
    sched, relay = _ar(stage_id=1, receives_chunks=True, prefetch_chunks=True), RelayLM()
    a, b = _req("a", [0], stage=1, max_tokens=1), _req("b", [0], stage=1, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    tick(sched, relay)
    ready = (ar_chunk(a.internal_id, [1]), ar_chunk(b.internal_id, [2]))
    out, update = tick(sched, relay, TransferEvents(ready=ready))
    assert set(out.chunk_loads) == {(a.internal_id, "ra"), (b.internal_id, "rb")}
    assert a.status is S.FINISHED_LENGTH and update.chunk_loads == ()
    assert b.status is S.WAITING_FOR_CHUNK and b.is_chunk_requested
    fail = TransferFailure(b.internal_id, "rb", FailureKind.RECEIVE_FAILED, "corrupt", 1)
    out = sched.schedule(TransferEvents(failed=(fail,)))
    assert out.finished == (b,) and b.status is S.FINISHED_ERROR
    assert_empty(sched)
    plain = _ar(stage_id=0, receives_chunks=False, prefetch_chunks=True)
    assert not plain.prefetch_chunks
    plain.add_request(_req("c", max_tokens=2))
    out, _ = tick(plain, CountingLM())
    assert out.chunk_loads == () and out.num_items == 1


def test_ar_receiver_decodes_on_its_own_once_upstream_is_exhausted() -> None:
    sched, lm = _ar(stage_id=1, receives_chunks=True), CountingLM()
    r = _req(0, [0], stage=1, max_tokens=4)
    sched.add_request(r)
    tick(sched, lm)
    _, update = tick(sched, lm, TransferEvents(ready=(ar_chunk(r.internal_id, [], finished=True),)))
    assert update.chunk_loads == () and r.status is S.RUNNING
    while sched.requests:
        out, update = tick(sched, lm)
        assert out.chunk_loads == update.chunk_loads == ()
    assert r.output_token_ids == [1, 2, 3, 4]
    assert_empty(sched)


def test_five_hundred_parked_requests_cost_nothing_per_tick() -> None:
    sched, relay = _ar(stage_id=1, receives_chunks=True, max_num_seqs=64), RelayLM()
    reqs = [_req(i, [0], stage=1, max_tokens=9) for i in range(500)]
    for r in reqs:
        sched.add_request(r)
    out, _ = tick(sched, relay)
    assert len(out.chunk_loads) == 500 and not out.batches
    visited_before = sched.num_items_scheduled
    for _ in range(1000):
        out = sched.schedule(TransferEvents())
        assert out.is_empty
    assert sched.num_items_scheduled == visited_before and relay.num_calls == 0 and not sched.has_work()
    # One arrival wakes exactly its request.
    out, update = tick(sched, relay, TransferEvents(ready=(ar_chunk(reqs[7].internal_id, [1]),)))
    assert out.num_items == 1 and out.batches[0][0].internal_id == reqs[7].internal_id
    assert update.chunk_loads == ((reqs[7].internal_id, "r7"),)
    for r in reqs:
        sched.abort(r.internal_id)
    assert_empty(sched)


def test_failures_and_timeouts_fail_parked_requests_with_the_reason() -> None:
    sched = _ar(stage_id=1, receives_chunks=True)
    a, b = _req("a", stage=1), _req("b", stage=1)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    fail = TransferFailure(a.internal_id, "ra", FailureKind.RECEIVE_FAILED, "chunk 'ra_0_0' is corrupt", 1)
    late = TransferFailure(b.internal_id, "rb", FailureKind.TIMEOUT, "no chunk within 600 s", 1)
    gone = TransferFailure("gone@s1.9", "gone", FailureKind.SEND_FAILED, "whatever", 1)
    out = sched.schedule(TransferEvents(failed=(fail, gone), timed_out=(late,)))
    assert out.finished == (a, b)
    assert a.status is S.FINISHED_ERROR and a.error == "receive_failed at stage 1: chunk 'ra_0_0' is corrupt"
    assert b.error is not None and "timeout" in b.error and "600 s" in b.error
    assert_empty(sched)


def test_a_chunk_for_a_request_no_longer_tracked_is_ignored() -> None:
    sched, relay = _ar(stage_id=1, receives_chunks=True), RelayLM()
    out = sched.schedule(TransferEvents(ready=(ar_chunk("ghost@s1.1", [1]),)))
    assert out.is_empty and sched.num_stale_chunks == 1 and relay.num_calls == 0
    assert_empty(sched)


# --------------------------------------------------------------------- generation


def test_generation_prefills_each_chunk_once_and_finishes_when_exhausted() -> None:
    sched, synth = _gen(), SampleGenerator(samples_per_code=2)
    r = _req(0, [0, 0, 0, 0], stage=2, is_placeholder=True)
    sched.add_request(r)
    out, _ = tick(sched, synth)
    assert out.chunk_loads and not out.batches and synth.num_calls == 0  # never runs on placeholders
    out, update = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, [3, 4]),)))
    (item,) = out.batches[0]
    assert item.is_prefill and item.input_token_ids == [3, 4] and item.num_computed_tokens == 0
    assert torch.equal(update.updates[0].audio, expected_waveform([3, 4], 2))
    assert r.status is S.WAITING_FOR_CHUNK and r.num_computed_tokens == 2
    _, update = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, [5], finished=True, n=1),)))
    assert torch.equal(update.updates[0].audio, expected_waveform([5], 2)) and update.updates[0].is_finished
    assert r.status is S.FINISHED_STOPPED and synth.num_calls == 2
    assert_empty(sched)


def test_generation_terminal_only_chunk_finishes_with_no_output() -> None:
    sched, synth = _gen(), SampleGenerator()
    r = _req(0, [0], stage=2)
    sched.add_request(r)
    tick(sched, synth)
    tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, [1, 2]),)))
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, [], finished=True, n=1),)))
    assert (
        out.finished == (r,) and not out.batches and r.status is S.FINISHED_STOPPED and synth.num_calls == 1
    )
    assert_empty(sched)


def test_generation_complete_input_runs_once() -> None:
    sched, synth = _gen(receives_chunks=False, supports_batching=True), SampleGenerator()
    full, empty, with_inputs = (
        _req("full", [1, 2, 3], stage=2),
        _req("e", [], stage=2),
        _req("i", [], stage=2),
    )
    with_inputs.inputs = {"waveform": [0.0]}
    for r in (full, empty, with_inputs):
        sched.add_request(r)
    out, update = tick(sched, synth)
    assert out.finished == (empty,) and empty.status is S.FINISHED_STOPPED  # nothing to compute
    assert [it.external_id for it in out.batches[0]] == ["rfull", "ri"]
    assert full.status is S.FINISHED_STOPPED and with_inputs.status is S.FINISHED_STOPPED
    assert [len(u.audio) for u in update.updates] == [12, 0]
    assert_empty(sched)


def test_generation_batches_many_streams_and_respects_max_num_seqs() -> None:
    sched, synth = _gen(max_num_seqs=3), SampleGenerator()
    reqs = [_req(i, [0], stage=2) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    tick(sched, synth)
    ready = tuple(gen_chunk(r.internal_id, [i], finished=True) for i, r in enumerate(reqs))
    out, _ = tick(sched, synth, TransferEvents(ready=ready))
    assert out.num_items == 3 and len(out.batches) == 1
    out, _ = tick(sched, synth)
    assert out.num_items == 2
    assert all(r.status is S.FINISHED_STOPPED for r in reqs)
    assert_empty(sched)


def test_generation_stage_reads_each_chunk_with_its_chunk_reader() -> None:
    """docs/protocol.md §4.8 on the consuming side: the codec reader makes the prompt and
    the runtime info; a chunk with nothing to compute is consumed, not run, and what it
    carried is kept; a segment end runs on the placeholder; the terminal finishes."""
    sched, synth = _gen(), SampleGenerator(samples_per_code=1)
    r = _req(0, [0], stage=2, is_placeholder=True)
    sched.add_request(r)
    tick(sched, synth)
    c0 = codes([1, 2, 3], meta=Meta(left_context_size=0))
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, c0),)))
    (item,) = out.batches[0]
    assert item.input_token_ids == [1, 2, 3] and item.num_computed_tokens == 0
    info = item.additional_information
    assert type(info) is OmniPayload and info.meta == Meta(left_context_size=0)
    assert info.codes is not None and info.codes.audio is None  # 1-D codes became the prompt
    # Nothing to compute and not the end: consumed, the request asks for the next chunk.
    c1 = OmniPayload(speaker="ethan", codes=Codes(ref=torch.tensor([7])))
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, c1, n=1),)))
    assert not out.batches and out.chunk_loads == ((r.internal_id, r.external_id),)
    assert r.status is S.WAITING_FOR_CHUNK and synth.num_calls == 1
    # ≥2-D codes stay in the runtime info (the executor decodes them) on the placeholder [0].
    c2 = codes(torch.zeros(16, 4, dtype=torch.long))
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, c2, n=2),)))
    (item,) = out.batches[0]
    assert item.input_token_ids == [0]
    info = item.additional_information
    assert info.codes.audio.shape == (16, 4) and info.codes.ref.tolist() == [7]
    assert info.speaker == "ethan" and info.meta == Meta(left_context_size=0)
    # An empty segment end still runs, on the placeholder.
    out, _ = tick(
        sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, OmniPayload(), segment=True, n=3),))
    )
    assert out.batches[0][0].input_token_ids == [0]
    # The end of the stream with no body: nothing to compute, the request finishes.
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, None, finished=True, n=4),)))
    assert out.finished == (r,) and r.status is S.FINISHED_STOPPED and synth.num_calls == 3
    assert_empty(sched)


def test_generation_replace_flag_starts_the_runtime_info_afresh() -> None:
    sched, synth = _gen(), SampleGenerator()
    r = _req(0, [0], stage=2)
    sched.add_request(r)
    tick(sched, synth)
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, codes([5, 6], speaker="a")),)))
    assert out.batches[0][0].additional_information.speaker == "a"
    fresh = codes([7], meta=Meta(replace_runtime_additional_information=True))
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, fresh, finished=True, n=1),)))
    (item,) = out.batches[0]
    assert item.input_token_ids == [7] and item.additional_information.speaker is None
    assert r.status is S.FINISHED_STOPPED
    assert_empty(sched)


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"codes": {"audio": [1, 2]}}, "a codec chunk must be an OmniPayload, got dict"),
        (OmniPayload(codes=Codes(audio="abc")), "codes.audio must be a tensor or a list, got str"),
    ],
)
def test_a_chunk_the_reader_rejects_fails_the_request_with_the_reason(payload: Any, problem: str) -> None:
    sched, synth = _gen(), SampleGenerator()
    r = _req(0, [0], stage=2)
    sched.add_request(r)
    tick(sched, synth)
    out, _ = tick(sched, synth, TransferEvents(ready=(gen_chunk(r.internal_id, payload),)))
    assert out.finished == (r,) and not out.batches and r.status is S.FINISHED_ERROR
    assert r.error is not None and "violates the payload contract" in r.error and problem in r.error
    assert synth.num_calls == 0
    assert_empty(sched)


def test_a_chunk_receiving_generation_stage_needs_a_chunk_reader() -> None:
    with pytest.raises(ConfigError, match="chunk reader"):
        _gen(chunk_reader=None)
    _gen(receives_chunks=False, chunk_reader=None)  # a complete-input stage reads no chunks

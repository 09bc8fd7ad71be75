"""Per-step timing: the engine's optional tracer, and the step recorder behind ``run``'s timeline.

An engine without a tracer writes no step keys; with :class:`StepRecorder` every output
a step made carries that executor call's times, the request's share of it, its arrival,
and the commit of the chunk it had waited for, if it had. A fake clock moves only inside
the executor call and between the puts, so every time is exact. Each test ends with the
engine's leak audit, which includes the tracer's per-request state.
"""

from __future__ import annotations

import threading

import torch

from omnirelay.engine import BatchItem, ItemResult, SamplingParams, StageOutput
from omnirelay.engine.request import Request
from omnirelay.engine.tracing import StepTracer
from omnirelay.models.testing.toy import RelayLM
from omnirelay.payload import Codes, OmniPayload
from omnirelay.timeline import STEP_METRICS, Step, StepRecorder, step_of
from omnirelay.transfer import ChunkEnvelope
from tests.engine_harness import TIMEOUT_S
from tests.test_engine_stage import audit, make_engine, placeholder, run_until_idle, text_request
from tests.transfer_fakes import FakeClock, FakeConnector, FakeStore

CALL_S = 3.0  # what one executor call takes on the fake clock


class TimedRelay(RelayLM):
    """The toy relay, each call taking :data:`CALL_S` on the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:
        self.clock.advance(CALL_S)
        return super().step(batch)


def chunk(rows: list[int], *, finished: bool = False) -> ChunkEnvelope:
    """A codec chunk as the upstream's adapter puts it."""
    audio = torch.tensor(rows, dtype=torch.int64)
    return ChunkEnvelope(body=OmniPayload(codes=Codes(audio=audio)), is_finished=finished)


def test_the_recorder_is_a_step_tracer() -> None:
    assert isinstance(StepRecorder(), StepTracer)


def test_an_untraced_engine_writes_no_step_times() -> None:
    store = FakeStore()
    engine = make_engine(0, FakeConnector(store, 0))
    engine.add_request(text_request("A", [1, 2, 3], 4))
    outputs = run_until_idle(engine)
    assert outputs and outputs[-1].finished
    assert all(not set(STEP_METRICS) & set(o.metrics) for o in outputs)
    assert all(step_of(0, o.metrics) is None for o in outputs)
    engine.release("A")
    audit(engine, store)


def expect_nothing_at(conn: FakeConnector, *keys: str) -> list[threading.Event]:
    """Events set when a get of each key found nothing (the request asked before it came)."""
    return [conn.found_nothing.setdefault(k, threading.Event()) for k in keys]


def test_a_traced_stage_records_its_calls_and_the_chunks_it_waited_for() -> None:
    store, clock = FakeStore(), FakeClock(100.0)
    up, conn = FakeConnector(store, 0), FakeConnector(store, 1)
    recorder = StepRecorder(clock=clock)
    engine = make_engine(1, conn, executor=TimedRelay(clock), clock=clock, tracer=recorder)
    asked_0, asked_1 = expect_nothing_at(conn, "R_0_0", "R_0_1")
    engine.add_request(placeholder("R"))  # arrives at 100
    assert engine.step() == []  # parked: chunk 0 is asked for
    assert asked_0.wait(TIMEOUT_S)

    assert up.put(0, 1, "R_0_0", chunk([1, 2])).ok  # committed at 100: it was waited for
    assert engine.wait_for_work(TIMEOUT_S)
    clock.advance(10.0)
    (out,) = engine.step()  # the call: 110 -> 113; chunk 1 is asked for meanwhile
    assert out.token_ids == [3, 5]
    assert step_of(1, out.metrics) == Step(1, 110.0, 113.0, 100.0, item_compute_s=CALL_S, arrival_s=100.0)
    assert asked_1.wait(TIMEOUT_S)

    clock.advance(7.0)
    assert up.put(0, 1, "R_0_1", chunk([3])).ok  # committed at 120: waited for
    # Chunk 2 is there before the request asks for it (when its next step is scheduled).
    assert up.put(0, 1, "R_0_2", chunk([4], finished=True)).ok
    assert engine.wait_for_work(TIMEOUT_S)
    clock.advance(10.0)
    (out,) = engine.step()  # 130 -> 133, on chunk 1
    assert step_of(1, out.metrics) == Step(1, 130.0, 133.0, 120.0, item_compute_s=CALL_S, arrival_s=100.0)

    assert engine.wait_for_work(TIMEOUT_S)
    clock.advance(7.0)
    (out,) = engine.step()  # 140 -> 143, on chunk 2, which did not keep it waiting
    assert out.finished and out.metrics["num_steps"] == 3.0  # the request's own metrics stay
    assert step_of(1, out.metrics) == Step(1, 140.0, 143.0, None, item_compute_s=CALL_S, arrival_s=100.0)
    assert recorder.leak_state() == {}  # the finished request is forgotten
    engine.release("R")
    audit(engine, store)


def test_an_executor_call_that_raised_made_no_step() -> None:
    class Broken(RelayLM):
        def step(self, batch: list[BatchItem]) -> list[ItemResult]:
            raise RuntimeError("boom")

    store = FakeStore()
    up, conn = FakeConnector(store, 0), FakeConnector(store, 1)
    recorder = StepRecorder()
    engine = make_engine(1, conn, executor=Broken(), tracer=recorder)
    engine.add_request(placeholder("R"))
    engine.step()
    assert up.put(0, 1, "R_0_0", chunk([1])).ok
    outputs: list[StageOutput] = []
    while not outputs:
        assert engine.wait_for_work(TIMEOUT_S)
        outputs = engine.step()
    (out,) = outputs
    assert out.finish_reason == "error" and "boom" in (out.error or "")
    assert step_of(1, out.metrics) is None
    engine.release("R")
    audit(engine, store)


# --------------------------------------------------------------------- the recorder alone


def item(iid: str) -> BatchItem:
    return BatchItem(
        internal_id=iid,
        external_id=iid,
        input_token_ids=[1],
        all_token_ids=[1],
        num_computed_tokens=0,
        is_prefill=True,
        sampling=SamplingParams(),
    )


def request(iid: str, arrival: float) -> Request:
    return Request(
        internal_id=iid,
        external_id=iid,
        stage_id=0,
        prompt_token_ids=[1],
        sampling=SamplingParams(),
        arrival_time=arrival,
    )


def test_a_batched_call_is_shared_by_its_requests_and_each_output_takes_its_own() -> None:
    clock = FakeClock(10.0)
    rec = StepRecorder(clock=clock)
    batch = [item("a"), item("b"), item("c"), item("d")]
    rec.call_started(batch)
    clock.advance(2.0)
    rec.call_ended(batch)
    a = StageOutput(request_id="a", stage_id=0, metrics={"num_steps": 1.0})
    rec.output_made(request("a", 9.0), a)
    assert a.metrics == {
        "num_steps": 1.0,
        "arrival_s": 9.0,
        "step_start_s": 10.0,
        "step_end_s": 12.0,
        "item_compute_s": 0.5,
    }
    # One output per call: a second output of the same request made by no call gets nothing.
    again = StageOutput(request_id="a", stage_id=0)
    rec.output_made(request("a", 9.0), again)
    assert again.metrics == {}
    assert rec.leak_state() == {"steps": ["b", "c", "d"]}  # non-streaming: no output yet
    for iid in "abcd":
        rec.request_done(iid)
    assert rec.leak_state() == {}


def test_a_chunk_counts_as_input_once_taken_and_only_if_it_was_waited_for() -> None:
    clock = FakeClock(0.0)
    rec = StepRecorder(clock=clock)

    def step_output() -> StageOutput:
        rec.call_started([item("a")])
        rec.call_ended([item("a")])
        out = StageOutput(request_id="a", stage_id=1)
        rec.output_made(request("a", 0.0), out)
        return out

    rec.chunk_ready("a", True)  # committed at 0, waited for
    clock.advance(1.0)
    rec.chunk_ready("other", True)
    assert "input_time_s" not in step_output().metrics  # not taken yet
    rec.chunks_taken(["a"])
    assert step_output().metrics["input_time_s"] == 0.0
    assert step_output().metrics["input_time_s"] == 0.0  # until the next chunk is taken
    rec.chunk_ready("a", False)  # already there when asked for
    assert step_output().metrics["input_time_s"] == 0.0
    rec.chunks_taken(["a"])
    assert "input_time_s" not in step_output().metrics
    assert rec.leak_state() == {"ready": ["other"]}
    rec.request_done("a")
    rec.request_done("other")
    assert rec.leak_state() == {}

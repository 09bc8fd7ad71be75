"""One stage engine driven step by step: batching, sends, releases, waiting, failures."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
import torch

from omnirelay.connectors.base import Connector, GetResult, is_prefix_match
from omnirelay.engine import (
    SamplingParams,
    StageEngine,
    StageOutput,
    StageRequest,
    build_stage_components,
    create_stage_engine,
    resolve_stage_roles,
)
from omnirelay.errors import ConfigError, PipelineError
from omnirelay.models.testing.toy import (
    CountingLM,
    RelayLM,
    SampleGenerator,
    expected_counting_tokens,
    toy_pipeline_config,
    toy_registry,
)
from omnirelay.payload import Codes, OmniPayload
from omnirelay.pipeline.config import PipelineConfig
from omnirelay.transfer import ChunkEnvelope, TransferConfig
from tests.engine_harness import TIMEOUT_S, GatedCountingLM, fast_transfer_config
from tests.stage_loop import StageLoopThread, run_stage_loop
from tests.transfer_fakes import FakeClock, FakeConnector, FakeStore, Gate

PIPELINE = toy_pipeline_config()


def make_engine(
    stage: int,
    connector: Connector | None,
    *,
    pipeline: PipelineConfig = PIPELINE,
    executor: Any = None,
    transfer_config: TransferConfig | None = None,
    clock: Any = time.monotonic,
    tracer: Any = None,
) -> StageEngine:
    parts = build_stage_components(toy_registry(), pipeline, stage)
    roles = resolve_stage_roles(pipeline, stage)
    if transfer_config is None and roles.has_transfer:
        transfer_config = fast_transfer_config(stage)
    return StageEngine(
        stage,
        pipeline,
        executor if executor is not None else parts.executor,
        connector,
        processor=parts.processor,
        transfer_config=transfer_config,
        clock=clock,
        tracer=tracer,
    )


def run_until_idle(engine: StageEngine) -> list[StageOutput]:
    outputs: list[StageOutput] = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


def audit(engine: StageEngine, store: FakeStore | None = None) -> None:
    """The leak audit: settle the adapter, apply what it reported (and take the completed
    releases, as the worker loop does after each step), then nothing is left."""
    for _ in range(10):
        assert engine.flush(TIMEOUT_S)
        run_until_idle(engine)
        engine.take_released()
        if not engine.leak_state():
            break
    assert engine.leak_state() == {}, engine.leak_state()
    if store is not None:
        assert store.live_keys() == [], store.live_keys()
    engine.shutdown()


def text_request(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> StageRequest:
    return StageRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens), **kw
    )


def chunk(codes: list[int], *, finished: bool = False) -> ChunkEnvelope:
    """A codec chunk as the upstream's adapter puts it (the toy processor's body)."""
    audio = torch.tensor(codes, dtype=torch.int64)
    return ChunkEnvelope(body=OmniPayload(codes=Codes(audio=audio)), is_finished=finished)


def placeholder(rid: str, n: int = 2) -> StageRequest:
    return StageRequest(request_id=rid, prompt_token_ids=[0] * n, is_placeholder=True, final_stage_id=2)


def collect_until_finished(outputs: queue.Queue[StageOutput], loop: StageLoopThread) -> list[StageOutput]:
    """Outputs of the loop thread up to the first finished one; then stop the loop."""
    got: list[StageOutput] = []
    while not got or not got[-1].finished:
        got.append(outputs.get(timeout=TIMEOUT_S))
    loop.stop()
    loop.join()
    return got


def by_request(outputs: list[StageOutput]) -> dict[str, list[StageOutput]]:
    out: dict[str, list[StageOutput]] = {}
    for o in outputs:
        out.setdefault(o.request_id, []).append(o)
    return out


# --------------------------------------------------------------------- batching, outputs


def test_concurrent_requests_batch_their_decode_steps() -> None:
    store = FakeStore()
    lm = CountingLM()
    engine = make_engine(0, FakeConnector(store, 0), executor=lm)
    for i in range(16):
        engine.add_request(text_request(f"q{i}", [i * 10], 6))
    outputs = run_until_idle(engine)
    assert lm.batch_sizes == {16: 6} and engine.health()["max_batch_size"] == 16
    got = by_request(outputs)
    for i in range(16):
        outs = got[f"q{i}"]
        assert [t for o in outs for t in o.token_ids] == expected_counting_tokens([i * 10], 6)
        assert [o.finished for o in outs] == [False] * 5 + [True] and outs[-1].finish_reason == "length"
        assert outs[-1].metrics["num_output_tokens"] == 6 and outs[-1].metrics["num_steps"] == 6
    audit(engine, store)


def test_a_non_streaming_request_gets_one_output_with_everything() -> None:
    engine = make_engine(0, FakeConnector(FakeStore(), 0))
    engine.add_request(text_request("q", [1], 4, stream=False))
    (out,) = run_until_idle(engine)
    assert out.finished and out.token_ids == [2, 3, 4, 5] and out.finish_reason == "length"
    audit(engine)


def test_stage_stop_tokens_always_apply_and_defaults_fill_an_unset_request() -> None:
    cfg = toy_pipeline_config(counter_max_tokens=3)
    engine = make_engine(0, FakeConnector(FakeStore(), 0), pipeline=cfg)
    engine.add_request(StageRequest(request_id="dflt", prompt_token_ids=[1]))  # sampling left unset
    outs = run_until_idle(engine)
    assert [t for o in outs for t in o.token_ids] == [2, 3, 4]  # the stage's max_tokens: 3
    audit(engine)


def test_admission_errors_are_outputs_not_exceptions() -> None:
    engine = make_engine(0, FakeConnector(FakeStore(), 0))
    engine.add_request(text_request("dup", [1], 5))
    engine.add_request(text_request("dup", [1], 5))
    engine.add_request(text_request("empty", [], 5))
    engine.add_request(text_request("zero", [1], 0))
    engine.add_request(text_request("", [1], 5))
    first = engine.step()
    errors = {o.request_id: o.error for o in first if o.finish_reason == "error"}
    assert set(errors) == {"dup", "empty", "zero", ""}
    assert "already active" in str(errors["dup"]) and "prompt is empty" in str(errors["empty"])
    assert "max_tokens must be >= 1" in str(errors["zero"]) and "non-empty" in str(errors[""])
    run_until_idle(engine)
    audit(engine)
    with pytest.raises(PipelineError, match="shut down"):
        engine.add_request(text_request("late", [1], 1))


def test_an_executor_error_fails_the_requests_of_its_batch_with_the_reason() -> None:
    class Broken(CountingLM):
        def step(self, batch: list[Any]) -> list[Any]:
            if self.num_calls == 1:
                raise RuntimeError("kernel panic")
            return super().step(batch)

    engine = make_engine(0, FakeConnector(FakeStore(), 0), executor=Broken())
    engine.add_request(text_request("a", [1], 5))
    engine.add_request(text_request("b", [1], 5))
    outputs = run_until_idle(engine)
    finals = [o for o in outputs if o.finished]
    assert {o.request_id for o in finals} == {"a", "b"}
    assert all(o.finish_reason == "error" and "kernel panic" in str(o.error) for o in finals)
    assert engine.health()["num_executor_errors"] == 1
    audit(engine)


# --------------------------------------------------------------------- sends (docs/protocol.md §10.8)


def test_a_text_only_request_never_puts_a_chunk() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 0)
    engine = make_engine(0, conn)
    engine.add_request(text_request("text-only", [5], 8, final_stage_id=0))
    outs = run_until_idle(engine)
    assert [t for o in outs for t in o.token_ids] == expected_counting_tokens([5], 8)
    assert engine.flush(TIMEOUT_S)
    h = engine.health()
    assert h["num_saves"] == 0 and h["transfer"]["sender"]["num_admitted"] == 0
    assert not any(e.startswith("put_start") for e in store.log)
    engine.release("text-only")
    assert engine.step() == []
    assert engine.take_released() == ["text-only"]  # nothing to drain: complete at once
    audit(engine, store)
    assert not any(e.startswith("put_start") for e in store.log)


def test_release_removes_the_chunks_nobody_read_after_the_terminal_is_out() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 0)
    gate = conn.put_gates["R_0_3"] = Gate("terminal put")
    engine = make_engine(0, conn)
    engine.add_request(text_request("R", [1], 4, final_stage_id=2))
    outs = run_until_idle(engine)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    gate.wait_started()  # the terminal is being put; three chunks are out, unread
    assert store.live_keys() == ["R_0_0", "R_0_1", "R_0_2"]
    engine.release("R")
    engine.step()
    # The prefix cleanup waits for the generation: a cleanup now would miss the terminal.
    assert engine.leak_state()["releasing"] == ["R"]
    assert store.live_keys() == ["R_0_0", "R_0_1", "R_0_2"]
    assert engine.take_released() == []  # not complete: the terminal is still being put
    gate.release()
    assert engine.flush(TIMEOUT_S)
    run_until_idle(engine)  # the retirement came with the events: clean by prefix
    assert store.live_keys() == []
    assert engine.health()["num_keys_released"] == 4
    assert engine.take_released() == ["R"]
    audit(engine, store)


def test_every_step_output_is_saved_and_the_terminal_carries_the_last_one() -> None:
    store = FakeStore()
    engine = make_engine(0, FakeConnector(store, 0))
    engine.add_request(text_request("R", [1], 3, final_stage_id=1))
    run_until_idle(engine)
    assert engine.flush(TIMEOUT_S)
    assert store.live_keys() == ["R_0_0", "R_0_1", "R_0_2"]
    envelopes = [store.objects[k][0] for k in store.live_keys()]
    assert [e.body.codes.audio.tolist() for e in envelopes] == [[2], [3], [4]]
    assert [e.is_finished for e in envelopes] == [False, False, True]
    engine.release("R")
    audit(engine, store)


def test_a_send_failure_fails_the_live_request_fast() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 0)
    conn.fail_after_create.add("R_0_1")
    # The failing put waits until the request is inside its third step: were it free to
    # fail at once, the loop could see the failure before that step and never reach it.
    put_gate = conn.put_gates["R_0_1"] = Gate("put R_0_1")
    lm = GatedCountingLM(gate_at_call=3)
    engine = make_engine(0, conn, executor=lm)
    engine.add_request(text_request("R", [1], 50, final_stage_id=2))
    outputs: queue.Queue[StageOutput] = queue.Queue()
    loop = StageLoopThread(engine, lambda outs: [outputs.put(o) for o in outs]).start()
    assert lm.reached.wait(TIMEOUT_S)  # two chunks saved, the request live in its third step
    put_gate.wait_started()
    put_gate.release()  # the second put fails now
    assert engine.flush(TIMEOUT_S)
    lm.gate.set()
    got = collect_until_finished(outputs, loop)
    (final,) = [o for o in got if o.finished]
    assert final.finish_reason == "error" and "put of 'R_0_1' failed" in str(final.error)
    assert len([o for o in got if not o.finished]) < 50
    engine.release("R")
    audit(engine, store)


def test_a_terminal_that_fails_after_the_finish_is_reported_late() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 0)
    conn.fail_after_create.add("R_0_1")
    # The terminal put fails only once the finish went out: were it free to fail at once,
    # the send worker could record the failure before ``run_until_idle`` stops looking,
    # and the late error would come in the same batch as the finish.
    put_gate = conn.put_gates["R_0_1"] = Gate("terminal put")
    engine = make_engine(0, conn)
    engine.add_request(text_request("R", [1], 2, final_stage_id=1))
    outs = run_until_idle(engine)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    put_gate.wait_started()
    put_gate.release()
    assert engine.flush(TIMEOUT_S)
    late = run_until_idle(engine)
    assert [(o.finish_reason, o.finished) for o in late] == [("error", True)]
    assert "could not deliver" in str(late[0].error) and "R_0_1" in str(late[0].error)
    engine.release("R")
    audit(engine, store)


# --------------------------------------------------------------------- receiving and waiting


def test_parked_requests_do_no_work_per_tick_and_an_idle_wait_sleeps() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 1)
    relay = RelayLM()
    engine = make_engine(
        1, conn, executor=relay, transfer_config=fast_transfer_config(1, fallback_poll_s=3600)
    )
    for i in range(500):
        engine.add_request(placeholder(f"p{i}"))
    assert engine.step() == []
    assert engine.flush(TIMEOUT_S)  # each registration is polled once (a notice may predate it)
    gets = sum(conn.num_gets.values())
    assert gets == 500 and engine.health()["scheduler"]["num_parked"] == 500
    assert not engine.has_work()
    for _ in range(200):
        assert engine.step() == []
    assert engine.flush(TIMEOUT_S)
    assert sum(conn.num_gets.values()) == gets and relay.num_calls == 0
    assert engine.health()["scheduler"]["num_items_scheduled"] == 0
    cpu = time.thread_time()
    assert engine.wait_for_work(0.3) is False
    assert time.thread_time() - cpu < 0.05 and engine.health()["num_wakeups"] == 0
    # One arrival: one get, one executor call with one item.
    sender = FakeConnector(store, 0)
    assert sender.put(0, 1, "p7_0_0", chunk([4])).ok
    assert engine.wait_for_work(TIMEOUT_S)
    (out,) = engine.step()
    assert out.request_id == "p7" and out.token_ids == [9]
    assert relay.batch_sizes == {1: 1} and sum(conn.num_gets.values()) in (gets + 1, gets + 2)
    for i in range(500):
        engine.release(f"p{i}")
    run_until_idle(engine)
    audit(engine, store)


def test_wait_for_work_wakes_on_a_command_from_another_thread() -> None:
    for pipeline in (PIPELINE, toy_pipeline_config(async_chunk=False)):
        conn = FakeConnector(FakeStore(), 0)
        engine = make_engine(
            0, conn if resolve_stage_roles(pipeline, 0).has_transfer else None, pipeline=pipeline
        )
        result: list[bool] = []
        started = threading.Event()

        def waiter(engine: StageEngine, started: threading.Event, result: list[bool]) -> None:
            started.set()
            result.append(engine.wait_for_work(TIMEOUT_S))

        t = threading.Thread(target=waiter, args=(engine, started, result))
        t.start()
        assert started.wait(TIMEOUT_S)
        engine.add_request(text_request("w", [1], 1))
        t.join(TIMEOUT_S)
        assert result == [True]
        assert run_until_idle(engine)[-1].finished
        audit(engine)


def test_a_corrupt_chunk_fails_the_request_fast_with_the_reason() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 1)
    conn.corrupt.add("C_0_0")
    engine = make_engine(1, conn)
    engine.add_request(placeholder("C"))
    engine.add_request(placeholder("ok"))
    engine.step()
    t0 = time.monotonic()
    assert FakeConnector(store, 0).put(0, 1, "C_0_0", chunk([1])).ok
    assert engine.wait_for_work(TIMEOUT_S)
    (out,) = engine.step()
    assert time.monotonic() - t0 < 5.0  # not the 600 s stall timeout
    assert out.request_id == "C" and out.finished and out.finish_reason == "error"
    assert "receive_failed at stage 1" in str(out.error) and "corrupt payload under 'C_0_0'" in str(out.error)
    assert engine.health()["scheduler"]["num_parked"] == 1  # the other request still waits
    engine.release("C")
    engine.release("ok")
    audit(engine, store)


def test_a_generation_stage_makes_audio_per_chunk() -> None:
    store = FakeStore()
    synth = SampleGenerator(samples_per_code=2)
    engine = make_engine(2, FakeConnector(store, 2), executor=synth)
    engine.add_request(placeholder("A", 4))
    engine.step()
    up = FakeConnector(store, 1)
    audio: list[float] = []
    for n, (codes, fin) in enumerate([([3, 4], False), ([5], False), ([], True)]):
        assert up.put(1, 2, f"A_1_{n}", chunk(codes, finished=fin)).ok
        outs: list[StageOutput] = []
        while not outs:
            assert engine.wait_for_work(TIMEOUT_S)
            outs = engine.step()
        for o in outs:
            if o.audio is not None:
                audio += o.audio.tolist()
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert audio == [3.0, 3.5, 4.0, 4.5, 5.0, 5.5] and synth.num_calls == 2
    engine.release("A")
    audit(engine, store)


def num_registrations(engine: StageEngine) -> int:
    """Chunk registrations the stage's adapter holds (requests waiting for a chunk)."""
    n: int = engine.health()["transfer"]["receiver"]["num_registrations"]
    return n


def test_when_a_receiver_asks_for_its_next_chunk() -> None:
    """An AR receiver has its next chunk on order while it steps (prefetch); a generation
    receiver asks for its next window only once its step's outputs were handed over (at
    the next wait or step), and is then woken by it as before."""
    store = FakeStore()
    up = FakeConnector(store, 0)
    relay = make_engine(1, FakeConnector(store, 1))
    relay.add_request(placeholder("R"))
    relay.step()
    assert num_registrations(relay) == 1  # chunk 0
    assert up.put(0, 1, "R_0_0", chunk([1, 2])).ok
    assert relay.wait_for_work(TIMEOUT_S)
    outs = relay.step()
    assert [t for o in outs for t in o.token_ids] == [3, 5]
    assert num_registrations(relay) == 1  # chunk 1 was asked for when the step was scheduled
    relay.release("R")
    audit(relay, None)

    synth = make_engine(2, FakeConnector(store, 2), executor=SampleGenerator(samples_per_code=1))
    synth.add_request(placeholder("A"))
    synth.step()
    assert num_registrations(synth) == 1
    mid = FakeConnector(store, 1)
    assert mid.put(1, 2, "A_1_0", chunk([7])).ok
    assert synth.wait_for_work(TIMEOUT_S)
    outs = synth.step()
    assert [o.audio.tolist() for o in outs if o.audio is not None] == [[7.0]]
    assert num_registrations(synth) == 0  # not yet: the outputs go out first
    assert not synth.wait_for_work(0.0)  # registers window 1 (nothing there yet), then waits
    assert num_registrations(synth) == 1
    assert mid.put(1, 2, "A_1_1", chunk([8], finished=True)).ok
    assert synth.wait_for_work(TIMEOUT_S)
    outs = synth.step()
    assert outs[-1].finished and [o.audio.tolist() for o in outs if o.audio is not None] == [[8.0]]
    synth.release("A")
    audit(synth, store)


# --------------------------------------------------------------------- aborts


def test_abort_lands_at_the_step_boundary_and_releases_everything() -> None:
    store = FakeStore()
    lm = GatedCountingLM(gate_at_call=3)
    engine = make_engine(0, FakeConnector(store, 0), executor=lm)
    engine.add_request(text_request("A", [1], 50, final_stage_id=2))
    outputs: queue.Queue[StageOutput] = queue.Queue()
    loop = StageLoopThread(engine, lambda outs: [outputs.put(o) for o in outs]).start()
    assert lm.reached.wait(TIMEOUT_S)  # blocked inside the third step
    engine.abort("A")
    engine.release("A")
    lm.gate.set()
    got = collect_until_finished(outputs, loop)
    # The step in flight completed (its token is out), then the abort applied.
    assert [o.token_ids for o in got] == [[2], [3], [4], []]
    assert got[-1].finish_reason == "abort" and lm.live == set()
    audit(engine, store)


# --------------------------------------------------------------------- construction


def test_roles_follow_the_pipeline_contracts() -> None:
    roles = [resolve_stage_roles(PIPELINE, s) for s in range(3)]
    assert [(r.send_to_stage, r.receive_from_stage) for r in roles] == [(1, None), (2, 0), (None, 1)]
    off = toy_pipeline_config(async_chunk=False)
    assert not any(resolve_stage_roles(off, s).has_transfer for s in range(3))
    engine = make_engine(0, None, pipeline=off)
    assert engine.health()["transfer"] is None
    engine.shutdown()


def test_construction_errors_name_the_problem() -> None:
    store = FakeStore()
    with pytest.raises(ConfigError, match="execution_type 'generation' but the stage is 'ar'"):
        make_engine(0, FakeConnector(store, 0), executor=SampleGenerator())
    with pytest.raises(ConfigError, match="needs a connector"):
        make_engine(0, None)
    with pytest.raises(ConfigError, match="send_to_stage is 2 but the pipeline's resolved contracts say 1"):
        make_engine(0, FakeConnector(store, 0), transfer_config=TransferConfig(stage_id=0, send_to_stage=2))
    with pytest.raises(ConfigError, match="stage_id is 1, expected 0"):
        make_engine(0, FakeConnector(store, 0), transfer_config=TransferConfig(stage_id=1))

    class ReadsNoChunks(SampleGenerator):
        read_chunk = None  # a generation executor that cannot say what a chunk means

    with pytest.raises(
        ConfigError, match="stage 2 receives chunks as a generation stage: it needs a chunk reader"
    ):
        make_engine(2, FakeConnector(store, 2), executor=ReadsNoChunks())
    assert store.live_keys() == []


def test_a_stalled_request_fails_with_the_timeout_it_exceeded() -> None:
    clock = FakeClock()
    store = FakeStore()
    engine = make_engine(
        1, FakeConnector(store, 1), clock=clock, transfer_config=fast_transfer_config(1, stall_timeout_s=5.0)
    )
    engine.add_request(placeholder("T"))
    assert engine.step() == []
    clock.advance(4.0)
    assert engine.step() == []
    clock.advance(2.0)
    (out,) = engine.step()
    assert out.finish_reason == "error" and "timeout at stage 1" in str(out.error)
    assert "no chunk 'T_0_0' arrived within the stall timeout of 5 s" in str(out.error)
    engine.release("T")
    audit(engine, store)


def test_release_of_a_live_request_is_silent_and_the_id_can_be_used_again() -> None:
    store = FakeStore()
    engine = make_engine(0, FakeConnector(store, 0))
    engine.add_request(text_request("R", [1], 50, final_stage_id=2))
    first = engine.step()
    assert [o.token_ids for o in first] == [[2]]
    engine.release("R")
    assert engine.step() == []  # no output: nobody waits for it any more
    assert engine.flush(TIMEOUT_S)
    run_until_idle(engine)
    assert engine.take_released() == ["R"]
    assert engine.leak_state() == {} and store.live_keys() == []
    engine.add_request(text_request("R", [5], 2, final_stage_id=1))
    outs = run_until_idle(engine)
    assert [t for o in outs for t in o.token_ids] == [6, 7] and outs[-1].finish_reason == "length"
    engine.release("R")
    audit(engine, store)


class NoticeBookConnector(FakeConnector):
    """Holds each arrival notice it received until a get takes it or a cleanup forgets it,
    as the ``nixl`` reader does (a dead producer's notice is never taken)."""

    def __init__(self, store: FakeStore, stage_id: int, notices: set[str]) -> None:
        super().__init__(store, stage_id)
        self.notices = set(notices)

    def get(self, from_stage: int, to_stage: int, key: str) -> GetResult:
        with self._lock:
            self.notices.discard(key)
        return super().get(from_stage, to_stage, key)

    def cleanup_prefix(self, prefix: str) -> int:
        with self._lock:
            self.notices = {k for k in self.notices if not is_prefix_match(k, prefix)}
        return super().cleanup_prefix(prefix)


@pytest.mark.parametrize("stage", [1, 2])
def test_release_forgets_the_notices_of_the_id_received_and_never_read(stage: int) -> None:
    """A dead producer's notices of R, never read: after R's release a reuse of R cannot
    take one of them (it would claim from the dead producer and fail)."""
    source = stage - 1
    store = FakeStore()
    kept = {f"S_{source}_0", f"R_{source}_1_0"}  # another id's, and id "R_<source>"'s
    conn = NoticeBookConnector(store, stage, {f"R_{source}_0", f"R_{source}_3", *kept})
    engine = make_engine(stage, conn)
    engine.release("R")
    assert engine.step() == []
    assert engine.take_released() == ["R"]
    assert conn.notices == kept
    audit(engine, store)


def test_reusing_an_id_whose_chunks_still_drain_fails_fast_with_the_reason() -> None:
    store = FakeStore()
    conn = FakeConnector(store, 0)
    gate = conn.put_gates["R_0_0"] = Gate("first put")
    engine = make_engine(0, conn)
    engine.add_request(text_request("R", [1], 50, final_stage_id=2))
    engine.step()
    gate.wait_started()
    engine.abort("R")  # its put is still in flight: the generation drains
    (aborted,) = engine.step()
    assert aborted.finish_reason == "abort"
    engine.add_request(text_request("R", [1], 50, final_stage_id=2))
    engine.step()
    (out,) = engine.step()
    assert out.finish_reason == "error" and "still drains" in str(out.error)
    gate.release()
    engine.release("R")
    audit(engine, store)


def test_the_worker_loop_stops_at_once_when_told_and_when_shut_down() -> None:
    engine = make_engine(0, FakeConnector(FakeStore(), 0))
    loop = StageLoopThread(engine, lambda outs: None, idle_wait_s=60.0).start()
    engine.add_request(text_request("x", [1], 1, final_stage_id=0))
    loop.stop()
    loop.join(5.0)  # a wake reaches the wait at once (not after 60 s)
    audit(engine)
    other = make_engine(0, FakeConnector(FakeStore(), 0))
    stop = threading.Event()
    t = threading.Thread(
        target=run_stage_loop,
        args=(other, lambda outs: None),
        kwargs={"should_stop": stop.is_set, "idle_wait_s": 60.0},
    )
    t.start()
    other.shutdown()
    t.join(5.0)
    assert not t.is_alive()


def test_release_by_prefix_on_the_shm_connector(namespace: str) -> None:
    """Stage 0 over the default backend (create_stage_engine), nobody reading: the release
    removes every /dev/shm object of the request (the fixture audits the namespace)."""
    pipeline = toy_pipeline_config(backend="shm", namespace=namespace)
    engine = create_stage_engine(pipeline, 0, toy_registry(), transfer_config=fast_transfer_config(0))
    engine.add_request(text_request("S", [1], 5, final_stage_id=2))
    engine.add_request(text_request("T", [1], 5, final_stage_id=0))
    run_until_idle(engine)
    assert engine.flush(TIMEOUT_S)
    connector = engine.health()["transfer"]["connector"]
    assert connector["backend"] == "shm" and connector["num_puts"] == 5 and connector["num_live_objects"] == 5
    engine.release("S")
    engine.release("T")
    run_until_idle(engine)
    assert engine.health()["transfer"]["connector"]["num_live_objects"] == 0
    assert engine.health()["num_keys_released"] == 5
    audit(engine)

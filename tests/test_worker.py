"""The stage worker's parts, in one process: control-plane messages, the control sockets,
the worker loop (commands, steps, outputs held or sent, completed releases, queries),
and the package's layering."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

import omnirelay.worker as worker_pkg
from omnirelay.engine.interfaces import SamplingParams, StageOutput, StageRequest
from omnirelay.errors import ConfigError, PipelineError
from omnirelay.orchestrator.front_control import FrontControl
from omnirelay.pipeline import parse_pipeline
from omnirelay.worker import WorkerLoop, WorkerSpec, leak_paths, load_engine_factory
from omnirelay.worker.factory import build_stage_engine
from omnirelay.worker.messages import (
    Abort,
    Goodbye,
    HealthReply,
    HealthRequest,
    Hello,
    LeakStateReply,
    LeakStateRequest,
    Outputs,
    Release,
    Released,
    RequestFailed,
    Shutdown,
    StageFatal,
    StartupFailed,
    Submit,
    decode_to_front,
    decode_to_worker,
    encode_message,
    stage_output,
    stage_request,
    wire_output,
    wire_request,
)
from omnirelay.worker.worker_control import CommandInbox, ControlPaths, WorkerControl


def test_the_worker_process_imports_nothing_of_the_front() -> None:
    """Layering: orchestrator → worker → engine. A worker process loads its package and
    the default engine factory without any of omnirelay.orchestrator."""
    code = (
        "import sys, omnirelay.worker, omnirelay.worker.factory; "
        "print(sorted(m for m in sys.modules if m.startswith('omnirelay.orchestrator')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -------------------------------------------------------------------------------- messages


def test_every_message_round_trips() -> None:
    req = StageRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(max_tokens=3, stop_token_ids=(7,)),
        is_placeholder=True,
        inputs={"audio": torch.arange(5, dtype=torch.float32), "n": 1},
        final_stage_id=2,
        extras={"t": torch.ones(2, 2, dtype=torch.bfloat16)},
    )
    out = StageOutput(
        request_id="r",
        stage_id=2,
        finished=True,
        finish_reason="stop",
        audio=torch.rand(8),
        sample_rate=24000,
    )
    to_worker = [
        Submit(wire_request(req)),
        Abort("r"),
        Release("r"),
        HealthRequest(1),
        LeakStateRequest(2, 0.5),
        Shutdown(),
    ]
    for m in to_worker:
        assert decode_to_worker(encode_message(m)) == m
    to_front = [
        Hello(0, 1),
        StartupFailed(0, 1, "boom"),
        Outputs(2, [wire_output(out)]),
        RequestFailed(1, "r", "x"),
        Released(1, "r"),
        StageFatal(1, "x"),
        HealthReply(1, 0, 3, 0, {"a": [1, 2], "nested": {"x": 1.5}}),
        LeakStateReply(2, 0, {"worker": {"num_held_outputs": 0}, "engine": {}}),
        Goodbye(0),
    ]
    for m in to_front:
        assert decode_to_front(encode_message(m)) == m
    back = stage_request(decode_to_worker(encode_message(Submit(wire_request(req)))).request)  # type: ignore[union-attr]
    assert torch.equal(back.inputs["audio"], req.inputs["audio"]) and back.inputs["n"] == 1
    assert back.extras["t"].dtype == torch.bfloat16 and back.sampling == req.sampling and back.is_placeholder
    got = stage_output(wire_output(out))
    assert torch.equal(got.audio, out.audio) and got.sample_rate == 24000 and got.finished


def test_reports_with_odd_values_still_encode() -> None:
    reply = HealthReply(1, 0, 3, 0, {"obj": object(), "np": torch.tensor(3)})
    back = decode_to_front(encode_message(reply))
    assert isinstance(back, HealthReply) and back.engine["np"] == 3 and "object" in back.engine["obj"]


def test_bad_frames_are_pipeline_errors() -> None:
    with pytest.raises(PipelineError):
        decode_to_worker(b"\x00garbage")
    with pytest.raises(PipelineError):
        decode_to_front(encode_message(Shutdown()))  # a front never receives a Shutdown


# ------------------------------------------------------------------------------ control


async def recv_messages(front: FrontControl, stage_id: int, n: int) -> list[Any]:
    """The next ``n`` messages of the stage, read as the orchestrator does: wait for the
    socket's descriptor, then take everything queued (one burst may hold several)."""
    loop = asyncio.get_running_loop()
    fd = front.fileno(stage_id)
    out: list[Any] = []
    while True:
        messages, num_bad, has_more = front.recv_ready(stage_id, limit=2)
        assert num_bad == 0
        out += messages
        if has_more:
            continue
        if len(out) >= n:
            assert len(out) == n, out
            return out
        readable: asyncio.Future[None] = loop.create_future()

        def on_readable(fut: asyncio.Future[None] = readable) -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            await asyncio.wait_for(readable, 5.0)
        finally:
            loop.remove_reader(fd)


def test_control_plane_round_trip_and_cleanup() -> None:
    paths = ControlPaths.create(2)

    async def main() -> None:
        front = FrontControl(paths)
        worker = WorkerControl(paths, 1)
        inbox = CommandInbox()
        woke = threading.Event()
        worker.start_receiving(inbox, wake=woke.set, is_parent_alive=lambda: True, parent_check_s=0.05)
        try:
            worker.send(Hello(1, os.getpid()))
            assert await recv_messages(front, 1, 1) == [Hello(1, os.getpid())]
            for rid in ("a", "b", "c"):
                worker.send(Released(1, rid))
            assert await recv_messages(front, 1, 3) == [Released(1, rid) for rid in ("a", "b", "c")]
            assert front.send(1, Abort("x"))
            assert await asyncio.to_thread(inbox.wait, 5.0)
            # The receiving thread wakes the engine after it has put the batch in the inbox:
            # wait for the wake, don't assume it already happened.
            assert await asyncio.to_thread(woke.wait, 5.0)
            assert inbox.take_all() == [Abort("x")]
            assert not front.send(0, Abort("y"))  # no worker connected to stage 0
        finally:
            worker.close()
            front.close()
            front.close()  # idempotent

    asyncio.run(main())
    assert not os.path.exists(paths.directory)


def test_orphaned_worker_gets_a_shutdown() -> None:
    paths = ControlPaths.create(1)
    front = FrontControl(paths)
    worker = WorkerControl(paths, 0)
    inbox = CommandInbox()
    try:
        worker.start_receiving(inbox, wake=lambda: None, is_parent_alive=lambda: False, parent_check_s=0.01)
        assert inbox.wait(5.0)
        assert inbox.take_all() == [Shutdown()]
    finally:
        worker.close()
        front.close()


# ---------------------------------------------------------------------------- worker loop


class RecordingEngine:
    """An in-process engine that records calls; ``wake`` is optional.

    Its releases complete at once, or — with ``releases_drain`` — only when the test calls
    :meth:`finish_draining` (as a transfer thread retiring the id's last sender would).
    """

    def __init__(self, *, with_wake: bool = True, releases_drain: bool = False) -> None:
        self.stage_id = 1
        self.calls: list[tuple[str, str]] = []
        self.requests: dict[str, int] = {}
        self.pending_outputs: list[StageOutput] = []
        self.releases_drain = releases_drain
        self.draining: set[str] = set()
        self.released: list[str] = []
        self.num_steps = 0
        self.num_wakes = 0
        self.fail_step = False
        self.cond = threading.Condition()
        if with_wake:
            self.wake = self._wake  # type: ignore[method-assign]

    def _wake(self) -> None:
        with self.cond:
            self.num_wakes += 1
            self.cond.notify_all()

    def add_request(self, request: StageRequest) -> None:
        self.calls.append(("add", request.request_id))
        self.requests[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))
        self.requests.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))
        self.requests.pop(request_id, None)
        if self.releases_drain:
            self.draining.add(request_id)
        else:
            self.released.append(request_id)

    def finish_draining(self, request_id: str) -> None:
        with self.cond:
            self.draining.remove(request_id)
            self.released.append(request_id)
            self.cond.notify_all()

    def step(self) -> list[StageOutput]:
        self.num_steps += 1
        if self.fail_step:
            raise RuntimeError("step broke")
        outs, self.pending_outputs = self.pending_outputs, []
        for o in outs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outs

    def take_released(self) -> list[str]:
        released, self.released = self.released, []
        return released

    def num_requests(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return bool(self.pending_outputs or self.released)

    def wait_for_work(self, timeout: float) -> bool:
        with self.cond:
            self.cond.wait(timeout)
        return self.has_work()

    def health(self) -> dict[str, Any]:
        return {"status": "healthy"}

    def leak_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": sorted(self.requests)}
        if self.draining or self.released:
            out.update(draining=sorted(self.draining), released=self.released)
        return out

    def shutdown(self) -> None:
        pass


def make_loop(engine: Any, **spec_kw: Any) -> tuple[WorkerLoop, CommandInbox, list[Any]]:
    cfg = parse_pipeline(
        {
            "name": "x",
            "stages": [
                {
                    "id": 0,
                    "name": "a",
                    "execution_type": "ar",
                    "executor": "e",
                    "final_output": True,
                    "final_output_type": "text",
                }
            ],
        }
    )
    spec = WorkerSpec(
        stage_id=1, pipeline=cfg, paths=ControlPaths("/nonexistent", 1), parent_pid=os.getpid(), **spec_kw
    )
    inbox = CommandInbox()
    sent: list[Any] = []
    return WorkerLoop(engine, inbox, sent.append, spec), inbox, sent


def submit(rid: str) -> Submit:
    return Submit(wire_request(StageRequest(request_id=rid, prompt_token_ids=[1])))


def test_worker_loop_applies_commands_steps_and_acknowledges_releases() -> None:
    engine = RecordingEngine()
    loop, inbox, sent = make_loop(engine)
    inbox.put(submit("a"))
    inbox.put(HealthRequest(7))
    loop.run_once()
    assert engine.calls == [("add", "a")]
    assert engine.num_steps == 1  # a posted command makes a tick
    (reply,) = sent
    assert isinstance(reply, HealthReply) and reply.seq == 7 and reply.num_requests == 1
    sent.clear()
    engine.pending_outputs = [StageOutput(request_id="a", stage_id=1, finished=True, token_ids=[3])]
    inbox.put(HealthRequest(8))
    loop.run_once()
    outs, reply = sent
    assert isinstance(outs, Outputs) and outs.outputs[0].token_ids == [3]
    assert isinstance(reply, HealthReply) and reply.num_requests == 0  # the engine's count
    sent.clear()
    inbox.put(Abort("a"))
    inbox.put(Release("a"))
    inbox.put(LeakStateRequest(8, 0.0))
    loop.run_once()
    assert engine.calls[-2:] == [("abort", "a"), ("release", "a")]
    # a release the engine completes at once is reported after that tick, the query after it
    assert [type(m).__name__ for m in sent] == ["Released", "LeakStateReply"]
    assert sent[0] == Released(1, "a") and leak_paths(sent[1].state) == []
    inbox.put(Shutdown())
    loop.run_once()
    assert loop.is_stopping


def test_released_is_said_exactly_when_the_engine_reports_the_release() -> None:
    engine = RecordingEngine(releases_drain=True)
    loop, inbox, sent = make_loop(engine, idle_wait_s=0.01)
    inbox.put(Release("r"))
    loop.run_once()  # applied, not complete: the id's chunks still drain in the engine
    loop.run_once()  # however long that takes, the worker says nothing (no timeout)
    assert engine.calls == [("release", "r")] and sent == []
    engine.finish_draining("r")  # the engine's transfer thread: the last sender retired
    loop.run_once()
    assert sent == [Released(1, "r")]
    loop.run_once()
    assert sent == [Released(1, "r")]  # once
    assert engine.leak_state() == {"requests": []}


def test_leak_state_settles_then_reports() -> None:
    engine = RecordingEngine()
    loop, inbox, sent = make_loop(engine)
    engine.requests["stuck"] = 1
    inbox.put(LeakStateRequest(1, 0.05))
    t0 = time.monotonic()
    loop.run_once()
    (reply,) = sent
    assert isinstance(reply, LeakStateReply) and reply.state["engine"] == {"requests": ["stuck"]}
    assert time.monotonic() - t0 >= 0.05
    assert leak_paths(reply.state) == ["engine.requests=['stuck']"]


def test_step_failure_is_fatal_and_reported() -> None:
    engine = RecordingEngine()
    loop, inbox, sent = make_loop(engine)
    engine.fail_step = True
    inbox.put(submit("a"))
    with pytest.raises(RuntimeError, match="step broke"):
        loop.run_once()
    (fatal,) = sent
    assert isinstance(fatal, StageFatal) and "step broke" in fatal.error


def test_engine_without_wake_waits_on_the_inbox_when_empty() -> None:
    engine = RecordingEngine(with_wake=False)
    loop, inbox, _ = make_loop(engine, idle_wait_s=30.0)
    assert loop.engine_wake is None
    t = threading.Timer(0.05, inbox.put, args=(Shutdown(),))
    t.start()
    t0 = time.monotonic()
    loop.run_once()  # idle, no request: blocks on the inbox, not for 30 s
    t.join()
    assert time.monotonic() - t0 < 10
    loop.run_once()
    assert loop.is_stopping


def test_engine_with_wake_is_woken_by_the_receive_thread() -> None:
    engine = RecordingEngine()
    loop, inbox, _ = make_loop(engine, idle_wait_s=30.0)

    def deliver() -> None:
        inbox.put(Shutdown())
        loop.wake()

    t = threading.Timer(0.05, deliver)
    t.start()
    t0 = time.monotonic()
    loop.run_once()
    t.join()
    assert time.monotonic() - t0 < 10 and engine.num_wakes == 1


def test_load_engine_factory_errors() -> None:
    for bad in ("nocolon", "no_such_module_xyz:f", "omnirelay.api:no_such_function"):
        with pytest.raises(ConfigError):
            load_engine_factory(bad)
    assert callable(load_engine_factory("benchmarks.parking_engine:build_parked_stage0_engine"))
    assert load_engine_factory(worker_pkg.DEFAULT_ENGINE_FACTORY) is build_stage_engine


def test_leak_paths() -> None:
    assert leak_paths({"a": 0, "b": [], "c": {}, "d": None, "e": "text", "f": False, "g_total": 9}) == []
    assert leak_paths({"a": {"b": 2}, "c": ["x"]}) == ["a.b=2", "c=['x']"]


def make_intermediate_loop(
    engine: Any, **spec_kw: Any
) -> tuple[WorkerLoop, CommandInbox, list[Any], list[float]]:
    """A worker loop of stage 1, an intermediate stage (no final output), on a manual clock."""
    cfg = parse_pipeline(
        {
            "name": "x",
            "async_chunk": False,
            "stages": [
                {
                    "id": 0,
                    "name": "a",
                    "execution_type": "ar",
                    "executor": "e",
                    "final_output": True,
                    "final_output_type": "text",
                },
                {"id": 1, "name": "b", "execution_type": "ar", "executor": "e", "input_sources": [0]},
            ],
        }
    )
    spec = WorkerSpec(
        stage_id=1, pipeline=cfg, paths=ControlPaths("/nonexistent", 2), parent_pid=os.getpid(), **spec_kw
    )
    inbox = CommandInbox()
    sent: list[Any] = []
    now = [0.0]
    loop = WorkerLoop(engine, inbox, sent.append, spec, clock=lambda: now[0])
    return loop, inbox, sent, now


def progress(rid: str, token: int) -> StageOutput:
    return StageOutput(request_id=rid, stage_id=1, token_ids=[token])


def sent_outputs(sent: list[Any]) -> list[list[tuple[str, list[int], bool]]]:
    """Each Outputs message as (request id, token ids, finished) per output."""
    return [
        [(w.request_id, w.token_ids, w.finished) for w in m.outputs] for m in sent if isinstance(m, Outputs)
    ]


def test_intermediate_stage_holds_progress_until_a_final_output_in_order() -> None:
    engine = RecordingEngine()
    loop, _, sent, _ = make_intermediate_loop(engine, progress_flush_s=10.0)
    assert loop.holds_progress
    engine.has_work = lambda: True  # type: ignore[method-assign]  # busy: the loop never waits
    for token in (1, 2):
        engine.pending_outputs = [progress("a", token)]
        loop.run_once()
    assert sent_outputs(sent) == []  # held: no client reads an intermediate stage's progress
    engine.pending_outputs = [progress("b", 7), StageOutput(request_id="a", stage_id=1, finished=True)]
    loop.run_once()
    assert sent_outputs(sent) == [[("a", [1], False), ("a", [2], False), ("b", [7], False), ("a", [], True)]]


def test_intermediate_stage_flushes_when_due_and_before_waiting() -> None:
    engine = RecordingEngine()
    loop, _, sent, now = make_intermediate_loop(engine, progress_flush_s=0.05, idle_wait_s=0.0)
    engine.pending_outputs = [progress("a", 1)]
    loop.run_once()  # the step's output is held; nothing else to do: flushed before the wait
    assert sent_outputs(sent) == [[("a", [1], False)]]
    sent.clear()
    engine.pending_outputs = [progress("a", 2)]
    engine.has_work = lambda: True  # type: ignore[method-assign]  # busy: the loop never waits
    loop.run_once()
    now[0] = 0.04
    engine.pending_outputs = [progress("a", 3)]
    loop.run_once()
    assert sent_outputs(sent) == []
    now[0] = 0.05  # the first held output is due
    engine.pending_outputs = [progress("a", 4)]
    loop.run_once()
    assert sent_outputs(sent) == [[("a", [2], False), ("a", [3], False), ("a", [4], False)]]
    sent.clear()
    engine.pending_outputs = [progress("a", 5)]
    loop.run_once()
    now[0] = 0.2
    loop.run_once()  # a step without outputs still sends what is due
    assert sent_outputs(sent) == [[("a", [5], False)]]


def test_release_drops_held_progress_of_its_id() -> None:
    engine = RecordingEngine()
    loop, inbox, sent, _ = make_intermediate_loop(engine, progress_flush_s=10.0, idle_wait_s=0.0)
    engine.has_work = lambda: True  # type: ignore[method-assign]
    engine.pending_outputs = [progress("a", 1), progress("b", 2)]
    loop.run_once()
    assert sent_outputs(sent) == []
    inbox.put(Release("a"))
    engine.has_work = lambda: False  # type: ignore[method-assign]
    loop.run_once()  # the release is applied and acknowledged
    assert sent == [Released(1, "a")]
    loop.run_once()  # nothing to do: what is held goes out before the loop waits
    assert sent_outputs(sent) == [[("b", [2], False)]]
    assert Released(1, "a") in sent
    assert sent.index(Released(1, "a")) < next(i for i, m in enumerate(sent) if isinstance(m, Outputs))


def test_error_outputs_and_final_stages_are_never_held() -> None:
    engine = RecordingEngine()
    loop, _, sent, _ = make_intermediate_loop(engine, progress_flush_s=10.0)
    engine.pending_outputs = [progress("a", 1)]
    engine.has_work = lambda: True  # type: ignore[method-assign]
    loop.run_once()
    engine.pending_outputs = [StageOutput(request_id="b", stage_id=1, error="broken")]
    loop.run_once()
    assert [[w.request_id for w in m] for m in ([o.outputs for o in sent if isinstance(o, Outputs)])] == [
        ["a", "b"]
    ]
    final_engine = RecordingEngine()
    final_loop, _, final_sent = make_loop(final_engine)
    assert not final_loop.holds_progress
    final_engine.pending_outputs = [StageOutput(request_id="a", stage_id=1, token_ids=[1])]
    final_loop.run_once()
    assert len(sent_outputs(final_sent)) == 1

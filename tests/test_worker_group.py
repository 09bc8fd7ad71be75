"""A device group: several stage engines in one process, one loop (omnirelay.worker.group).

In this process: the toy pipeline's three engines driven by one
:class:`~omnirelay.worker.group.GroupLoop` thread through their worker loops, with a
fake asynchronous executor (``launch`` returns a pending step that the test completes)
and by-reference in-process edges; every test ends with the harness's leak audit (no
object in the hub, no pending key, empty engine books, every release reported). With
processes: the scripted pipeline as one group, killed and restarted as one.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnirelay.api import Pipeline, RuntimeHooks
from omnirelay.connectors.inproc import InprocConnector
from omnirelay.engine.interfaces import BatchItem, ItemResult
from omnirelay.errors import RequestFailedError
from omnirelay.models.testing.toy import toy_registry
from omnirelay.pipeline import parse_pipeline
from omnirelay.pipeline.groups import process_groups
from omnirelay.worker.group import GroupLoop
from omnirelay.worker.loop import WorkerLoop
from omnirelay.worker.messages import Outputs, Released, ToFront, stage_output
from omnirelay.worker.spec import WorkerSpec
from omnirelay.worker.worker_control import CommandInbox, ControlPaths
from tests.engine_harness import TIMEOUT_S, ToyPipelineRun, fresh_namespace
from tests.orchestrator_audit import audit_stopped, pids_alive
from tests.test_engine_pipeline import assert_complete_and_correct
from tests.test_orchestrator_process import FACTORY, fake_config_data, sampling


class _Pending:
    """A launched step: its results are computed at launch; ``is_done`` says True once
    the executor's gate is open (a device's event that completes later), and never at
    the launch itself."""

    def __init__(self, results: list[ItemResult], gate: threading.Event) -> None:
        self._results = results
        self._gate = gate
        self.num_polls = 0

    def is_done(self) -> bool:
        self.num_polls += 1  # never at the first look: the launch returns with it in flight
        return self.num_polls > 1 and self._gate.is_set()

    def result(self) -> list[ItemResult]:
        assert self._gate.wait(TIMEOUT_S), "result() of a step whose gate never opened"
        return self._results


class AsyncExecutor:
    """A toy executor made asynchronous: ``launch`` runs the step's arithmetic and hands
    back a pending step; the gate (open unless a test closes it) completes it."""

    def __init__(self, inner: Any, stage_id: int, log: list[tuple[int, int]], group: list[GroupLoop]) -> None:
        self.inner = inner
        self.stage_id = stage_id
        self.execution_type = inner.execution_type
        self.supports_batching = inner.supports_batching
        self.gate = threading.Event()
        self.gate.set()
        self.launched = threading.Event()
        self.num_launches = 0
        #: each launched batch's internal ids
        self.batches: list[list[str]] = []
        self._log = log
        self._group = group
        read_chunk = getattr(inner, "read_chunk", None)
        if read_chunk is not None:
            self.read_chunk = read_chunk

    def launch(self, batch: list[BatchItem]) -> _Pending:
        self.num_launches += 1
        self.batches.append([item.internal_id for item in batch])
        self._log.append((self._group[0].num_iterations, self.stage_id))
        self.launched.set()
        return _Pending(self.inner.step(batch), self.gate)

    def step(self, batch: list[BatchItem]) -> list[ItemResult]:  # pragma: no cover - launch is used
        raise AssertionError("a group drives an executor with launch() through launch")

    def release(self, internal_id: str) -> None:
        self.inner.release(internal_id)

    def leak_state(self) -> dict[str, Any]:
        books = getattr(self.inner, "leak_state", None)
        return books() if callable(books) else {}


class GroupRun(ToyPipelineRun):
    """The toy pipeline's engines in one device group: one GroupLoop thread drives them
    through their worker loops; outputs and releases come back as the front gets them."""

    def __init__(self, *, idle_wait_s: float = 0.05, **kw: Any) -> None:
        self.launches: list[tuple[int, int]] = []
        holder: list[GroupLoop] = []
        namespace = fresh_namespace("grp")
        registry = toy_registry()
        from omnirelay.models.testing.toy import toy_pipeline_config

        pipeline = toy_pipeline_config(namespace=namespace)
        executors = {
            s.id: AsyncExecutor(
                registry.executors.get(s.executor)(**dict(s.executor_args)), s.id, self.launches, holder
            )
            for s in pipeline.stages
        }
        connectors = {s.id: InprocConnector(namespace, s.id, by_reference=True) for s in pipeline.stages}
        super().__init__(
            namespace=namespace,
            pipeline=pipeline,
            executors=executors,
            connectors=connectors,
            start=False,
            **kw,
        )
        self.executors = executors
        self.events: list[ToFront] = []
        paths = ControlPaths(directory="/nonexistent", num_workers=3)
        members = [
            WorkerLoop(
                e, CommandInbox(), self._to_front, WorkerSpec(e.stage_id, self.pipeline, paths, os.getpid())
            )
            for e in self.engines
        ]
        self.group = GroupLoop(members, idle_wait_s=idle_wait_s)
        holder.append(self.group)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-group", daemon=True)
        self._thread.start()
        self._is_started = True

    def _run(self) -> None:
        try:
            self.group.run()
        except BaseException as exc:  # pragma: no cover - the test reports it
            self.error = exc

    def _to_front(self, message: ToFront) -> None:
        self.events.append(message)
        if isinstance(message, Outputs):
            for wire in message.outputs:
                self.outputs.put(stage_output(wire))
        elif isinstance(message, Released):
            self._on_released(message.stage_id, [message.request_id])

    def pump(self, until: Any, *, on_output: Any = None) -> None:
        assert self.error is None, f"the group loop died: {self.error!r}"
        super().pump(until, on_output=on_output)

    def stop(self) -> None:
        for member in self.group.members:
            member.is_stopping = True
        self.group.waker.wake()
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive(), "the group loop did not stop"
        assert self.error is None, f"the group loop died: {self.error!r}"


@pytest.fixture
def run() -> Iterator[GroupRun]:
    r = GroupRun()
    with r:
        yield r


def test_a_group_serves_requests_launching_by_priority(run: GroupRun) -> None:
    tracks = [run.submit(f"r{i}", [i * 10], max_tokens=6) for i in range(4)]
    run.wait_done()
    for t in tracks:
        assert t.finished[0].finish_reason == "length" and len(t.tokens[0]) == 6
        assert t.waveform().numel() > 0
    assert {stage for _, stage in run.launches} == {0, 1, 2}
    by_iteration: dict[int, list[int]] = {}
    for iteration, stage in run.launches:
        by_iteration.setdefault(iteration, []).append(stage)
    # In one iteration the stage nearest the client launches first (the group's priority),
    # and steps of several stages were in flight together.
    assert all(stages == sorted(stages, reverse=True) for stages in by_iteration.values())
    assert any(len(stages) > 1 for stages in by_iteration.values())
    assert run.group.num_overlapped > 0
    # The books of the by-reference puts (they carry no bytes) settle in reap passes
    # that never fail.
    for engine in run.engines:
        assert engine.flush()
        assert engine.health()["transfer"]["num_errors"] == 0, engine.health()["transfer"]["last_error"]


def test_a_busy_stage_does_not_hold_the_chunks_of_another() -> None:
    # The counter never idles (a text-only request that would run for minutes), so the loop
    # never waits idle and its idle timer is an hour anyway. The synth stage (a generation
    # stage) must register its next chunk right after its step completes: were that left
    # to its next step, nothing would wake it, and its chunk would sit put meanwhile.
    with GroupRun(idle_wait_s=3600.0) as run:
        busy = run.submit("busy", [1], max_tokens=1_000_000, final_stage_id=0)
        tracks = [run.submit(f"w{i}", [i * 10], max_tokens=6) for i in range(3)]
        run.wait_done([t.request_id for t in tracks])
        for t in tracks:
            assert t.finished[2].finish_reason is not None and t.waveform().numel() > 0
        assert not busy.is_done
        run.abort("busy")
        run.pump(lambda: busy.released_by == {0, 1, 2})


def test_a_late_completion_does_not_hold_the_other_stages(run: GroupRun) -> None:
    relay = run.executors[1]
    relay.gate.clear()
    relay.launched.clear()
    first = run.submit("slow", [1], max_tokens=4)
    assert relay.launched.wait(TIMEOUT_S)
    # The relay's step is in flight and will not end; a text-only request runs to its end.
    text_only = run.submit("text", [500], max_tokens=5, final_stage_id=0)
    run.wait_done(["text"])
    assert text_only.tokens[0] == [501, 502, 503, 504, 505]
    assert not first.is_done and relay.num_launches == 1
    relay.gate.set()
    run.wait_done()
    assert first.finished[2].finish_reason is not None and first.waveform().numel() > 0


def test_an_abort_between_launch_and_completion_ends_the_request_cleanly(run: GroupRun) -> None:
    counter = run.executors[0]
    counter.gate.clear()
    counter.launched.clear()
    track = run.submit("gone", [7], max_tokens=50)
    assert counter.launched.wait(TIMEOUT_S)
    run.abort("gone")  # abort + release on every stage while the step is in flight
    counter.gate.set()
    run.pump(lambda: track.released_by == {0, 1, 2})
    # Releases reach this harness at once, outputs through its queue: the aborted
    # request's last outputs (queued before its releases) go to it, not to the reuse.
    run.pump(run.outputs.empty)
    reused = run.submit("gone", [7], max_tokens=3)  # the id comes back once every stage released it
    run.wait_done(["gone"])
    assert reused.tokens[0] == [8, 9, 10]


def test_by_need_a_first_chunk_never_shares_a_step_with_streams_that_have_audio_banked() -> None:
    """Code2Wav (the synth) chooses its steps by need: one code makes four seconds of audio
    here, so a stream that has played its first chunk is seconds ahead for the whole test
    and a step that decodes a first chunk holds first chunks only. Every stream still
    gets all its audio, an abort between a launch and its completion ends cleanly, and the
    audit finds nothing left."""
    with GroupRun(schedule_by_need=True) as run:
        synth = run.executors[2]
        synth.inner.sample_rate = 1
        counter = run.executors[0]
        counter.gate.clear()
        counter.launched.clear()
        gone = run.submit("gone", [70], max_tokens=40)
        assert counter.launched.wait(TIMEOUT_S)
        run.abort("gone")  # while the counter's step is in flight
        counter.gate.set()
        tracks = [run.submit(f"s{i}", [i * 10], max_tokens=8) for i in range(3)]
        run.pump(lambda: all(t.waveform().numel() > 0 for t in tracks))
        late = [run.submit(f"n{i}", [100 + i * 10], max_tokens=6) for i in range(4)]
        run.wait_done([t.request_id for t in (*tracks, *late)])
        run.pump(lambda: gone.released_by == {0, 1, 2})
        for t, max_tokens in [*((t, 8) for t in tracks), *((t, 6) for t in late)]:
            assert_complete_and_correct(t, max_tokens)
        seen: set[str] = set()
        for batch in synth.batches:
            firsts = [rid for rid in batch if rid not in seen]
            assert not firsts or len(firsts) == len(batch), batch  # first chunks alone
            seen.update(batch)
        assert len(seen) >= 7


# ------------------------------------------------------------------ a group of processes


def test_the_groups_of_a_pipeline() -> None:
    data = fake_config_data()
    assert process_groups(parse_pipeline(data)) == ((0,), (1,), (2,))  # the CPU: a process each
    assert process_groups(parse_pipeline({**data, "device_groups": "on"})) == ((0, 1, 2),)
    for stage in data["stages"]:
        stage["devices"] = "cuda:0"
    assert process_groups(parse_pipeline(data)) == ((0, 1, 2),)  # one device: one process by default
    assert process_groups(parse_pipeline({**data, "device_groups": "off"})) == ((0,), (1,), (2,))
    data["stages"][0]["own_process"] = True
    data["stages"][2]["env"] = {"X": "1"}  # its own process environment: alone
    assert process_groups(parse_pipeline(data)) == ((0,), (1,), (2,))
    data["stages"][2]["env"] = {}
    assert process_groups(parse_pipeline(data)) == ((0,), (1, 2))
    assert process_groups(parse_pipeline({**data, "device_groups": "off"})) == ((0,), (1,), (2,))
    with pytest.raises(Exception, match="device_groups"):
        parse_pipeline({**data, "device_groups": "sometimes"})


def test_a_dead_group_fails_its_stages_restarts_them_together_and_serves_again() -> None:
    config = parse_pipeline({**fake_config_data(), "device_groups": "on"})
    pipe = Pipeline.start(config, runtime=RuntimeHooks(engine_factory=FACTORY))
    try:
        pids = {s.stage_id: s.pid for s in pipe.health().stages}
        assert len(set(pids.values())) == 1, pids
        done = pipe.submit([1], modalities=["text", "audio"], sampling=sampling(3)).result(20)
        assert done.finish_reason in ("stop", "length") and done.audio is not None
        stalled = pipe.submit(
            [2], modalities=["text", "audio"], sampling=sampling(50), extras={"stall_after": 2}
        )
        next(o for o in stalled if o.modality == "audio")
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(RequestFailedError, match="SIGKILL"):
            stalled.result(timeout=5.0)
        pipe.wait_ready(timeout_s=60.0)
        health = pipe.health()
        new = {s.pid for s in health.stages}
        assert len(new) == 1 and new != {pids[0]}
        assert [s.num_restarts for s in health.stages] == [1, 1, 1]
        again = pipe.submit([3], modalities=["text", "audio"], sampling=sampling(3)).result(20)
        assert again.finish_reason in ("stop", "length") and again.audio is not None
        assert pipe.leaks() == []
    finally:
        pipe.shutdown()
    audit_stopped(pipe)
    assert pids_alive(list(pipe.pids().values())) == []


def test_an_in_process_edge_hands_the_object_itself_with_the_same_books() -> None:
    namespace = fresh_namespace("ref")
    producer = InprocConnector(namespace, 1, by_reference=True)
    consumer = InprocConnector(namespace, 2, by_reference=True)
    try:
        payload = {"codes": torch.arange(6).reshape(2, 3)}
        assert producer.put(1, 2, "r_1_0", payload).ok
        assert not producer.put(1, 2, "r_1_0", payload).ok  # unread: refused, as across processes
        assert list(consumer.wait_arrivals(2, timeout=0)) == ["r_1_0"]
        got = consumer.get(1, 2, "r_1_0")
        assert got.is_ready and got.obj is payload  # by reference: no copy
        assert not consumer.get(1, 2, "r_1_0").is_ready  # exactly one reader
        assert producer.reap_consumed() == 1 and producer.pending_keys() == []
        assert producer.put(1, 2, "r_1_1", payload).ok and producer.put(1, 2, "s_1_0", payload).ok
        assert producer.cleanup_prefix("r_1_") == 1  # an abort's cleanup withdraws unread objects
        producer.close()  # and close the rest
        assert producer.hub.live_keys() == [] and producer.pending_keys() == []
    finally:
        producer.close()
        consumer.close()

"""A tiny in-test orchestrator over three stage engines in one process (inproc connector).

:class:`ToyPipelineRun` builds the toy pipeline ``counter -> relay -> synth`` (chunked
edges), one :class:`StageEngine` per stage, each driven by a stage loop on its own thread
(:class:`~tests.stage_loop.StageLoopThread`), and routes their outputs like the
orchestrator does:

* ``submit`` — stage 0 with the prompt; placeholders to every chunk-receiving stage up to
  the request's ``final_stage_id`` (prewarm);
* a request is complete when every stage it was submitted to reported ``finished``; then
  it is released on every stage;
* an error output from any stage fails the request: abort on every stage, then release;
* ``abort`` — abort and release on every stage;
* each stage's completed releases (``take_released``, after every step) are recorded per
  request, as the orchestrator's id-reuse fence reads them.

:meth:`ToyPipelineRun.close` stops the loops, drives the engines until they are quiet and
runs the leak audit: no objects in the namespace, no pending keys, ``leak_state() == {}``
on every engine (engine + executor + adapter maps), and every ended request reported
released by every stage.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from omnirelay.connectors import create_connector
from omnirelay.connectors.base import Connector
from omnirelay.connectors.inproc import InprocConnector, hub_for
from omnirelay.engine import (
    SamplingParams,
    StageEngine,
    StageOutput,
    StageRequest,
    build_stage_components,
    create_stage_engine,
)
from omnirelay.models.testing.toy import CountingLM, toy_pipeline_config, toy_registry
from omnirelay.pipeline.config import PipelineConfig
from omnirelay.transfer import TransferConfig
from tests.stage_loop import StageLoopThread

TIMEOUT_S = 20.0
_NS = itertools.count()


def fresh_namespace(tag: str = "eng") -> str:
    return f"{tag}{os.getpid()}x{next(_NS)}"


def fast_transfer_config(stage_id: int, **kw: Any) -> TransferConfig:
    """Short idle waits so shutdown is quick; roles are filled in by the engine."""
    kw.setdefault("arrival_wait_s", 0.02)
    kw.setdefault("reap_interval_s", 0.02)
    return TransferConfig(stage_id=stage_id, **kw)


class GatedCountingLM(CountingLM):
    """A counting LM whose step number ``gate_at_call`` blocks until the test opens the gate."""

    def __init__(self, *, gate_at_call: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.gate_at_call = gate_at_call
        self.reached = threading.Event()
        self.gate = threading.Event()

    def step(self, batch: list[Any]) -> list[Any]:
        if self.num_calls + 1 == self.gate_at_call:
            self.reached.set()
            assert self.gate.wait(TIMEOUT_S), "the executor gate was never opened"
        return super().step(batch)


class CorruptingConnector(InprocConnector):
    """Publishes garbage bytes instead of the payload for the keys in ``corrupt_keys``."""

    def __init__(self, namespace: str, stage_id: int, corrupt_keys: set[str]) -> None:
        super().__init__(namespace, stage_id)
        self.corrupt_keys = corrupt_keys

    def put(self, from_stage: int, to_stage: int, key: str, obj: Any, to_replica: int = 0) -> Any:
        if key not in self.corrupt_keys:
            return super().put(from_stage, to_stage, key, obj, to_replica)
        self.inject_raw(to_stage, key, b"this is not an omnirelay payload")
        from omnirelay.connectors.base import PutResult

        return PutResult(ok=True, nbytes=32, handle=key)


@dataclasses.dataclass
class Track:
    """What the orchestrator knows about one request."""

    request_id: str
    prompt: list[int]
    final_stage_id: int
    submitted: set[int]
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    audio: list[torch.Tensor] = dataclasses.field(default_factory=list)
    finished: dict[int, StageOutput] = dataclasses.field(default_factory=dict)
    num_outputs: int = 0
    is_aborted: bool = False
    is_failed: bool = False
    is_done: bool = False
    #: the stages that reported the request's release complete
    released_by: set[int] = dataclasses.field(default_factory=set)

    def waveform(self) -> torch.Tensor:
        return torch.cat(self.audio) if self.audio else torch.zeros(0)


class ToyPipelineRun:
    def __init__(
        self,
        *,
        namespace: str | None = None,
        pipeline: PipelineConfig | None = None,
        executors: dict[int, Any] | None = None,
        connectors: dict[int, Connector] | None = None,
        idle_wait_s: float = 1.0,
        start: bool = True,
        schedule_by_need: bool = False,
        **pipeline_kw: Any,
    ) -> None:
        self.namespace = namespace or fresh_namespace()
        self.pipeline = pipeline or toy_pipeline_config(namespace=self.namespace, **pipeline_kw)
        self.hub = hub_for(self.namespace)
        registry = toy_registry()
        self.connectors: list[Connector] = []
        self.engines: list[StageEngine] = []
        for s in range(self.pipeline.num_stages):
            if not executors and not connectors:
                # The one-call path a worker process uses.
                engine = create_stage_engine(
                    self.pipeline,
                    s,
                    registry,
                    namespace=self.namespace,
                    transfer_config=fast_transfer_config(s),
                )
                assert engine._connector is not None
                self.connectors.append(engine._connector)
                self.engines.append(engine)
                continue
            parts = build_stage_components(registry, self.pipeline, s)
            executor = (executors or {}).get(s, parts.executor)
            conn = (connectors or {}).get(s) or create_connector(
                "inproc", namespace=self.namespace, stage_id=s
            )
            self.connectors.append(conn)
            self.engines.append(
                StageEngine(
                    s,
                    self.pipeline,
                    executor,
                    conn,
                    processor=parts.processor,
                    transfer_config=fast_transfer_config(s),
                    schedule_by_need=schedule_by_need,
                )
            )
        self.outputs: queue.Queue[StageOutput] = queue.Queue()
        self.log: list[StageOutput] = []
        self.tracks: dict[str, Track] = {}
        self._released_lock = threading.Lock()
        self.loops = [
            StageLoopThread(
                e,
                self._emit,
                on_released=lambda ids, s=e.stage_id: self._on_released(s, ids),  # type: ignore[misc]
                idle_wait_s=idle_wait_s,
                name=f"test-stage-{e.stage_id}",
            )
            for e in self.engines
        ]
        self._is_started = False
        if start:
            self.start()

    def start(self) -> None:
        for loop in self.loops:
            loop.start()
        self._is_started = True

    def executor(self, stage: int) -> Any:
        return self.engines[stage]._executor

    # ----------------------------------------------------------------- orchestrator

    def _emit(self, outputs: list[StageOutput]) -> None:
        for o in outputs:
            self.outputs.put(o)

    def _on_released(self, stage_id: int, request_ids: list[str]) -> None:
        with self._released_lock:
            for rid in request_ids:
                track = self.tracks[rid]
                assert track.is_done, f"stage {stage_id} released {rid!r} before it was told to"
                track.released_by.add(stage_id)

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        max_tokens: int = 8,
        final_stage_id: int = 2,
        stream: bool = True,
    ) -> Track:
        track = Track(request_id, list(prompt), final_stage_id, {0})
        self.tracks[request_id] = track
        self.engines[0].add_request(
            StageRequest(
                request_id=request_id,
                prompt_token_ids=list(prompt),
                sampling=SamplingParams(max_tokens=max_tokens),
                final_stage_id=final_stage_id,
                stream=stream,
            )
        )
        if final_stage_id > 0 and self.pipeline.any_stage_chunks():
            for s in range(1, final_stage_id + 1):
                if self.pipeline.stage_receives_chunks(s):
                    track.submitted.add(s)
                    self.engines[s].add_request(
                        StageRequest(
                            request_id=request_id,
                            prompt_token_ids=[0] * len(prompt),
                            is_placeholder=True,
                            final_stage_id=final_stage_id,
                            stream=stream,
                        )
                    )
        return track

    def abort(self, request_id: str) -> None:
        track = self.tracks[request_id]
        if track.is_done:
            return
        track.is_aborted = True
        self._end(track)

    def _end(self, track: Track) -> None:
        """Abort on every stage that may hold it, then release everywhere (docs/protocol.md §2.6–§2.8)."""
        track.is_done = True
        for s in sorted(track.submitted):
            if s not in track.finished:
                self.engines[s].abort(track.request_id)
        for e in self.engines:
            e.release(track.request_id)

    def route(self, o: StageOutput) -> None:
        self.log.append(o)
        track = self.tracks[o.request_id]
        track.num_outputs += 1
        if track.is_done:
            return  # late outputs of an ended request (abort answers)
        track.tokens.setdefault(o.stage_id, []).extend(o.token_ids)
        if o.audio is not None:
            track.audio.append(o.audio)
        if not o.finished:
            return
        track.finished[o.stage_id] = o
        if o.finish_reason == "error":
            track.is_failed = True
            self._end(track)
        elif track.submitted <= set(track.finished):
            track.is_done = True
            for e in self.engines:
                e.release(track.request_id)

    def pump(
        self, until: Callable[[], bool], *, on_output: Callable[[StageOutput], None] | None = None
    ) -> None:
        """Route outputs until ``until()`` holds (deadline: a hang fails the test)."""
        deadline = time.monotonic() + TIMEOUT_S
        while not until():
            for loop in self.loops:
                assert loop.error is None, f"stage loop died: {loop.error!r}"
            left = deadline - time.monotonic()
            assert left > 0, (
                f"timed out; pending: {[t.request_id for t in self.tracks.values() if not t.is_done][:10]}"
            )
            try:
                o = self.outputs.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            self.route(o)
            if on_output is not None:
                on_output(o)

    def wait_done(self, request_ids: Sequence[str] | None = None) -> None:
        ids = list(self.tracks) if request_ids is None else list(request_ids)
        self.pump(lambda: all(self.tracks[r].is_done for r in ids))

    # ----------------------------------------------------------------- teardown and audit

    def stop(self) -> None:
        for loop in self.loops:
            loop.stop()
        for loop in self.loops:
            loop.join(TIMEOUT_S)

    def quiesce(self) -> None:
        """Drive every engine until its commands, chunks and sends are all settled."""
        for _ in range(50):
            for e in self.engines:
                assert e.flush(TIMEOUT_S)
            for e in self.engines:
                while e.has_work():
                    for o in e.step():
                        self.outputs.put(o)
                    self._on_released(e.stage_id, e.take_released())
                self._on_released(e.stage_id, e.take_released())
            if all(not e.leak_state() for e in self.engines) and not any(e.has_work() for e in self.engines):
                return

    def audit(self) -> None:
        self.quiesce()
        while not self.outputs.empty():
            self.route(self.outputs.get_nowait())
        assert self.hub.live_keys() == [], f"objects left in the namespace: {self.hub.live_keys()[:10]}"
        for c in self.connectors:
            assert c.pending_keys() == [], f"pending keys left: {c.pending_keys()[:10]}"
            assert c.health().num_live_objects == 0, c.health()
        for e in self.engines:
            assert e.leak_state() == {}, f"stage {e.stage_id} state left: {e.leak_state()}"
        every_stage = set(range(len(self.engines)))
        unreleased = {
            t.request_id: t.released_by for t in self.tracks.values() if t.released_by != every_stage
        }
        assert not unreleased, f"releases not reported by every stage: {unreleased}"

    def close(self, *, audit: bool = True) -> None:
        try:
            if self._is_started:
                self.stop()
            if audit:
                self.audit()
        finally:
            for e in self.engines:
                e.shutdown()

    def __enter__(self) -> ToyPipelineRun:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(audit=exc_type is None)

"""A small scripted stage engine for the orchestrator's multi-process tests.

:class:`ScriptedEngine` implements :class:`StageEngineProtocol` over a real connector,
so leak audits see real /dev/shm objects, without the real scheduler:

* stage 0 (no input): emits one token per step, ``prompt[-1] + 1 + k`` for k = 0, 1, …
  up to ``max_tokens``; puts chunk ``{rid}_0_{k}`` (``{"token", "finished"}``) for
  stage 1 — on **every** request, text-only ones too (like the reference), so only the
  orchestrator's release-by-id keeps text-only requests from leaking;
* stage 1: for each chunk of stage 0 emits ``2 * token`` and puts ``{rid}_1_{k}``;
* stage 2: for each chunk of stage 1 emits 4 audio samples of value ``token``.

Knobs in ``StageRequest.extras`` (deterministic interleavings, no sleeps):

* ``stall_after`` — stage 0 emits this many tokens then waits forever (until aborted);
* ``stall_while`` — a file path: stage 0 emits nothing while the file exists (the test
  removes it to let the request go on); with ``stall_while_after`` n, it emits n tokens first;
* ``fail_stage`` / ``fail_after`` — that stage reports ``error`` after so many outputs;
* ``reject_stage`` — that stage's ``add_request`` raises;
* ``crash_stage`` — that stage's ``step`` raises (the engine is broken: the worker exits).

It has no ``wake()`` (optional in the protocol): the worker waits in slices for it,
while the real engine is woken by the control receive thread. Its releases complete at
once (``take_released`` hands each out after the step that applied it).

A replica of a replicated stage listens for its own notices and announces its chunks to
the next stage's replica the request is bound to (``StageRequest.send_to_replica``); its
health says how many requests it was given (``num_added``).

Build it in a worker with ``runtime=RuntimeHooks(engine_factory="tests.orchestrator_fakes:build_scripted_engine")``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.connectors import create_connector
from omnirelay.connectors.base import Connector, GetStatus
from omnirelay.engine.interfaces import StageOutput, StageRequest
from omnirelay.pipeline import PipelineConfig

SAMPLES_PER_TOKEN = 4
SAMPLE_RATE = 16000
FALLBACK_POLL_S = 0.05


def expected_text_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [prompt[-1] + 1 + k for k in range(max_tokens)]


def expected_audio(prompt: list[int], max_tokens: int) -> torch.Tensor:
    values = [2 * t for t in expected_text_tokens(prompt, max_tokens)]
    return torch.tensor(values, dtype=torch.float32).repeat_interleave(SAMPLES_PER_TOKEN)


@dataclass
class _Req:
    request: StageRequest
    num_emitted: int = 0
    next_chunk: int = 0
    is_finished: bool = False
    #: look for a chunk once without an arrival notice (it may have come before the request)
    should_probe: bool = True
    extras: dict[str, Any] = field(default_factory=dict)


class ScriptedEngine:
    """See the module docstring."""

    def __init__(self, stage_id: int, num_stages: int, connector: Connector, replica: int = 0) -> None:
        self.stage_id = stage_id
        self.num_stages = num_stages
        self.connector = connector
        self.replica = replica
        self.num_added = 0
        self._reqs: dict[str, _Req] = {}
        self._arrived: set[str] = set()
        self._released: list[str] = []
        self._next_fallback = 0.0
        self.num_steps = 0

    # -- protocol -----------------------------------------------------------------------

    def add_request(self, request: StageRequest) -> None:
        if request.extras.get("reject_stage") == self.stage_id:
            raise ValueError(f"stage {self.stage_id} rejects this request on purpose")
        self._reqs[request.request_id] = _Req(request, extras=dict(request.extras))
        self.num_added += 1

    def abort(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        self.connector.cleanup_prefix(f"{request_id}_{self.stage_id}_")

    def release(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        self.connector.cleanup_prefix(f"{request_id}_{self.stage_id}_")
        prefix = f"{request_id}_{self.stage_id - 1}_"
        self._arrived = {k for k in self._arrived if not k.startswith(prefix)}
        self._released.append(request_id)

    def take_released(self) -> list[str]:
        released, self._released = self._released, []
        return released

    def num_requests(self) -> int:
        return len(self._reqs)

    def has_work(self) -> bool:
        return any(self._runnable(r) for r in self._reqs.values())

    def wait_for_work(self, timeout: float) -> bool:
        if self.stage_id > 0:
            for key in self.connector.wait_arrivals(self.stage_id, timeout):
                if key.rsplit("_", 2)[0] in self._reqs:  # hints for ended requests are dropped
                    self._arrived.add(key)
            now = time.monotonic()
            if now >= self._next_fallback:
                # Notices are hints and may be lost (a full datagram queue): poll now and then.
                self._next_fallback = now + FALLBACK_POLL_S
                for r in self._reqs.values():
                    r.should_probe = True
        elif not self.has_work():
            time.sleep(timeout)  # stage 0 has nothing to wait for but the caller's timeout
        return self.has_work()

    def step(self) -> list[StageOutput]:
        self.num_steps += 1
        if any(r.extras.get("crash_stage") == self.stage_id for r in self._reqs.values()):
            raise RuntimeError(f"stage {self.stage_id} step crashed on purpose")
        outs: list[StageOutput] = []
        for rid, r in list(self._reqs.items()):
            if not self._runnable(r):
                continue
            out = self._step_one(rid, r)
            if out is not None:
                outs.append(out)
            if r.is_finished:
                del self._reqs[rid]
        return outs

    def health(self) -> dict[str, Any]:
        return {
            "status": "healthy",
            "num_requests": len(self._reqs),
            "num_steps": self.num_steps,
            "replica": self.replica,
            "num_added": self.num_added,
        }

    def leak_state(self) -> dict[str, Any]:
        while self.connector.reap_consumed():  # forget keys consumers already took
            pass
        return {
            "num_requests": len(self._reqs),
            "num_arrivals": len(self._arrived),
            "pending_keys": self.connector.pending_keys(),
        }

    def shutdown(self) -> None:
        self._reqs.clear()
        self.connector.close()

    # -- behaviour ------------------------------------------------------------------------

    def _key(self, rid: str, source: int, n: int) -> str:
        return f"{rid}_{source}_{n}"

    def _runnable(self, r: _Req) -> bool:
        rid = r.request.request_id
        if self.stage_id == 0:
            stall, hold = r.extras.get("stall_after"), r.extras.get("stall_while")
            if (
                hold is not None
                and r.num_emitted >= r.extras.get("stall_while_after", 0)
                and os.path.exists(hold)
            ):
                return False
            return stall is None or r.num_emitted < stall
        return r.should_probe or self._key(rid, self.stage_id - 1, r.next_chunk) in self._arrived

    def _fail_now(self, r: _Req) -> bool:
        return r.extras.get("fail_stage") == self.stage_id and r.num_emitted >= r.extras.get("fail_after", 0)

    def _step_one(self, rid: str, r: _Req) -> StageOutput | None:
        if self._fail_now(r):
            r.is_finished = True
            return StageOutput(
                request_id=rid,
                stage_id=self.stage_id,
                finished=True,
                finish_reason="error",
                error="injected failure",
            )
        if self.stage_id == 0:
            prompt = r.request.prompt_token_ids
            token = prompt[-1] + 1 + r.num_emitted
            finished = r.num_emitted + 1 >= r.request.sampling.max_tokens
        else:
            key = self._key(rid, self.stage_id - 1, r.next_chunk)
            self._arrived.discard(key)
            got = self.connector.get(self.stage_id - 1, self.stage_id, key)
            if got.status is GetStatus.NOT_YET:
                r.should_probe = False
                return None
            if got.status is GetStatus.FAILED:
                r.is_finished = True
                return StageOutput(
                    request_id=rid,
                    stage_id=self.stage_id,
                    finished=True,
                    finish_reason="error",
                    error=got.error,
                )
            r.next_chunk += 1
            r.should_probe = True  # the next chunk may have been announced already
            token = int(got.obj["token"]) * (2 if self.stage_id == 1 else 1)
            finished = bool(got.obj["finished"])
        r.num_emitted += 1
        r.is_finished = finished
        if self.stage_id + 1 < self.num_stages:
            key = self._key(rid, self.stage_id, r.num_emitted - 1)
            res = self.connector.put(
                self.stage_id,
                self.stage_id + 1,
                key,
                {"token": token, "finished": finished},
                r.request.send_to_replica,
            )
            assert res.ok, res.error
        if self.stage_id == 2:
            audio = torch.full((SAMPLES_PER_TOKEN,), float(token), dtype=torch.float32)
            return StageOutput(
                request_id=rid,
                stage_id=2,
                finished=finished,
                finish_reason="stop" if finished else None,
                audio=audio,
                sample_rate=SAMPLE_RATE,
            )
        return StageOutput(
            request_id=rid,
            stage_id=self.stage_id,
            finished=finished,
            finish_reason="length" if finished else None,
            token_ids=[token],
        )


def build_scripted_engine(pipeline: PipelineConfig, stage_id: int) -> ScriptedEngine:
    assert pipeline.namespace is not None
    replica = pipeline.stages[stage_id].replica
    connector = create_connector("shm", namespace=pipeline.namespace, stage_id=stage_id, replica=replica)
    return ScriptedEngine(stage_id, pipeline.num_stages, connector, replica)


def build_broken_engine(pipeline: PipelineConfig, stage_id: int) -> ScriptedEngine:
    """Stage 1 cannot be built (startup failure path)."""
    if stage_id == 1:
        raise RuntimeError("stage 1 cannot load its model (on purpose)")
    return build_scripted_engine(pipeline, stage_id)


def build_env_checked_engine(pipeline: PipelineConfig, stage_id: int) -> ScriptedEngine:
    """A scripted engine built only where the stage's process environment is in place
    (startup fails, naming the variable, where a value is missing or differs)."""
    import os

    for name, value in pipeline.stages[stage_id].process_env().items():
        if os.environ.get(name) != value:
            raise RuntimeError(f"{name} is {os.environ.get(name)!r} in the worker, expected {value!r}")
    return build_scripted_engine(pipeline, stage_id)


#: set by the front after its fork server started (tests/test_stage_process_env.py)
FRONT_FLAG = "OMNIRELAY_TEST_FRONT_FLAG"


def build_front_env_checked_engine(pipeline: PipelineConfig, stage_id: int) -> ScriptedEngine:
    """A scripted engine built only where the front's variable :data:`FRONT_FLAG` is
    ``front-now`` (the front set it after its fork server had started)."""
    import os

    if os.environ.get(FRONT_FLAG) != "front-now":
        raise RuntimeError(f"{FRONT_FLAG} is {os.environ.get(FRONT_FLAG)!r} in the worker")
    return build_scripted_engine(pipeline, stage_id)

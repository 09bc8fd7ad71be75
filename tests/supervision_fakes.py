"""Engine factories and helpers for the supervision tests (stage processes killed and restarted).

* :func:`build_held_engine` — the scripted engine of :mod:`tests.orchestrator_fakes`, whose
  build waits while the file named by ``$OMNIRELAY_TEST_HOLD_BUILD`` exists: a test
  creates the file before it kills a stage, so the restarted worker stays ``starting``
  exactly as long as the test wants (a blocking fake, not a sleep), then removes it.
  A request asking for :data:`STALL_TOKENS` tokens or more stalls in stage 0 after two
  (so a server's client can hold a stream open mid-way without engine knobs); an idle
  stage reaps what its consumers took, as the real engine's housekeeping does.
* :func:`kill_stage` — SIGKILL one stage's worker and return its pid.
"""

from __future__ import annotations

import os
import signal
import time

from omnirelay.api import Pipeline
from omnirelay.engine.interfaces import StageOutput, StageRequest
from omnirelay.pipeline import PipelineConfig
from tests.orchestrator_fakes import ScriptedEngine, build_scripted_engine

HOLD_ENV = "OMNIRELAY_TEST_HOLD_BUILD"
STALL_TOKENS = 1000


class _StallingEngine(ScriptedEngine):
    def step(self) -> list[StageOutput]:
        if not self._reqs:
            # Like the real engine's idle housekeeping: forget what consumers took since
            # the last put, so a live server's namespace shows no consumed object.
            self.connector.reap_consumed()
        return super().step()

    def add_request(self, request: StageRequest) -> None:
        super().add_request(request)
        if self.stage_id == 0 and request.sampling.max_tokens >= STALL_TOKENS:
            self._reqs[request.request_id].extras["stall_after"] = 2


def build_held_engine(pipeline: PipelineConfig, stage_id: int) -> ScriptedEngine:
    hold = os.environ.get(HOLD_ENV)
    while hold and os.path.exists(hold):
        time.sleep(0.01)  # the worker is "building its engine" until the test lets it go
    plain = build_scripted_engine(pipeline, stage_id)
    return _StallingEngine(plain.stage_id, plain.num_stages, plain.connector, plain.replica)


def kill_stage(pipe: Pipeline, stage_id: int) -> int:
    pid = pipe.pids()[stage_id]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return pid

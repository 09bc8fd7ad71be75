"""An engine that parks every request, for tests and measurements of the process layer.

* :class:`ParkingEngine` — a :class:`StageEngineProtocol` that takes every request and
  never produces anything: it holds them until abort or release (which completes at
  once). In stage 0 it keeps every downstream stage's prewarmed requests waiting for
  chunks that never come — an idle pipeline full of requests.
* :func:`build_parked_stage0_engine` — an engine factory (``Pipeline.start(..., runtime=RuntimeHooks(
  engine_factory="benchmarks.parking_engine:build_parked_stage0_engine"))``; workers are
  spawned with the parent's ``sys.path``, so this factory loads in them when the
  checkout's root is on it, as it is for the suite and ``python -m benchmarks....``):
  stage 0 parks, the other stages are the real engines of the default factory.
"""

from __future__ import annotations

import threading
from typing import Any

from omnirelay.engine.interfaces import StageEngineProtocol, StageOutput, StageRequest
from omnirelay.pipeline import PipelineConfig
from omnirelay.worker.factory import build_stage_engine

__all__ = ["ParkingEngine", "build_parked_stage0_engine"]


class ParkingEngine:
    """Holds requests, produces nothing; ``wait_for_work`` blocks until ``wake``."""

    def __init__(self, stage_id: int) -> None:
        self.stage_id = stage_id
        self._requests: dict[str, StageRequest] = {}
        self._released: list[str] = []
        self._cond = threading.Condition()
        self._is_woken = False
        self.num_steps = 0

    def add_request(self, request: StageRequest) -> None:
        self._requests[request.request_id] = request

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._released.append(request_id)  # nothing to drain: complete at once

    def step(self) -> list[StageOutput]:
        self.num_steps += 1
        return []

    def take_released(self) -> list[str]:
        released, self._released = self._released, []
        return released

    def num_requests(self) -> int:
        return len(self._requests)

    def has_work(self) -> bool:
        return False

    def wait_for_work(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._is_woken, timeout)
            self._is_woken = False
        return False

    def wake(self) -> None:
        with self._cond:
            self._is_woken = True
            self._cond.notify_all()

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "num_parked": len(self._requests), "num_steps": self.num_steps}

    def leak_state(self) -> dict[str, Any]:
        return {"parked": sorted(self._requests)} if self._requests else {}

    def shutdown(self) -> None:
        self._requests.clear()
        self.wake()


def build_parked_stage0_engine(pipeline: PipelineConfig, stage_id: int) -> StageEngineProtocol:
    """Stage 0 parks every request; the others are real (see the module docstring)."""
    if stage_id == 0:
        return ParkingEngine(stage_id)
    return build_stage_engine(pipeline, stage_id)

"""The server's leak audit asks the pipeline, not a connector, what its namespace holds.

``Pipeline.transfer_objects`` lists the namespace's transfer objects without reclaiming
anything (pooled slots are not counted); ``leak_audit`` reports them with the stages'
books and the requests still tracked, clean only when all are empty.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

import omnirelay.api.pipeline
from omnirelay.api import Pipeline
from omnirelay.connectors.base import NamespaceObject, ReclaimReport
from omnirelay.serving.audit import leak_audit


def _object(name: str, kind: str) -> NamespaceObject:
    return NamespaceObject(name, "ns", kind, owner_pid=1, owner_alive=True, age_s=0.0, size=64)


def test_transfer_objects_lists_the_namespace_without_reclaiming(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str | None, bool]] = []

    def fake_reclaim(namespace: str | None, *, reclaim: bool = True) -> ReclaimReport:
        calls.append((namespace, reclaim))
        return ReclaimReport([_object("ns-slot-0", "slot"), _object("ns-obj-7", "object")])

    monkeypatch.setattr(omnirelay.api.pipeline, "reclaim_namespace", fake_reclaim)
    pipe = cast(Pipeline, SimpleNamespace(namespace="ns"))
    assert Pipeline.transfer_objects(pipe) == ["ns-obj-7"]  # the pooled slot is not counted
    assert calls == [("ns", False)]


class _FakePipeline:
    def __init__(self, leaks: list[str], objects: list[str], num_active: int) -> None:
        self._leaks = leaks
        self._objects = objects
        self.num_active = num_active

    async def leaks_async(self) -> list[str]:
        return self._leaks

    def transfer_objects(self) -> list[str]:
        return self._objects


@pytest.mark.parametrize(
    ("leaks", "objects", "num_active", "num_in_flight", "clean"),
    [
        ([], [], 0, 0, True),
        (["stage 1: requests=['r']"], [], 0, 0, False),
        ([], ["ns-obj-7"], 0, 0, False),
        ([], [], 1, 0, False),
        ([], [], 0, 1, False),
    ],
)
def test_the_audit_is_clean_only_when_nothing_is_held(
    leaks: list[str], objects: list[str], num_active: int, num_in_flight: int, clean: bool
) -> None:
    pipe: Any = _FakePipeline(leaks, objects, num_active)
    report = asyncio.run(leak_audit(pipe, num_in_flight))
    assert report == {
        "clean": clean,
        "num_in_flight": num_in_flight,
        "pipeline_requests": num_active,
        "num_leaks": len(leaks),
        "leaks": leaks,
        "transfer_objects": len(objects),
    }

"""The front's parts, in one process: request handles, request-id validation, the
id-reuse fence of the orchestrator, and the public surface."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest
import torch

import omnirelay.api as api
import omnirelay.orchestrator as orchestrator_pkg
import omnirelay.worker as worker_pkg
from omnirelay.engine.interfaces import StageOutput
from omnirelay.errors import InvalidRequestError, PipelineError, RequestFailedError
from omnirelay.models.testing.toy import toy_pipeline_config
from omnirelay.orchestrator.handle import RequestHandle
from omnirelay.orchestrator.orchestrator import Orchestrator
from omnirelay.orchestrator.requests import PipelineRequest, RequestOutput
from omnirelay.worker.messages import (
    Outputs,
    Released,
    RequestFailed,
    wire_output,
)

# ------------------------------------------------------------------------ public surface


def test_exports() -> None:
    for pkg in (orchestrator_pkg, worker_pkg):
        for name in pkg.__all__:
            assert hasattr(pkg, name), name
        assert sorted(pkg.__all__) == pkg.__all__
    for name in api.__all__:
        assert hasattr(api, name), name


@pytest.mark.parametrize(
    "bad", ["", "x" * 257, "a\nb", "tab\t", "nul\x00", "del\x7f", "c1\x85", "\ud800", 5, None, b"id", ["id"]]
)
def test_request_id_validation_rejects(bad: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        api.validate_request_id(bad)
    assert "request_id" in str(info.value)
    assert isinstance(info.value, ValueError)  # also a ValueError for generic handlers


@pytest.mark.parametrize("good", ["a", "x" * 256, "../../etc/passwd", "résumé 👍", "task_1_0", "a b"])
def test_request_id_validation_accepts(good: str) -> None:
    assert api.validate_request_id(good) == good


# ------------------------------------------------------------------------------ handles


def out(finished: bool = False, reason: str | None = None, **kw: Any) -> RequestOutput:
    return RequestOutput(
        request_id="r", stage_id=0, modality="text", finished=finished, finish_reason=reason, **kw
    )


def test_handle_sync_iteration_and_result() -> None:
    done: list[str] = []
    h = RequestHandle("r", abort=lambda rid: done.append(f"abort {rid}"), on_done=done.append)
    h.deliver(out(token_ids=[1]))
    h.deliver(
        RequestOutput(
            request_id="r", stage_id=2, modality="audio", audio=torch.ones(2), sample_rate=8, finished=False
        )
    )
    h.deliver(out(True, "stop", token_ids=[2], text="hi"))
    h.deliver(out(token_ids=[99]))  # nothing follows a terminal output
    # Nor does a second end free the id again: by then a new request may hold it.
    h.deliver(out(True, "error", error="late"))
    assert done == ["r"] and h.is_finished
    res = h.result(timeout=1)
    assert res.token_ids() == [1, 2] and res.text == "hi" and res.finish_reason == "stop"
    assert res.audio is not None and res.audio.numel() == 2 and res.sample_rate == 8
    assert list(h) == []  # exhausted
    h.abort()
    assert done[-1] == "abort r"


def test_handle_failure_raises_and_abort_ends() -> None:
    h = RequestHandle("r")
    h.deliver(out(token_ids=[1]))
    h.deliver(
        RequestOutput(
            request_id="r", stage_id=1, modality="", finished=True, finish_reason="error", error="boom"
        )
    )
    assert next(h).token_ids == [1]
    with pytest.raises(RequestFailedError, match="boom") as info:
        next(h)
    assert info.value.request_id == "r" and info.value.reason == "boom"
    with pytest.raises(StopIteration):
        next(h)
    h2 = RequestHandle("r")
    h2.deliver(out(True, "abort"))
    assert h2.result(1).is_aborted
    with pytest.raises(TimeoutError):
        RequestHandle("r").next_output(timeout=0.01)
    with pytest.raises(PipelineError):
        RequestHandle("r").abort()  # not attached to a pipeline


def test_handle_async_iteration_across_threads() -> None:
    h = RequestHandle("r")
    started = threading.Event()

    def producer() -> None:
        started.wait(5)
        for i in range(3):
            h.deliver(out(token_ids=[i]))
        h.deliver(out(True, "length"))

    async def main() -> list[RequestOutput]:
        t = threading.Thread(target=producer)
        t.start()
        started.set()
        got = [o async for o in h]
        t.join()
        return got

    got = asyncio.run(main())
    assert [o.token_ids for o in got] == [[0], [1], [2], []] and got[-1].finished


# ------------------------------------------------------------------------- id-reuse fence


class RecordingFront:
    """The orchestrator's side of the control plane, in process: records what it sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, Any]] = []

    def send(self, stage_id: int, message: Any) -> bool:
        self.sent.append((stage_id, message))
        return True

    def take(self) -> list[tuple[int, str]]:
        out = [(sid, type(m).__name__) for sid, m in self.sent]
        self.sent.clear()
        return out


def make_orchestrator() -> tuple[Orchestrator, RecordingFront]:
    """An orchestrator of the three-stage toy pipeline whose workers are the test: its
    control plane records what it sends, and the test feeds it what workers say."""
    orch = Orchestrator(toy_pipeline_config(), namespace="unit")
    front = RecordingFront()
    orch._supervisor.control = front  # type: ignore[assignment]
    return orch, front


def text_only(rid: str) -> PipelineRequest:
    return PipelineRequest(request_id=rid, prompt_token_ids=[1], modalities=("text",))


def finished_text(rid: str) -> Outputs:
    return Outputs(
        0, [wire_output(StageOutput(request_id=rid, stage_id=0, finished=True, finish_reason="stop"))]
    )


def assert_front_books_empty(orch: Orchestrator) -> None:
    """The front's leak audit: no request, no fence, no parked reuse."""
    assert orch.num_requests == 0 and orch._handles == {}
    assert orch._fence.is_empty


def finish_the_admitted_reuse(orch: Orchestrator, front: RecordingFront, again: RequestHandle) -> None:
    """The reuse of R was just admitted: it reaches stage 0, ends, every stage releases it,
    and the front's books are empty."""
    assert front.take() == [(0, "Submit")]
    orch._on_message(0, finished_text("R"))
    assert again.result(1).finish_reason == "stop"
    for sid in range(3):
        orch._on_message(sid, Released(sid, "R"))
    assert_front_books_empty(orch)


def test_a_reused_id_is_parked_until_the_last_stage_reports_released() -> None:
    orch, front = make_orchestrator()
    first = RequestHandle("R")
    orch.admit(text_only("R"), first)
    assert front.take() == [(0, "Submit")]
    orch._on_message(0, finished_text("R"))
    assert first.result(1).finish_reason == "stop"
    assert front.take() == [(0, "Release"), (1, "Release"), (2, "Release")]
    again = RequestHandle("R")
    orch.admit(text_only("R"), again)  # the stages may still hold R's chunks: it waits
    orch._on_message(2, Released(2, "R"))
    orch._on_message(0, Released(0, "R"))
    orch._on_message(0, Released(0, "R"))  # a duplicate changes nothing
    assert front.take() == [] and not again.is_finished
    # Stage 1 is still fenced: what it says about R belongs to the ended request.
    orch._on_message(1, Outputs(1, [wire_output(StageOutput(request_id="R", stage_id=1, token_ids=[9]))]))
    orch._on_message(1, RequestFailed(1, "R", "late failure of the ended request"))
    assert orch.num_stale_messages == 2 and front.take() == []
    orch._on_message(1, Released(1, "R"))  # the last one: the reuse is admitted now
    finish_the_admitted_reuse(orch, front, again)


def test_a_dead_stage_drops_its_fences_and_an_aborted_reuse_leaves_nothing() -> None:
    orch, front = make_orchestrator()
    orch.admit(text_only("R"), RequestHandle("R"))
    orch._on_message(0, finished_text("R"))
    front.take()
    parked = RequestHandle("R")
    orch.admit(text_only("R"), parked)
    orch.abort("R")  # a parked reuse aborts without reaching any stage
    assert parked.result(1).is_aborted and front.take() == []
    again = RequestHandle("R")
    orch.admit(text_only("R"), again)
    for sid in (0, 1):
        orch._on_message(sid, Released(sid, "R"))
    orch._execute(orch._stage_failed(2, "stage 2 died"))  # no Released will come from it
    assert front.take() == [(0, "Submit")]  # admitted (stage 2 is not on a text-only path)
    orch._on_message(0, finished_text("R"))
    assert again.result(1).finish_reason == "stop"
    orch._on_message(0, Released(0, "R"))
    orch._on_message(1, Released(1, "R"))
    assert_front_books_empty(orch)


def test_the_ids_a_dead_stage_held_stay_fenced_until_its_objects_are_swept() -> None:
    # A reader may have mapped a slot of the dead process and hold the notice of an object
    # of the ended request: until the sweep withdraws it, a reuse of the id could get it.
    orch, front = make_orchestrator()
    first = RequestHandle("R")
    orch.admit(PipelineRequest(request_id="R", prompt_token_ids=[1], modalities=("text", "audio")), first)
    front.take()
    orch._execute(orch._stage_failed(1, "stage 1 died", swept_later=True))
    with pytest.raises(RequestFailedError):
        first.result(1)
    assert (1, "Release") not in front.take()  # the dead worker is told nothing
    orch._on_message(0, Released(0, "R"))
    orch._on_message(2, Released(2, "R"))
    orch._workers[1].is_dead = False  # restarted (its hello)
    orch._on_stage_up(1)
    again = RequestHandle("R")
    orch.admit(text_only("R"), again)
    assert front.take() == [] and not again.is_finished  # parked: the sweep has not run
    orch._on_swept(1)
    finish_the_admitted_reuse(orch, front, again)


def test_a_handle_frees_its_id_before_the_consumer_can_see_the_end() -> None:
    # A client that reads the last output and at once resubmits the same id must not be
    # told the id is still in flight: on_done runs before the terminal is visible.
    seen: list[bool] = []
    handle: RequestHandle

    def on_done(rid: str) -> None:
        seen.append(handle.is_finished)

    handle = RequestHandle("r", on_done=on_done)
    handle.deliver(RequestOutput(request_id="r", stage_id=0, modality="text", token_ids=[1]))
    assert seen == []
    handle.deliver(RequestOutput(request_id="r", stage_id=0, modality="text", finished=True))
    assert seen == [False]
    assert [o.finished for o in handle] == [False, True]


@pytest.mark.parametrize("close_first", [False, True])
def test_a_held_handle_frees_its_id_once_it_ended_and_was_closed(close_first: bool) -> None:
    freed: list[str] = []
    end = RequestOutput(request_id="r", stage_id=0, modality="text", finished=True, finish_reason="stop")
    handle = RequestHandle("r", on_done=freed.append, is_held=True)
    first, second = (handle.close, lambda: handle.deliver(end))
    if not close_first:
        first, second = second, first
    first()
    assert freed == []
    second()
    handle.close()  # idempotent
    assert freed == ["r"]
    plain: list[str] = []
    unheld = RequestHandle("q", on_done=plain.append)
    unheld.deliver(msgspec.structs.replace(end, request_id="q"))
    assert plain == ["q"]  # not held: free at the end, close or not

"""Admission by real-time capacity on a live pipeline (``toy-3stage``, ``max_audio_streams: 1``):
a second request for audio waits for the first stream to end, text is never held, a
waiting request aborts at once, ``/health``'s books show the gate, nothing is left after."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from omnirelay.api import Pipeline
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.pipeline import load_pipeline
from tests.orchestrator_audit import audit_running, audit_stopped

#: A stream long enough to be in flight while the test submits behind it.
LONG = 5_000


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    config = msgspec.structs.replace(load_pipeline("toy-3stage"), max_audio_streams=1)
    p = Pipeline.start(config)
    yield p
    audit_stopped(p)


@pytest.fixture
def audited(pipe: Pipeline) -> Iterator[Pipeline]:
    yield pipe
    audit_running(pipe)


def test_a_second_stream_starts_only_when_the_first_one_ends(audited: Pipeline) -> None:
    first = audited.submit([7], modalities=["text", "audio"], sampling=SamplingParams(max_tokens=LONG))
    second = audited.submit([9], modalities=["audio"], sampling=SamplingParams(max_tokens=8))
    # Both admissions ran on the front's loop before the first one's audio could come back.
    next(o for o in first if o.audio is not None and o.audio.numel())  # the first stream plays
    assert not first.is_finished
    reason = audited.capacity_problem(["audio"])
    assert reason is not None and "waiting for an audio stream" in reason
    assert audited.capacity_problem(["text"]) is None  # text takes no stream
    text = audited.submit([3], modalities=["text"], sampling=SamplingParams(max_tokens=4)).result(30)
    assert text.finish_reason == "length"
    with pytest.raises(TimeoutError):  # ... and the second has not started: it waits
        second.next_output(timeout=0)
    books = audited.health().audio_streams
    assert (books["num_audio_streams"], books["num_waiting"]) == (1, 1)
    assert first.result(60).finish_reason in ("stop", "length")
    done = second.result(60)
    assert done.finish_reason in ("stop", "length") and done.audio is not None and done.audio.numel() > 0
    health = audited.health().audio_streams
    assert health["max_audio_streams"] == 1 and health["num_audio_streams"] == 0
    assert health["num_waiting"] == 0


def test_a_waiting_request_aborts_at_once_and_frees_nothing_it_never_held(audited: Pipeline) -> None:
    first = audited.submit([7], modalities=["audio"], sampling=SamplingParams(max_tokens=LONG))
    waiting = audited.submit([8], modalities=["audio"], sampling=SamplingParams(max_tokens=LONG))
    next(o for o in first if o.audio is not None and o.audio.numel())
    assert audited.health().audio_streams["num_waiting"] == 1
    waiting.abort()
    assert waiting.result(10).finish_reason == "abort"
    first.abort()
    assert first.result(30).finish_reason == "abort"
    assert audited.leaks() == []  # no stream, no waiter, no stage state
